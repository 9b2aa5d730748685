"""Time the simulation of one epoch of 1.2M samples at DP 128 x PP 4 (target: <= 30 s on this machine).

Data: the synthetic InternVL-1.2M-like mixture (omnibal.stats.synthetic), and, when the balancer is
importable, its balanced schedule; otherwise random fixed micro-batches of 4 samples padded to their
longest sample (the baseline the trainer runs). Costs: the analytic table of InternVL-Chat-1.5
(InternViT-6B + InternLM2-20B) on A100-80G. Feature construction is timed separately from the simulation.

Writes benchmarks/results/sim_epoch.json and .md. Run:
    python -m benchmarks.bench_sim_epoch
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
from omnibal.sim import config_for_hardware, even_cuts, score_plan, simulate_epoch
from omnibal.stats.synthetic import synthetic_internvl_mixture
from omnibal.tables import markdown_table

REPEATS = 5
NUM_SAMPLES = 1_200_000
DP, PP, M, BATCH = 128, 4, 8, 4


def random_padded_features(tiles, tokens, *, dp, num_mb, batch, seed=0):
    """Random fixed micro-batches of ``batch`` samples, padded to their longest sample: [S, D, M, 4]."""
    n = len(tiles)
    per_step = dp * num_mb * batch
    steps = n // per_step
    order = np.random.default_rng(seed).permutation(n)[: steps * per_step].reshape(steps, dp, num_mb, batch)
    t = tokens[order].astype(np.float64)
    t_max = t.max(axis=-1)
    return microbatch_features(tiles[order].sum(axis=-1), batch * t_max, batch * t_max**2)


def timed(fn, repeats=REPEATS):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), float(np.median(times)), out


def main() -> None:
    spec = get_model_preset("internvl-chat-1.5")
    hw = get_hardware("a100-80g")
    table = analytic_cost_table(spec, hw, tp_size=1)
    stats = synthetic_internvl_mixture(NUM_SAMPLES, seed=0)
    config = config_for_hardware(hw, dp_size=DP, pp_size=PP, pp_schedule="1f1b")
    cuts = even_cuts(table.num_layers, PP)
    rec = np.ones(table.num_layers, bool)  # full recomputation, as the baseline recipe runs

    t0 = time.perf_counter()
    feats = random_padded_features(stats.tiles, stats.tokens, dp=DP, num_mb=M, batch=BATCH)
    feature_s = time.perf_counter() - t0

    rows = []
    tmin, tmed, res = timed(lambda: simulate_epoch(table, cuts, rec, feats, config))
    rows.append({"what": "simulate_epoch (full result)", "steps": int(feats.shape[0]),
                 "microbatches": int(np.prod(feats.shape[:3])), "min_s": tmin, "median_s": tmed})
    sample = feats[np.sort(np.random.default_rng(0).choice(len(feats), 192, replace=False))]
    tmin_s, tmed_s, _ = timed(lambda: score_plan(table, cuts, rec, sample, config), repeats=9)
    rows.append({"what": "score_plan, 192 sampled steps (planner)", "steps": 192,
                 "microbatches": int(np.prod(sample.shape[:3])), "min_s": tmin_s, "median_s": tmed_s})
    summary = res.summary()
    load = os.getloadavg()
    doc = {"load_avg_1_5_15": load, "num_samples": NUM_SAMPLES, "dp": DP, "pp": PP, "num_microbatches": M,
           "samples_per_microbatch": BATCH, "model": spec.name, "hardware": hw.name,
           "feature_build_s": feature_s, "rows": rows,
           "epoch": {k: summary[k] for k in ("num_steps", "num_gpus", "total_time_s", "gpu_days",
                                             "step_time_mean_s", "bubble_mean", "oom_steps")}}
    lines = [
        "# Simulating one epoch (1.2M samples, DP 128 x PP 4)", "",
        f"Synthetic InternVL-1.2M-like mixture, {DP * M} micro-batches of {BATCH} samples per step "
        f"(random, padded to the longest sample), {spec.name} on {hw.name}, 1F1B, even partition, full "
        f"recompute. Load average during the run: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (2 cores, "
        "shared with other agents). Times are the min and median of repeated runs, one thread.", "",
        markdown_table([["what", "steps", "micro-batches", "min s", "median s"]]
                       + [[r["what"], str(r["steps"]), f"{r['microbatches']:,}", f"{r['min_s']:.3f}",
                           f"{r['median_s']:.3f}"] for r in rows]),
    ]
    e = doc["epoch"]
    lines += ["", f"Building the features took {feature_s:.2f} s (not part of the simulation).", "",
              f"Simulated epoch: {e['num_steps']} steps, mean step {e['step_time_mean_s']:.2f} s, bubble "
              f"{e['bubble_mean']:.1%}, {e['total_time_s'] / 3600:.2f} h on {e['num_gpus']} GPUs = "
              f"{e['gpu_days']:.1f} GPU days; OOM steps: {e['oom_steps']}.", ""]
    write_result("sim_epoch", doc, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
