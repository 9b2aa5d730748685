"""Time the exact partition (100 layers into 16 stages) and the joint partition + recompute search.

Writes benchmarks/results/plan_partition.json and .md. Run:
    PYTHONPATH=src python benchmarks/bench_plan_partition.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from omnibal.plan.joint import JointPlanner  # noqa: E402
from omnibal.plan.partition import min_max_partition  # noqa: E402
from omnibal.plan.stages import StageModelConfig, layer_quantities  # noqa: E402
from plan_helpers import uniform_features, vlm_like_table  # noqa: E402

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
        tmin, tmed, cpu, part = best_of(lambda: min_max_partition(costs, num_stages, boundary))
        rows.append({"what": "min-max partition", "layers": num_layers, "stages": num_stages,
                     "min_s": tmin, "median_s": tmed, "cpu_s": cpu, "bottleneck": part.bottleneck})
    # joint: a VLM-shaped 100-layer chain (1 + 45 ViT + 2 + 51 LLM + 1 = 100), tight memory budget
    table = vlm_like_table(num_vision=45, num_llm=51)
    for num_stages in (4, 16):
        cfg = StageModelConfig(num_stages=num_stages, num_microbatches=2 * num_stages, dp_size=8)
        q = layer_quantities(table, uniform_features(), cfg)
        lo = JointPlanner(q, cfg).min_memory_partition().bottleneck
        cfg = StageModelConfig(num_stages=num_stages, num_microbatches=2 * num_stages, dp_size=8,
                               memory_budget_bytes=1.3 * lo)
        tmin, tmed, cpu, res = best_of(lambda: JointPlanner(q, cfg).plan(), repeats=3)
        rows.append({"what": "joint partition + recompute", "layers": q.num_layers, "stages": num_stages,
                     "min_s": tmin, "median_s": tmed, "cpu_s": cpu, "bottleneck": res.bottleneck,
                     "checkpointed_layers": int(sum(len(s.checkpointed) for s in res.stages))})
    load = os.getloadavg()[0]
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "plan_partition.json").write_text(json.dumps({"load_1min": load, "rows": rows}, indent=2) + "\n")
    lines = [f"Load average (1 min) while measuring: {load:.2f} (2 cores shared with other agents); best and "
             f"median of {REPEATS} runs (joint: 3).", "",
             "| what | layers | stages | best wall (ms) | median wall (ms) | best CPU (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['layers']} | {r['stages']} | {1e3 * r['min_s']:.2f} | "
                     f"{1e3 * r['median_s']:.2f} | {1e3 * r['cpu_s']:.2f} |")
    (out / "plan_partition.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
