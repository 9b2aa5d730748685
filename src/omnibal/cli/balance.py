"""``omnibal balance``: pack samples into balanced micro-batches and assign them to (step, dp_rank, micro-batch)"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from omnibal.cli.fields import add_config_arguments, config_from_args
from omnibal.cli.options import add_option
from omnibal.errors import InputError

HELP = "pack samples into balanced micro-batches and assign them to (step, dp_rank, micro-batch)"
DESCRIPTION = (HELP + ". Reads per-sample statistics (any format `omnibal stats` loaders read; without "
               "--stats the synthetic default mixture), writes the schedule JSON "
               '{"dp_size", "num_microbatches", "caps": {"tiles", "tokens"}, "steps": [[[[row, ...] per '
               "micro-batch] per rank] per step]} and prints the balance metrics.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The balancer's knobs, one per command-line field of :class:`omnibal.data.balance.BalanceConfig` (its
    docstring is the help); the data, the layout, the seed and epoch (the arguments of ``balance``), the
    cost model and the outputs are written here (no config holds them)."""
    from omnibal.data.balance import BalanceConfig

    add_option(parser, "stats", help="per-sample statistics file (json/jsonl/parquet/OmniBal token-length)")
    add_option(parser, "samples", default=1_200_000,
               help="rows of the synthetic default mixture used when --stats is not given")
    # required, but checked in run, so the error names --dp as every other input error does
    add_option(parser, "dp_size", help="data-parallel ranks (required)")
    add_option(parser, "num_microbatches", default=4, help="micro-batches per DP rank per step (omnibal train's "
               "default too, so the schedule runs there as written)")
    add_config_arguments(parser.add_argument_group("balancer (omnibal.data.balance.BalanceConfig)"), BalanceConfig)
    add_option(parser, "seed", default=0)
    add_option(parser, "epoch", default=0)
    add_option(parser, "out", help="write the schedule JSON here")
    parser.add_argument("--metrics-json", help="write the metrics as JSON here")
    parser.add_argument("--plot", help="PNG of per-rank vision and LLM load per step")
    add_option(parser, "quiet", help="no table on stdout")
    m = parser.add_argument_group("cost model (as omnibal plan's)")
    add_option(m, "model", help="model preset: balance by its cost on --hardware (or --profile), stats in its units")
    add_option(m, "hardware", default="a100-80g", help="hardware preset of --model's analytic cost (cpu: measured "
               "here)")
    add_option(m, "profile", help="measured layer profile (omnibal profile) of --model")
    add_option(m, "convert_stats", help="convert stats of another image convention to --model's")


def _load(path: str | None, synthetic_samples: int):
    if path is None:
        from omnibal.stats.synthetic import synthetic_internvl_mixture

        return synthetic_internvl_mixture(synthetic_samples, seed=0)
    from omnibal.stats.io import load_stats

    return load_stats(path)


def _model_cost(args: argparse.Namespace, stats):
    """``(balancer cost, stats)``: with --model, the cost ``omnibal plan`` balances by (``omnibal.jobs.predict``)
    and the stats in the model's units; without it the default cost and the stats as given."""
    from omnibal.data.balance.cost import DEFAULT_COST

    if args.model is None:
        if args.profile:
            raise InputError("a profile describes one model: pass --model too", source="--profile", field="profile")
        return DEFAULT_COST, stats
    from omnibal.cost.presets import get_model_preset
    from omnibal.cost.units import model_stats
    from omnibal.jobs.predict import balance_cost, cost_table
    from omnibal.measure.hardware import hardware_by_name

    spec, hardware = get_model_preset(args.model), hardware_by_name(args.hardware)
    stats = model_stats(stats, spec, convert=args.convert_stats or args.stats is None)
    return balance_cost(cost_table(spec, hardware, profile_path=args.profile), spec, hardware, args.profile), stats


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


def check_target_samples(target: float, *, slots: int) -> None:
    """``--target-samples T`` asks for about N / T micro-batches of N samples. A micro-batch holds at least one
    sample, so a target below one sample per step's micro-batches (``1 / slots``) asks for more steps than the
    samples can fill: refused by name, before the cap search tries step counts no schedule can have."""
    if not math.isfinite(target) or target <= 0:
        raise InputError(f"must be a finite number > 0, got {target}", source="--target-samples",
                         field="target_samples")
    if target * slots < 1:
        raise InputError(f"{target:g} samples per micro-batch asks for more micro-batches than there are samples "
                         f"(each holds at least one); give at least 1 / (dp x microbatches) = {1 / slots:g}",
                         source="--target-samples", field="target_samples")


def run(args: argparse.Namespace) -> int:
    from omnibal.data.balance import BalanceConfig, balance
    from omnibal.data.metrics import cost_legend, metrics_table, schedule_metrics
    from omnibal.outputs import check_file, check_image, write_text

    check_file(args.out, "--out")  # every output path before any work: none fails after another is written
    check_file(args.metrics_json, "--metrics-json")
    check_image(args.plot, "--plot")  # before any work: a bad path never fails after another output is written
    if args.dp_size is None:
        raise InputError("required: the number of data-parallel ranks", source="--dp", field="dp_size")
    stats = _load(args.stats, args.samples)
    cost, stats = _model_cost(args, stats)
    check_target_samples(getattr(args, "target_samples", BalanceConfig.target_samples),
                         slots=args.dp_size * args.num_microbatches)
    config = config_from_args(BalanceConfig, args, cost=cost, progress=sys.stderr.isatty() and not args.quiet)
    t0 = time.perf_counter()
    schedule = balance(stats, dp_size=args.dp_size, num_microbatches=args.num_microbatches, seed=args.seed,
                       epoch=args.epoch, config=config)
    seconds = time.perf_counter() - t0
    metrics = schedule_metrics(schedule, stats, config.cost)
    if args.out:
        schedule.to_json(args.out)
    if args.metrics_json:
        write_text(args.metrics_json, json.dumps(metrics, indent=1))
    if args.plot:
        plot_loads(schedule, stats, args.plot, config.cost)
    if not args.quiet:
        keys = ["method", "dp_size", "num_steps", "caps_tiles", "caps_tokens", "samples_per_microbatch_mean",
                "vision_max_mean_ranks", "llm_max_mean_ranks", "llm_attention_max_mean_ranks", "total_max_mean_ranks",
                "buffer_pad_tiles", "buffer_pad_tokens", "buffer_pad_compute", "useful_fraction", "coverage_ok"]
        sys.stdout.write(f"{len(stats)} samples from {stats.source}; balanced in {seconds:.2f} s\n")
        sys.stdout.write(metrics_table([metrics], keys))
        sys.stdout.write(cost_legend(config.cost) + "\n")
    return 0 if metrics["coverage_ok"] else 1
