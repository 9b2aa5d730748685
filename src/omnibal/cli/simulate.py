"""``omnibal simulate``: simulate DP x PP training steps of a plan and report time, bubbles and memory"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from omnibal.cli.options import add_layout_options, add_option
from omnibal.cost.stack import DEFAULT_STACK
from omnibal.errors import InputError, OmnibalError
from omnibal.layout import Padding

HELP = "simulate DP x PP training steps of a plan and report time, bubbles and memory"
DESCRIPTION = (
    "Simulate one epoch of DP x PP (x TP) training: the balancer's micro-batches (or a schedule file), a "
    "pipeline partition and recompute set (even / explicit / from a plan), per-layer costs from the "
    "analytic model. Prints step time, bubble, per-stage busy/idle/memory, OOM and epoch GPU days, and "
    "writes a report (markdown, JSON, a pipeline timeline PNG and per-rank load histograms). With --plan it "
    "is the plan's own prediction (its cluster, data, balanced sample, pack and caps; flags given win); "
    "without one, --model and the cluster say what to simulate. Exit 1 when every step runs out of memory."
)

PADDINGS = ("auto", *Padding)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and cluster (default: the plan's when --plan is given)")
    add_option(g, "model", help="model preset (needed without --plan)")
    add_option(g, "hardware", help="hardware preset: a100-40g, a100-80g, h100, h200, cpu (default a100-80g)")
    add_layout_options(g, defaults={}, only=("dp_size", "pp_size", "tp_size", "num_microbatches"), helps={
        "dp_size": "data-parallel size (default 1)", "pp_size": "pipeline stages (default 1)",
        "tp_size": "tensor-parallel size (default 1)",
        "num_microbatches": "micro-batches per DP rank per step (default 4)"})
    add_option(g, "schedule", default=None,
               help="pipeline schedule (default: the plan's, else 1f1b; interleaved: Megatron's interleaved 1F1B, "
                    "with --chunks)")
    g.add_argument("--chunks", type=int, default=None, help="model chunks per pipeline stage for "
                   "--schedule interleaved (default 2); partition and recompute lists then name pp x chunks "
                   "virtual stages")
    add_option(g, "zero_stage", default=None, help="ZeRO stage over DP (default 1: optimizer state sharded)")
    g.add_argument("--memory-fraction", type=float, default=None,
                   help="share of the device memory a rank may use (OOM flags; default: the plan's budget, else "
                        "0.95)")
    g.add_argument("--step-overhead", type=float, default=0.0,
                   help="fixed seconds per step outside the pipeline (optimizer, launch)")
    g.add_argument("--jitter", type=float, default=0.0,
                   help="relative standard deviation of a rank's unpredicted step-time variation (stragglers: "
                        "the gradient sync waits for the expected slowest DP rank); 0 = none")
    add_option(g, "dtype", default="bf16")
    add_option(g, "stack", default=None, help="software stack whose weight/gradient/optimizer bytes the memory model "
               f"counts and the gradient all-reduce moves (default: the plan's, else {DEFAULT_STACK}, as omnibal plan)")
    add_option(g, "profile", help="measured layer profile JSON (omnibal profile) instead of the analytic cost model "
               "(default: the plan's)")

    g = parser.add_argument_group("data")
    add_option(g, "stats", help="per-sample stats file (default: the plan's, else the synthetic InternVL-1.2M-like "
               "mixture)")
    add_option(g, "samples", help="synthetic mixture size (default: the plan's, else 1,200,000); with --stats: "
               "replicate the rows up to this many")
    add_option(g, "convert_stats")
    add_option(g, "schedule_file")
    add_option(g, "balance_method", default=None, help="balancer (default: the plan's, with its pack size and caps; "
               "else omnibal)")
    add_option(g, "batch_size", default=None, help="samples per micro-batch of the random and length-grouped "
               "baselines (default: the plan's, else 4)")
    add_option(g, "padding", choices=PADDINGS, default="auto", help="how a micro-batch runs; auto: the "
               "schedule's own for compute, and with pp > 1 the fixed buffer (the caps) for p2p transfers")
    add_option(g, "seed", default=None, help="seed of the balancer, the balanced sample and the synthetic data "
               "(default: the plan's, else 0)")
    add_option(g, "epoch", default=0)

    g = parser.add_argument_group("plan")
    add_option(g, "plan", help="plan JSON (omnibal plan): partition, recompute and cluster")
    g.add_argument("--partition", default="even", help="'even' or the first layer of each stage, e.g. "
                   "'0,20,41,70'")
    add_option(g, "recompute", default="full", help="'full', 'none' or per-stage counts of recomputed layers "
               "(each stage's first layers), e.g. '20,10,4,0'")

    g = parser.add_argument_group("online vs offline")
    g.add_argument("--online-vs-offline", action="store_true",
                   help="compare baseline (random micro-batches of --batch-size), online (OrchMLLM-style "
                        "post-balancing of the same draws, per-phase dispatch, with its all-gather and all-to-alls) "
                        "and omnibal (offline balance) on one cluster, even partition and full recompute, and exit; "
                        "defaults: the 128-GPU plan job (internvl-chat-1.5, a100-80g, --dp 32 --pp 4 "
                        "--microbatches 8), --samples 20000 synthetic rows scaled to a 1.2M epoch")

    g = parser.add_argument_group("output")
    add_option(g, "out", default="simulate-report", help="report folder")
    g.add_argument("--no-report", action="store_true", help="print the tables only")
    g.add_argument("--timeline-step", type=int, default=None, help="step drawn in the timeline (default: "
                   "the slowest)")
    add_option(g, "quiet")


def resolve_hardware(name: str | None, plan=None):
    """``--hardware`` (else the plan's) as ``SimulateJobConfig.hardware``: ``cpu`` measured here (a plan made
    on a measured CPU records ``cpu-<threads>t``: measured again with as many threads), a preset by name,
    None when neither gives one (the default preset)."""
    from omnibal.measure.hardware import hardware_by_name

    if name is None and plan is not None:
        measured = re.fullmatch(r"cpu-(\d+)t", plan.inputs.hardware)
        if measured:
            return hardware_by_name("cpu", threads=int(measured.group(1)))
    return None if name is None else hardware_by_name(name)


def job_config(args: argparse.Namespace, plan=None):
    """The :class:`omnibal.jobs.simulate.SimulateJobConfig` the arguments describe (``plan``: the
    :class:`omnibal.plan.plan.Plan` of ``--plan``)."""
    from omnibal.jobs.simulate import SimulateJobConfig

    return SimulateJobConfig(
        plan=args.plan or None, model=args.model, hardware=resolve_hardware(args.hardware, plan), dp_size=args.dp_size,
        pp_size=args.pp_size,
        tp_size=args.tp_size,
        num_microbatches=args.num_microbatches, zero_stage=args.zero_stage, schedule=args.schedule,
        num_chunks=args.chunks, memory_fraction=args.memory_fraction, step_overhead=args.step_overhead,
        jitter=args.jitter, dtype=args.dtype, stack=args.stack, profile_path=args.profile, stats_path=args.stats,
        samples=args.samples, convert_stats=args.convert_stats,
        schedule_file=args.schedule_file, balance_method=args.balance_method, batch_size=args.batch_size,
        padding=args.padding, seed=args.seed, epoch=args.epoch, partition=args.partition, recompute=args.recompute,
        out=None if args.no_report else args.out, timeline_step=args.timeline_step)


def run(args: argparse.Namespace) -> int:
    from omnibal.jobs.simulate import SimulateJobConfig, load_plan, resolve_cluster, run_simulate_job
    from omnibal.tables import text_table

    if args.online_vs_offline:
        return _online_vs_offline(args)
    plan = load_plan(SimulateJobConfig(plan=args.plan or None))
    config = job_config(args, plan)
    resolve_cluster(config, plan)  # nothing to simulate, or a bad cluster: said before anything else
    if config.out is not None:
        from omnibal.outputs import check_dir

        check_dir(config.out, "--out")  # before the simulation, not after it
    result = run_simulate_job(config, plan=plan, progress=not args.quiet and sys.stderr.isatty(),
                              log=None if args.quiet else _say)
    print(text_table(result.totals, align="right"))
    print()
    print(text_table(result.stages, align="right"))
    if result.files and not args.quiet:
        files = {k: Path(v) for k, v in result.files.items()}
        _say(f"report: {files['markdown']} (+ {files['timeline'].name}, {files['load'].name}, {files['json'].name})")
    for note in result.notes:  # where this is not the plan's own prediction: said even with --quiet
        _say(f"omnibal simulate: warning: {note}")
    _check_memory(result.summary)
    return 0


def _check_memory(summary: dict) -> None:
    """Out-of-memory steps, said loudly: a warning when some steps run out of memory, an error (exit 1, after
    the tables and the report) when every step does, as such a job cannot run at all."""
    oom, simulated = summary["oom_steps"], summary["simulated_steps"]
    if not oom:
        return
    budget = summary["config"]["memory_budget_bytes"] / 2**30
    over = ", ".join(f"stage {s} peak {st['peak_memory_bytes'] / 2**30:.1f} GiB"
                     for s, st in enumerate(summary["stages"]) if st["oom_steps"])
    if oom < simulated:
        _say(f"omnibal simulate: warning: {oom} of {simulated} simulated steps run out of memory ({over}; budget "
             f"{budget:.1f} GiB per device)")
        return
    raise OmnibalError(f"every simulated step runs out of memory ({over}; budget {budget:.1f} GiB per device): "
                       "this job cannot run; use more pipeline stages (--pp), recompute (--recompute), a higher "
                       "--zero-stage or a plan from omnibal plan (--plan)")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _online_vs_offline(args: argparse.Namespace) -> int:
    """``--online-vs-offline``: baseline, online and offline balancing of one cluster, as a table."""
    from omnibal.sim.online import compare_online_offline, comparison_markdown

    samples = args.samples or 20_000
    if samples < 1:
        raise InputError(f"must be a positive integer, got {samples!r}", source="--samples", field="samples")
    print(comparison_markdown(compare_online_offline(
        model=args.model or "internvl-chat-1.5", hardware=resolve_hardware(args.hardware or "a100-80g"),
        dp_size=args.dp_size or 32,
        pp_size=args.pp_size or 4, num_microbatches=args.num_microbatches or 8,
        batch_size=4 if args.batch_size is None else args.batch_size, num_samples=samples,
        seed=0 if args.seed is None else args.seed)), end="")
    return 0
