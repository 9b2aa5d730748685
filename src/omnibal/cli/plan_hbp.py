"""``omnibal plan --hbp``: HBP multi-level packing for the plan's job, per level and against one level."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

MIXTURES = ("job", "long-context")
"""``job``: the job's data (``--stats`` or the synthetic InternVL mixture); ``long-context``: the synthetic
long-context mixture (``omnibal.stats.long_context``) of ``--samples`` rows."""


def run_hbp(args: argparse.Namespace, config) -> int:
    """Choose the levels, print the per-level table and the comparison, write ``OUT/hbp.json``."""
    from omnibal.jobs.hbp import hbp_markdown, hbp_plan_config, run_hbp_job
    from omnibal.jobs.plan_report import PLAN_OUTPUTS
    from omnibal.outputs import check_replaceable_dir, staged_dir, write_text

    t0 = time.perf_counter()
    check_replaceable_dir(args.out, "--out", PLAN_OUTPUTS)
    if args.hbp == "long-context":
        from omnibal.stats.long_context import long_context_mixture

        stats = long_context_mixture(config.num_samples, config.seed)
    elif config.stats_path is not None:
        from omnibal.stats.io import load_stats

        stats = load_stats(config.stats_path)
    else:
        from omnibal.stats.synthetic import synthetic_internvl_mixture

        stats = synthetic_internvl_mixture(config.num_samples, config.seed)
    hbp = hbp_plan_config(config, microbatches=getattr(args, "microbatches", None),
                          progress=sys.stderr.isatty() and not args.quiet)
    lay = config.layout
    print(f"omnibal plan --hbp: {config.hf_model or config.preset} on {lay.num_gpus} x {config.hardware_name} "
          f"(DP {lay.dp_size} x PP {lay.pp_size} x TP {lay.tp_size}), data {stats.source}", flush=True)
    if not args.quiet:
        print(search_estimate(len(stats), config.balance_samples), file=sys.stderr, flush=True)
    result = run_hbp_job(config, hbp, stats)
    print(f"memory: at most {result.model.max_tokens_per_rank:,} LLM tokens per rank's micro-batch (every layer "
          f"checkpointed); SP degrees {list(result.model.sp_degrees)}\n")
    print(hbp_markdown(result))
    with staged_dir(args.out) as tmp:  # the folder swapped in whole (see omnibal plan)
        write_text(tmp / "hbp.json", json.dumps(result.to_dict(), indent=2) + "\n")
        sched = _write_training_schedule(config, hbp, result, stats, tmp)
    print(f"\nwrote {Path(args.out) / 'hbp.json'}")
    _say_training_schedule(sched, Path(args.out) / "hbp_schedule.json", stats)
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


SECONDS_PER_BALANCED_SAMPLE = (90 / 200_000, 360 / 200_000)
"""CPU time of the whole HBP search per balanced sample, low and high: the default job (200k balanced of 1.2M
samples) took 1.5 to 6 minutes on 2 shared cores; the search balances and simulates ~10-20 level sets, each in
time about linear in the balanced samples."""


def search_estimate(num_samples: int, balance_samples: int | None) -> str:
    """The line said before the search starts: what runs and about how long (it prints nothing for minutes)."""
    n = num_samples if balance_samples is None else min(num_samples, balance_samples)
    low, high = (max(1, round(n * s / 60)) for s in SECONDS_PER_BALANCED_SAMPLE)
    span = "under a minute" if high <= 1 else f"about {low}-{high} min"
    return (f"omnibal plan --hbp: balancing {n:,} samples and simulating ~10-20 level sets, SP degrees and partitions: "
            f"{span} on 2 CPU cores (less with a smaller --balance-samples)")


def _write_training_schedule(config, hbp, result, stats, out: Path):
    """``OUT/hbp_schedule.json``: the winning levels over every row, for a trainer; returns it (None: the
    plain plan's single level won, and there is none)."""
    from omnibal.jobs.hbp import training_schedule

    sched = training_schedule(config, hbp, result, stats)
    if sched is not None:
        sched.to_json(out / "hbp_schedule.json")
    return sched


def _say_training_schedule(sched, path: Path, stats) -> None:
    if sched is None:
        print("no multi-level schedule: the plain plan's single level won; `omnibal balance` builds its training "
              "schedule")
        return
    counts = "" if sched.level_microbatches is None else f", micro-batches per level {list(sched.level_microbatches)}"
    print(f"wrote {path}: {sched.num_steps:,} steps over every row of {stats.source} (levels "
          f"{sched.meta['hbp']['level_lengths']}, SP {list(sched.level_sp)}{counts}); the reference trainer runs it "
          f"with --schedule-file and --microbatches {sched.num_microbatches} (each SP level inside every pipeline "
          f"stage, with its own recompute sets)")
