"""``omnibal balance``: pack samples into balanced micro-batches and assign them to (step, dp_rank, micro-batch)"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from omnibal.cli.fields import add_config_arguments, config_from_args, errors_named_by_flags
from omnibal.cli.options import OPTIONS, add_option, check_layout_args
from omnibal.errors import InputError

HELP = "pack samples into balanced micro-batches and assign them to (step, dp_rank, micro-batch)"
DESCRIPTION = (HELP + ". Reads per-sample statistics (any format `omnibal stats` loaders read; without "
               "--stats the synthetic default mixture), writes the schedule JSON "
               '{"dp_size", "num_microbatches", "caps": {"tiles", "tokens"}, "steps": [[[[row, ...] per '
               "micro-batch] per rank] per step]} and prints the balance metrics.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The job's knobs, one per command-line field of :class:`omnibal.jobs.balance.BalanceJobConfig` (its
    docstring is the help; the balancer's are :class:`omnibal.data.balance.BalanceConfig`'s, the layout's
    only ``--dp`` and ``--microbatches``), then the command line's own outputs."""
    from omnibal.jobs.balance import BalanceJobConfig

    add_config_arguments(parser.add_argument_group("balance job (omnibal.jobs.balance.BalanceJobConfig)"),
                         BalanceJobConfig)
    o = parser.add_argument_group("output")
    add_option(o, "out", help="write the schedule JSON here")
    o.add_argument("--metrics-json", help="write the metrics as JSON here")
    o.add_argument("--plot", help="PNG of per-rank vision and LLM load per step")
    add_option(o, "quiet", help="no table on stdout")


def job_config(args: argparse.Namespace):
    """The :class:`omnibal.jobs.balance.BalanceJobConfig` the arguments describe (``--hardware cpu`` measured
    here when a model is given). ``--dp`` is required, checked here so the error names it as every other
    input error does; a layout value no layout can have is named by its flag too."""
    from omnibal.jobs.balance import BalanceJobConfig

    if getattr(args, "dp_size", None) is None:
        raise InputError("required: the number of data-parallel ranks", source=OPTIONS["dp_size"].flag,
                         field="dp_size")
    check_layout_args(args)
    config = config_from_args(BalanceJobConfig, args)
    config = replace(config, balance=replace(config.balance, progress=sys.stderr.isatty() and not args.quiet))
    if config.model is None:
        return config
    from omnibal.measure.hardware import hardware_by_name

    return replace(config, hardware=hardware_by_name(config.hardware))


def plot_loads(schedule, stats, path: str, cost=None) -> None:
    from matplotlib.figure import Figure  # no pyplot: its global backend and figure registry stay untouched

    from omnibal.data.balance.cost import DEFAULT_COST

    vis, llm = (cost or DEFAULT_COST).evaluate(schedule.features(stats))
    fig = Figure(figsize=(10, 6))
    axes = fig.subplots(2, 1, sharex=True)
    for ax, load, name in ((axes[0], vis.sum(2), "vision"), (axes[1], llm.sum(2), "LLM")):
        mean = load.mean(1, keepdims=True)
        rel = load / mean
        steps = range(load.shape[0])
        ax.plot(steps, rel.max(1), label="slowest rank / mean", lw=1)
        ax.plot(steps, rel.min(1), label="fastest rank / mean", lw=1)
        ax.set_ylabel(f"{name} cost / step mean")
        ax.legend(loc="upper right", fontsize=8)
    axes[1].set_xlabel("step")
    fig.suptitle(f"{schedule.method}: per-rank load, dp={schedule.dp_size}, M={schedule.num_microbatches}")
    fig.tight_layout()
    from omnibal.outputs import atomic_path, image_format

    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format=image_format(path) or "png")


def run(args: argparse.Namespace) -> int:
    from omnibal.jobs.balance import BalanceJobConfig

    with errors_named_by_flags(BalanceJobConfig):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from omnibal.data.metrics import cost_legend, metrics_table
    from omnibal.jobs.balance import run_balance_job
    from omnibal.outputs import check_file, check_image, write_text

    check_file(args.out, "--out")  # every output path before any work: none fails after another is written
    check_file(args.metrics_json, "--metrics-json")
    check_image(args.plot, "--plot")  # before any work: a bad path never fails after another output is written
    result = run_balance_job(job_config(args))
    metrics = result.metrics
    if args.out:
        result.schedule.to_json(args.out)
    if args.metrics_json:
        write_text(args.metrics_json, json.dumps(metrics, indent=1))
    if args.plot:
        plot_loads(result.schedule, result.stats, args.plot, result.cost)
    if not args.quiet:
        keys = ["method", "dp_size", "num_steps", "caps_tiles", "caps_tokens", "samples_per_microbatch_mean",
                "vision_max_mean_ranks", "llm_max_mean_ranks", "llm_attention_max_mean_ranks", "total_max_mean_ranks",
                "buffer_pad_tiles", "buffer_pad_tokens", "buffer_pad_compute", "useful_fraction", "coverage_ok"]
        sys.stdout.write(f"{len(result.stats)} samples from {result.stats.source}; balanced in "
                         f"{result.seconds:.2f} s\n")
        sys.stdout.write(metrics_table([metrics], keys))
        sys.stdout.write(cost_legend(result.cost) + "\n")
    return 0 if metrics["coverage_ok"] else 1
