"""``omnibal simulate``: simulate DP x PP training steps of a plan and report time, bubbles and memory"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path

from omnibal.cli.fields import add_config_arguments, config_from_args, errors_named_by_flags
from omnibal.cli.options import add_option
from omnibal.errors import InputError, OmnibalError

HELP = "simulate DP x PP training steps of a plan and report time, bubbles and memory"
DESCRIPTION = (
    "Simulate one epoch of DP x PP (x TP) training: the balancer's micro-batches (or a schedule file), a "
    "pipeline partition and recompute set (even / explicit / from a plan), per-layer costs from the "
    "analytic model. Prints step time, bubble, per-stage busy/idle/memory, OOM and epoch GPU days, and "
    "writes a report (markdown, JSON, a pipeline timeline PNG and per-rank load histograms). With --plan it "
    "is the plan's own prediction (its cluster, data, balanced sample, pack and caps; flags given win); "
    "without one, --model and the cluster say what to simulate. Exit 1 when every step runs out of memory."
)

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulation's knobs, one per :class:`omnibal.jobs.simulate.SimulateJobConfig` field (its docstring
    is the help; a setting left unset is the plan's when ``--plan`` is given), then the command line's own:
    ``--online-vs-offline`` (another comparison), ``--no-report`` (no report folder) and ``--quiet``."""
    from omnibal.jobs.simulate import SimulateJobConfig

    add_config_arguments(parser.add_argument_group("simulation (omnibal.jobs.simulate.SimulateJobConfig; an unset "
                                                   "setting is the plan's when --plan is given)"), SimulateJobConfig)
    g = parser.add_argument_group("online vs offline")
    g.add_argument("--online-vs-offline", action="store_true",
                   help="compare baseline (random micro-batches of --batch-size), online (OrchMLLM-style "
                        "post-balancing of the same draws, per-phase dispatch, with its all-gather and all-to-alls) "
                        "and omnibal (offline balance) on one cluster, even partition and full recompute, and exit; "
                        "defaults: the 128-GPU plan job (internvl-chat-1.5, a100-80g, --dp 32 --pp 4 "
                        "--microbatches 8), --samples 20000 synthetic rows scaled to a 1.2M epoch")
    g = parser.add_argument_group("output")
    g.add_argument("--no-report", action="store_true", help="print the tables only (no --out folder)")
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


def job_config(args: argparse.Namespace):
    """The :class:`omnibal.jobs.simulate.SimulateJobConfig` the arguments describe, and the
    :class:`omnibal.plan.plan.Plan` of ``--plan`` (None without one)."""
    from omnibal.jobs.simulate import SimulateJobConfig, load_plan

    config = config_from_args(SimulateJobConfig, args, **({"out": None} if args.no_report else {}))
    config = replace(config, plan=config.plan or None)
    plan = load_plan(config)
    return replace(config, hardware=resolve_hardware(config.hardware, plan)), plan


def run(args: argparse.Namespace) -> int:
    from omnibal.jobs.simulate import SimulateJobConfig

    with errors_named_by_flags(SimulateJobConfig):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from omnibal.jobs.simulate import resolve_cluster, run_simulate_job
    from omnibal.tables import text_table

    if args.online_vs_offline:
        return _online_vs_offline(args)
    config, plan = job_config(args)
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
    from omnibal.jobs.simulate import SimulateJobConfig
    from omnibal.sim.online import compare_online_offline, comparison_markdown

    cfg = config_from_args(SimulateJobConfig, args)
    samples = cfg.samples or 20_000
    if samples < 1:
        raise InputError(f"must be a positive integer, got {samples!r}", source="--samples", field="samples")
    print(comparison_markdown(compare_online_offline(
        model=cfg.model or "internvl-chat-1.5", hardware=resolve_hardware(cfg.hardware or "a100-80g"),
        dp_size=cfg.layout.dp_size or 32, pp_size=cfg.layout.pp_size or 4,
        num_microbatches=cfg.layout.num_microbatches or 8,
        batch_size=4 if cfg.batch_size is None else cfg.batch_size, num_samples=samples,
        seed=0 if cfg.seed is None else cfg.seed)), end="")
    return 0
