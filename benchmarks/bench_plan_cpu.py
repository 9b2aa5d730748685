"""Measured speed-up of the planned partition + recompute over even split + full recompute, on the reference
trainer (CPU, gloo, DP 1 x PP 2, tiny model), next to the simulator's prediction.

Same balanced data in every run (omnibal packs of real InternVL-1.2M statistics), so the runs differ only in
the stage split and the checkpoint sets:

* A: even split (by layer count), every layer checkpointed (the ablation's "before" partition and memory);
* C: even split, no checkpoints (A -> C: what dropping recompute gives);
* B: omnibal's plan: the exact joint partition + least recompute (none is forced: a CPU has memory to spare),
  then the simulator-scored neighbour search (A -> B: the planned partition and recompute together).

The cost table is the measured layer profile of the tiny model (``benchmarks/results/profile_tiny_cpu.json``),
calibrated on separate runs on other data exactly as ``bench_sim_validation.py`` does (the shared runs of
:mod:`benchmarks.cpu_runs`: its calibration runs, measured gloo links, the trainer's fixed p2p buffers).
Writes benchmarks/results/plan_cpu.json and .md. Run:

    python -m benchmarks.bench_plan_cpu [--steps 6] [--repeats 2] [--calibration-rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from benchmarks import cpu_runs as sv
from benchmarks.common import RESULTS, write_result
from omnibal.cost.presets import get_model_preset
from omnibal.cost.profile import cost_table_from_profile, load_profile
from omnibal.cost.table import microbatch_features
from omnibal.measure.links import measure_links
from omnibal.plan.joint import JointPlanner
from omnibal.plan.search import SearchConfig, search
from omnibal.plan.stages import StageModelConfig, layer_quantities
from omnibal.sim import SimConfig, simulate_epoch
from omnibal.train.feed import fixed_buffer
from omnibal.train.stage_layout import even_split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (plus one warm-up)")
    ap.add_argument("--samples", type=int, default=3000, help="rows of the real statistics per seed")
    ap.add_argument("--repeats", type=int, default=2, help="repeat every run this many times (median)")
    ap.add_argument("--calibration-rounds", type=int, default=2, help="rounds of the calibration runs")
    ap.add_argument("--budget-fraction", type=float, default=0.4,
                    help="run D's budget: smallest feasible + this fraction of the way to the no-recompute peak")
    args = ap.parse_args()

    spec = get_model_preset(sv.MODEL)
    names = [layer.name for layer in spec.layers()]
    steps = args.steps + 1
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:5.0f}s load {os.getloadavg()[0]:.1f}] {msg}",  # noqa: E731
                            file=sys.stderr, flush=True)
    profile_path = RESULTS / "profile_tiny_cpu.json"
    table = cost_table_from_profile(spec, load_profile(profile_path, spec))
    cal_stats, val_stats = sv.load_stats(args.samples, sv.CAL_SEED), sv.load_stats(args.samples, sv.VAL_SEED)
    log("measuring gloo links")
    links = measure_links()
    common = dict(table=table, steps=steps, names=names)

    # calibration: separate runs on other data (bench_sim_validation.CAL_SPECS); the ranks of this benchmark's
    # DP 1 x PP 2 runs share the machine's two cores, so the plan and the predictions use the shared-core table
    calib = sv.CalibrationData(table, names, cal_stats, steps)
    for rep in range(args.calibration_rounds):
        calib.run_round(rep, log)
    cal, _, ctable, jitter = calib.fit()
    log(f"calibration: {cal.to_dict()}")
    links = links["wall_clock"]

    # the plan: balanced packs of the validation data, as the trainer will run them
    _, sched, feats = sv.make_run("plan", dp=1, pp=2, mode="offline", ranges=None, recompute="none",
                                  seed=sv.VAL_SEED, stats=val_stats, **common)
    buf = fixed_buffer(sched, val_stats, mode="offline")
    buffer = np.broadcast_to(microbatch_features(buf.tiles, buf.tokens, buf.tokens * buf.tokens), feats.shape)
    sim_cfg = SimConfig(dp_size=1, p2p_bandwidth=links["p2p_bandwidth"], p2p_latency=links["p2p_latency"],
                        dp_bandwidth=links["dp_bandwidth"], dp_latency=links["dp_latency"],
                        step_overhead=cal.step_overhead, p2p_occupancy=1.0)
    stage_cfg = StageModelConfig(num_stages=2, num_microbatches=sv.NUM_MB, dp_size=1,
                                 p2p_bandwidth=links["p2p_bandwidth"], p2p_latency=links["p2p_latency"],
                                 memory_budget_bytes=None)
    q = layer_quantities(ctable, feats, stage_cfg)
    planner = JointPlanner(q, stage_cfg)
    anchor = planner.plan()

    def score(sp):
        res = simulate_epoch(ctable, sp.parts, sp.recompute_mask(len(names)), feats, sim_cfg, buffer_features=buffer)
        return float(res.step_time.mean()), False

    best, scored, _ = search(planner, anchor, score, SearchConfig(radius=2, top_k=5, sample_steps=None))
    plan = best.plan
    planned_ranges = [[plan.parts[s], plan.parts[s + 1]] for s in range(2)]
    planned_rec = tuple(tuple(names[i] for i in st.checkpointed) for st in plan.stages)
    log(f"plan: anchor {anchor.parts}, chosen {plan.parts}, checkpoints {planned_rec}")

    # D: the same under a memory budget that forces some recompute (between the smallest feasible budget
    # and the no-recompute peak), to measure adaptive recompute against full recompute on real runs
    lo = planner.min_memory_partition().bottleneck
    hi = max(st.memory_bytes for st in planner.evaluate(plan.parts, "none").stages)
    budget = lo + args.budget_fraction * (hi - lo)
    tight_cfg = StageModelConfig(num_stages=2, num_microbatches=sv.NUM_MB, dp_size=1,
                                 p2p_bandwidth=links["p2p_bandwidth"], p2p_latency=links["p2p_latency"],
                                 memory_budget_bytes=budget)
    tight_planner = JointPlanner(layer_quantities(ctable, feats, tight_cfg), tight_cfg)
    tight, _, _ = search(tight_planner, tight_planner.plan(), score,
                         SearchConfig(radius=2, top_k=5, sample_steps=None))
    tight_ranges = [[tight.plan.parts[s], tight.plan.parts[s + 1]] for s in range(2)]
    tight_rec = tuple(tuple(names[i] for i in st.checkpointed) for st in tight.plan.stages)
    log(f"budgeted plan ({budget / 2**20:.1f} MiB): {tight.plan.parts}, checkpoints {tight_rec}")

    even = [list(r) for r in even_split(len(names), 2)]
    configs = [("A: even split, full recompute", even, "full"),
               ("C: even split, no recompute", even, "none"),
               ("B: omnibal plan (joint partition + recompute, searched)", planned_ranges, planned_rec),
               (f"D: omnibal plan under a {budget / 2**20:.0f} MiB budget", tight_ranges, tight_rec)]
    prepared = []
    for name, ranges, rec in configs:
        run, sched_r, feats_r = sv.make_run(name, dp=1, pp=2, mode="offline", ranges=[tuple(r) for r in ranges],
                                            recompute="full" if rec == "full" else "none", seed=sv.VAL_SEED,
                                            stats=val_stats, **common)
        if isinstance(rec, tuple):
            run["recompute_sets"] = rec
        mask = np.zeros(len(names), bool)
        if rec == "full":
            mask[:] = True
        elif isinstance(rec, tuple):
            mask[[names.index(n) for s in rec for n in s]] = True
        cuts = [r[0] for r in ranges] + [ranges[-1][1]]
        sim = simulate_epoch(ctable, cuts, mask, feats_r[1:], sim_cfg, buffer_features=buffer[1:])
        prepared.append((name, ranges, rec, run, sched_r, sim, []))
    for rep in range(args.repeats):  # every configuration once per round, so the machine's drift hits all alike
        for name, _, _, run, sched_r, _, measured in prepared:
            log(f"running {name} (repeat {rep + 1})")
            records = sv.launch(run, val_stats, sched_r)[1:]
            wall = np.array([r["step_s"] for r in records])
            measured.append({"wall_s": float(wall.sum()), "load": float(np.mean([r["load"] for r in records]))})
    rows = []
    for name, ranges, rec, _, _, sim, measured in prepared:
        rows.append({"name": name, "ranges": ranges, "recompute": rec if not isinstance(rec, tuple) else
                     [list(s) for s in rec], "predicted_s": float(sim.step_time.sum()),
                     "measured_s": float(np.median([m["wall_s"] for m in measured])), "runs": measured})
        log(f"{name}: measured {rows[-1]['measured_s']:.2f} s, predicted {rows[-1]['predicted_s']:.2f} s")

    a = rows[0]
    doc = {"model": sv.MODEL, "timed_steps": args.steps, "repeats": args.repeats, "samples": args.samples,
           "calibration": {**cal.to_dict(), "rank_jitter": jitter}, "links": links,
           "budget_run_d_bytes": budget, "smallest_budget_bytes": lo, "no_recompute_peak_bytes": hi,
           "plan": {"anchor": list(anchor.parts), "chosen": list(plan.parts),
                    "scored": [{"parts": list(c.plan.parts), "sim_step_s": c.sim_step_time} for c in scored]},
           "rows": rows}
    lines = ["# Planned partition + recompute vs even split + full recompute, measured on the CPU trainer", "",
             f"Reference trainer, model `{sv.MODEL}`, DP 1 x PP 2 (1F1B, gloo, one torch thread per rank), "
             f"{sv.NUM_MB} micro-batches per step of omnibal's balanced packs ({args.samples} rows of the real "
             f"AI2D + ChartQA statistics); {args.steps} timed steps after one warm-up, median of {args.repeats} "
             "interleaved rounds; *measured* is the wall clock. The planner and the simulator use the measured layer "
             f"profile calibrated on separate runs on other data ({args.calibration_rounds} rounds of "
             "`benchmarks.cpu_runs.CAL_SPECS`, shared-core factor "
             f"{cal.shared_host_scale:.3f}). Produced by `python -m benchmarks.bench_plan_cpu`.", "",
             f"Plan: exact joint optimum {list(anchor.parts)}, searched (radius 2, simulated) -> "
             f"{list(plan.parts)}; checkpoints: none needed (CPU memory). Run D gives the planner a budget "
             f"{args.budget_fraction:.0%} of the way from the smallest feasible ({lo / 2**20:.1f} MiB) to the "
             f"no-recompute peak ({hi / 2**20:.1f} MiB): {budget / 2**20:.1f} MiB per stage (planned, not "
             "enforced by the CPU trainer).", "",
             "| run | stage layers | checkpointed | measured s | predicted s | measured speed-up vs A | "
             "predicted speed-up vs A | load |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        rec = r["recompute"] if isinstance(r["recompute"], str) else (
            ", ".join(n for s in r["recompute"] for n in s) or "none")
        load = np.mean([m["load"] for m in r["runs"]])
        lines.append(f"| {r['name']} | {r['ranges']} | {rec} | {r['measured_s']:.2f} | {r['predicted_s']:.2f} | "
                     f"{a['measured_s'] / r['measured_s']:.2f}x | {a['predicted_s'] / r['predicted_s']:.2f}x | "
                     f"{load:.1f} |")
    write_result("plan_cpu", doc, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
