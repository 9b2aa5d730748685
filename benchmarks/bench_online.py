"""baseline vs control vs online (OrchMLLM-style post-balancing) vs offline (omnibal's packs) on the CPU trainer.

Same world, same data (a random subset of the real InternVL-1.2M statistics in ../shared/data, synthetic
pixels/tokens of exactly those sizes), the `tiny` preset, one torch thread per rank, each mode over its whole
epoch through `omnibal train`, modes and layouts interleaved in rounds (a change of machine speed or load hits
all of them alike). Reported: real samples/s (median of the rounds), samples per CPU-second (load-robust),
and the per-phase max/mean across DP ranks of the vision and the LLM cost each mode's steps carry (mean
over steps; the cost model's per-sample costs, :func:`omnibal.data.online.phase_loads`).

The baseline pads its rows and recomputes every layer; ``control`` is online mode without its re-deal
(``--no-online-balance``: the same draws in unpadded packs, no recompute, every sample where it was drawn),
so control vs baseline is padding and recompute, and online vs control is the balance. The prediction for
a GPU cluster is :mod:`benchmarks.bench_online_sim`'s.

    python -m benchmarks.bench_online --samples 400 --layouts 2,4 --repeats 3

Writes benchmarks/results/online.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks import cpu_runs as sv
from benchmarks.common import RESULTS, logger, write_result
from benchmarks.trainer_runs import run_train
from omnibal.data.online import balance_phases, phase_loads
from omnibal.stats.io import save_stats
from omnibal.train.config import TRAIN_LAYOUT, TrainConfig
from omnibal.train.feed import random_microbatch_schedule
from omnibal.train.run import build_schedule

MODES = ("baseline", "control", "online", "offline")


def phase_balance(schedule, stats, dp: int, mode: str) -> tuple[float, float]:
    """Mean over steps of the per-phase max/mean across DP ranks of what each rank computes."""
    vis_r, llm_r = [], []
    for s in range(schedule.num_steps):
        groups = [np.concatenate([np.asarray(schedule.microbatch(s, r, k), np.int64)
                                  for k in range(schedule.num_microbatches)]) for r in range(dp)]
        if mode == "online":
            rows = np.concatenate(groups)
            a = balance_phases(stats.tiles[rows], stats.tokens[rows], dp_size=dp)
            vis_r.append(a.vision_max_mean)
            llm_r.append(a.llm_max_mean)
            continue
        v, t = phase_loads(groups, stats.tiles, stats.tokens)
        vis_r.append(v.max() / v.mean())
        llm_r.append(t.max() / t.mean())
    return float(np.mean(vis_r)), float(np.mean(llm_r))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4, help="samples per micro-batch of the local draws")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default="2,4", help="DP sizes (pp 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    raw = sv.load_real_subset(args.samples, args.seed)
    stats = sv.model_units(raw)
    work = Path(tempfile.mkdtemp(prefix="bench_online_"))
    stats_path = save_stats(raw, work / "stats.jsonl")
    log = logger("bench_online")
    layouts = []
    for dp in (int(x) for x in args.layouts.split(",")):
        # what `omnibal train --mode offline` balances itself from the statistics (no --schedule-file)
        cfg = TrainConfig(mode="offline", layout=replace(TRAIN_LAYOUT, dp_size=dp, num_microbatches=args.microbatches),
                          seed=args.seed, stats_path=str(stats_path))
        omni = build_schedule(cfg, stats)
        rand = random_microbatch_schedule(len(stats), dp_size=dp, num_microbatches=args.microbatches,
                                          batch_size=args.batch_size, seed=args.seed)
        common = ["--model", "tiny", "--stats", str(stats_path), "--dp", str(dp), "--microbatches",
                  str(args.microbatches), "--seed", str(args.seed), "--threads", "1", "--timeout", "300",
                  "--steps", "0"]
        online = common + ["--mode", "online", "--batch-size", str(args.batch_size)]
        layouts.append({"dp": dp, "schedule_of": {"baseline": rand, "control": rand, "online": rand, "offline": omni},
                        "args_of": {"baseline": common + ["--mode", "baseline", "--batch-size", str(args.batch_size)],
                                    "control": online + ["--no-online-balance"], "online": online,
                                    "offline": common + ["--mode", "offline"]},
                        "runs_of": {m: [] for m in MODES}})
    for rep in range(args.repeats):
        for lay in layouts:
            for mode in MODES:
                tag = f"{mode}_dp{lay['dp']}_r{rep}"
                log(tag)
                lay["runs_of"][mode].append(run_train(lay["args_of"][mode], work, tag, metrics_log=True,
                                                      timeout_s=1800))

    res = {"model": "tiny", "stats": raw.source,
           "num_samples": args.samples, "num_microbatches": args.microbatches, "batch_size": args.batch_size,
           "repeats": args.repeats, "runs": {}, "table": []}
    for lay in layouts:
        dp = lay["dp"]
        for mode in MODES:
            docs = lay["runs_of"][mode]
            sps = [d["summary"]["samples_per_s"] for d in docs]
            per_cpu = [d["summary"]["samples_per_s"] * d["summary"]["mean_step_s"]
                       / sum(r["cpu_s"] for r in d["summary"]["per_rank"]) for d in docs]
            vis, llm = phase_balance(lay["schedule_of"][mode], stats, dp, mode)
            row = {"dp": dp, "mode": mode, "steps": lay["schedule_of"][mode].num_steps,
                   "samples_per_s": sps, "samples_per_s_median": statistics.median(sps),
                   "samples_per_cpu_s_median": statistics.median(per_cpu),
                   "dp_sync_ms": statistics.median(1e3 * np.mean([r["dp_sync_s"] for r in d["summary"]["per_rank"]])
                                                   for d in docs),
                   "token_pad_ratio": docs[0]["summary"]["token_pad_ratio"],
                   "vision_max_mean": vis, "llm_max_mean": llm,
                   "load": [round(d["load_before"], 2) for d in docs]}
            res["runs"][f"{mode}_dp{dp}"] = row
            res["table"].append(row)
    write_result("online", res, render(res), out=Path(args.out))
    print(render(res))
    return 0


def render(res: dict) -> str:
    lines = ["# baseline vs control vs online (OrchMLLM-style) vs offline (omnibal's packs), CPU trainer", "",
             f"`python -m benchmarks.bench_online`: `tiny` preset, {res['num_samples']} samples of {res['stats']}, "
             f"each mode over its whole epoch, local draws of {res['num_microbatches']} x {res['batch_size']} samples "
             f"per rank (baseline, control and online), median of {res['repeats']} interleaved rounds, "
             "one torch thread per rank. "
             "Per-phase max/mean: across DP ranks, of the cost each rank's step "
             "carries, mean over steps.", "",
             "| DP | mode | steps | samples/s | vs baseline | samples per CPU-s | vs baseline | DP-sync wait ms | "
             "token pad | vision max/mean | LLM max/mean | load |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in res["table"]:
        base = res["runs"][f"baseline_dp{row['dp']}"]
        lines.append(f"| {row['dp']} | {row['mode']} | {row['steps']} | {row['samples_per_s_median']:.2f} | "
                     f"{row['samples_per_s_median'] / base['samples_per_s_median']:.2f}x | "
                     f"{row['samples_per_cpu_s_median']:.2f} | "
                     f"{row['samples_per_cpu_s_median'] / base['samples_per_cpu_s_median']:.2f}x | "
                     f"{row['dp_sync_ms']:.0f} | {100 * row['token_pad_ratio']:.0f}% | {row['vision_max_mean']:.3f} | "
                     f"{row['llm_max_mean']:.3f} | {', '.join(str(x) for x in row['load'])} |")
    lines += ["", "control: online mode with --no-online-balance (unpadded packs and no recompute, no re-deal). "
              "Predicted for a GPU cluster: `benchmarks/results/online_sim.md`."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
