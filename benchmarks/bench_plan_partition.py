"""Time the exact partition (100 layers into 16 stages) and the joint partition + recompute search.

The joint search runs on the analytic cost table of InternVL-Chat-1.5 (InternViT-6B + InternLM2-20B, 97
layers) on A100-80G, with 16 micro-batches of 10 tiles and 4,000 tokens.

Writes benchmarks/results/plan_partition.json and .md. Run:
    python -m benchmarks.bench_plan_partition
"""

from __future__ import annotations

import os
import time

import numpy as np

from benchmarks.common import write_result
from omnibal.cost.analytic import analytic_cost_table
from omnibal.cost.hardware import get_hardware
from omnibal.cost.presets import get_model_preset
from omnibal.cost.table import microbatch_features
from omnibal.plan.joint import JointPlanner
from omnibal.plan.partition import min_max_partition
from omnibal.plan.stages import StageModelConfig, layer_quantities
from omnibal.tables import markdown_table

REPEATS = 7


def best_of(fn, repeats=REPEATS):
    """(best wall, median wall, best CPU, result): CPU time is what the wall time would be on an idle core."""
    times, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return min(times), float(np.median(times)), min(cpus), out


def main() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for num_layers, num_stages in ((100, 16), (97, 4), (200, 32)):
        costs = rng.uniform(0.5, 2.0, num_layers)
        boundary = rng.uniform(0.0, 0.1, num_layers - 1)
        tmin, tmed, cpu, part = best_of(lambda c=costs, s=num_stages, b=boundary: min_max_partition(c, s, b))
        rows.append({"what": "min-max partition", "layers": num_layers, "stages": num_stages,
                     "min_s": tmin, "median_s": tmed, "cpu_s": cpu, "bottleneck": part.bottleneck})
    # joint: the paper's 6B + 20B chain (1 + 45 ViT + 2 + 48 LLM + 1 = 97 layers), tight memory budget
    table = analytic_cost_table(get_model_preset("internvl-chat-1.5"), get_hardware("a100-80g"))
    features = np.tile(microbatch_features(10.0, 4000.0, 4000.0**2), (16, 1))
    for num_stages in (4, 16):
        cfg = StageModelConfig(num_stages=num_stages, num_microbatches=2 * num_stages, dp_size=8)
        q = layer_quantities(table, features, cfg)
        lo = JointPlanner(q, cfg).min_memory_partition().bottleneck
        cfg = StageModelConfig(num_stages=num_stages, num_microbatches=2 * num_stages, dp_size=8,
                               memory_budget_bytes=1.3 * lo)
        tmin, tmed, cpu, res = best_of(lambda q=q, cfg=cfg: JointPlanner(q, cfg).plan(), repeats=3)
        rows.append({"what": "joint partition + recompute", "layers": q.num_layers, "stages": num_stages,
                     "min_s": tmin, "median_s": tmed, "cpu_s": cpu, "bottleneck": res.bottleneck,
                     "checkpointed_layers": int(sum(len(s.checkpointed) for s in res.stages))})
    load = os.getloadavg()[0]
    lines = [f"Load average (1 min) while measuring: {load:.2f} (2 cores shared with other agents); best and "
             f"median of {REPEATS} runs (joint: 3).", ""]
    table = [["what", "layers", "stages", "best wall (ms)", "median wall (ms)", "best CPU (ms)"]]
    table += [[r["what"], str(r["layers"]), str(r["stages"]), f"{1e3 * r['min_s']:.2f}", f"{1e3 * r['median_s']:.2f}",
               f"{1e3 * r['cpu_s']:.2f}"] for r in rows]
    lines.append(markdown_table(table))
    write_result("plan_partition", {"load_1min": load, "rows": rows}, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
