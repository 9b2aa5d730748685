"""``omnibal plan``: plan data caps, pipeline partition and per-stage recompute for a model on a cluster"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from omnibal.cli.options import add_layout_options, add_option, check_layout_args
from omnibal.cost.hardware import DEFAULT_MEMORY_HEADROOM
from omnibal.cost.stack import DEFAULT_STACK
from omnibal.errors import InputError
from omnibal.hbp.levels import LEVEL_MICROBATCHES
from omnibal.jobs.exports import write_engine_exports
from omnibal.layout import (
    BASELINE_PADDINGS,
    PLAN_PADDINGS,
    PLANNER_SCHEDULES,
    BaselinePartition,
    BaselineSampler,
    Layout,
)

HELP = "plan data caps, pipeline partition and per-stage recompute for a model on a cluster"
DESCRIPTION = (
    "Plan a VLM training job the OmniBal way: balanced micro-batches (data), the exact min-max pipeline "
    "partition searched jointly with per-stage activation checkpointing (model + memory), scored by the "
    "step-time simulator. With no arguments: InternVL-Chat-1.5 (InternViT-6B + InternLM2-20B) on 128 A100-80G "
    "(DP 32 x PP 4 x TP 1, ZeRO-1, Megatron-DeepSpeed memory) with a synthetic InternVL-like 1.2M-sample "
    "dataset fitted to OmniBal's published statistics. Prints the plan and the paper's ablation (baseline -> + "
    "data balance -> + balanced partition -> + adaptive recompute, then + pack size when the pack-size search "
    "picks another pack) next to the paper's figures and writes plan.json, ablation.json, report.md and PNGs "
    "into --out."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and cluster")
    add_option(g, "model", default="internvl-chat-1.5")
    add_option(g, "hf_model", help="plan a local Hugging Face checkpoint (Llava / InternVL; reads its config.json) "
               "instead of --model")
    add_option(g, "hardware", default="a100-80g")
    add_option(g, "num_gpus", default=128)
    add_layout_options(g, defaults={"pp_size": 4, "tp_size": 1, "num_microbatches": 8}, helps={
        "dp_size": "data-parallel size (default: gpus / (pp x tp))",
        "num_microbatches": "micro-batches per DP rank per step (default 8: the default 128-GPU job's, enough to "
                            "fill its 4 pipeline stages; balance and train default to 4, a small run's)",
        "zero_stage": "ZeRO stage over DP (default: 1; torchtitan: 2, FSDP with reshard_after_forward never)"})
    g.add_argument("--selective-recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="let adaptive recompute run transformer blocks selectively (keep matrix-product and "
                        "attention outputs, recompute the element-wise ops; omnibal.train.recompute); default: "
                        "where the engine expresses it (--engine omnibal)")
    add_option(g, "engine", default="omnibal",
               help="engine that will run the plan: its constraints are planner inputs, the ablation prices each of "
                    "them, and its ready-to-use files go to OUT/exports/ (docs/engines/)")
    g.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="bytes per device the plan may use, in GiB (default: the device memory less "
                        "--memory-headroom)")
    g.add_argument("--memory-headroom", type=float, default=DEFAULT_MEMORY_HEADROOM, metavar="SHARE_OR_GIB",
                   help="what the budget leaves of the device memory for the caching allocator's reserve, the "
                        "CUDA context and communication buffers: a share below 1, else GiB (default: "
                        f"{DEFAULT_MEMORY_HEADROOM:g}; docs/gpu.md has the measurement it rests on)")
    add_option(g, "profile", help="measured layer profile (omnibal profile) to use instead of the analytic cost model")
    add_option(g, "schedule", default="1f1b", choices=PLANNER_SCHEDULES)
    g.add_argument("--chunks", default="1,2", metavar="V[,V...]",
                   help="model chunks per pipeline device the planner may choose: 1 is --schedule itself, more is "
                        "interleaved 1F1B (kept only where the simulator finds it faster and the engine runs it; "
                        "default: 1,2)")
    d = parser.add_argument_group("data")
    add_option(d, "stats", help="per-sample statistics (omnibal stats); default: synthetic InternVL-like mixture")
    add_option(d, "convert_stats", help="convert --stats made in another image convention (InternVL tiles / LLaVA "
               "single image) to the model's instead of refusing them")
    add_option(d, "samples", default=1_200_000, help="size of the synthetic mixture")
    d.add_argument("--balance-samples", default="200000", metavar="N",
                   help="balance a uniform random subset of N samples and scale the epoch to the whole "
                        "dataset ('all': every sample, ~12 s more CPU on the default job's 1.2M)")
    add_option(d, "balance_method", default="omnibal", help="balancer of the planned job")
    d.add_argument("--max-tiles", type=int, default=None, metavar="N",
                   help="fixed Q_v, the tile buffer of a pack (default: cap search; fixed caps set the pack, so the "
                        "pack-size search is off)")
    add_option(d, "max_tokens")
    add_option(d, "oversize", default="error")
    add_option(d, "padding", default="varlen", choices=PLAN_PADDINGS,
               help="how balanced packs run: variable length, or padded to the caps (static shapes)")
    add_option(d, "batch_size", default=4, help="samples per baseline micro-batch")
    d.add_argument("--hbp", nargs="?", const="job", default=None, choices=("job", "long-context"),
                   help="plan HBP multi-level packing instead (docs/hbp.md): per-level pack length, SP degree and "
                        "recompute vs single-level packing, on the job's data or the long-context mixture")
    d.add_argument("--hbp-microbatches", default=None, choices=LEVEL_MICROBATCHES,
                   help="with --hbp: micro-batches per step of each level; tokens (default): a short level's step "
                        "holds the longest level's tokens per rank in more micro-batches; same: the job's count")
    s = parser.add_argument_group("search")
    s.add_argument("--radius", type=int, default=2, help="move each stage boundary by up to this many layers")
    s.add_argument("--top-k", type=int, default=8, help="candidates scored with the simulator")
    s.add_argument("--search-steps", type=int, default=192, help="steps the simulator scores candidates on")
    s.add_argument("--baseline-partition", default="vision-first", choices=tuple(BaselinePartition),
                   help="the baseline's layer split (default: the vision encoder on stage 0, the paper's)")
    s.add_argument("--baseline-sampler", default="length-grouped", choices=tuple(BaselineSampler),
                   help="the baseline's sampler (default: length-grouped, as InternVL-Chat's fine-tuning scripts "
                        "run it; random: a plain shuffle)")
    s.add_argument("--baseline-padding", default="pad_to_longest", choices=BASELINE_PADDINGS,
                   help="how the baseline's micro-batches run (default: padded to their longest sample, as "
                        "InternVL-Chat's collator does; varlen: concatenated, for a baseline trainer that packs)")
    add_option(s, "stack", default=DEFAULT_STACK)
    s.add_argument("--pack-microbatches", default="8,12,16,24,32", metavar="M,M,...",
                   help="micro-batch counts the pack-size search tries at the same samples per step ('none': "
                        "keep --microbatches and 4.5 samples per pack)")
    add_option(s, "seed", default=0, help="seed of data, shuffles and step sample")
    s.add_argument("--verify", type=int, default=0, metavar="K", help="measure the top K candidates (partition x "
                   "recompute) in the reference trainer and choose by measurement (tiny / CPU profile, or CUDA)")
    s.add_argument("--verify-steps", type=int, default=3, metavar="N", help="timed steps per --verify candidate")
    o = parser.add_argument_group("output")
    add_option(o, "out", default="omnibal-out", metavar="DIR", help="folder for plan.json, report.md and PNGs")
    o.add_argument("--no-timelines", action="store_true", help="skip the per-row pipeline timeline PNGs")
    add_option(o, "quiet", help="no progress bar")


def _balance_samples(text: str) -> int | None:
    if str(text).lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise InputError(f"must be a number of samples or 'all', got {text!r}", source="--balance-samples",
                         field="balance_samples") from None


def job_config(args: argparse.Namespace):
    """The :class:`PlanJobConfig` the arguments describe (refusing bad ones, named by their flags)."""
    from omnibal.jobs.plan_config import PlanJobConfig
    from omnibal.measure.hardware import hardware_by_name
    from omnibal.plan.engines import get_engine
    from omnibal.plan.search import SearchConfig

    check_layout_args(args)
    zero_stage = get_engine(args.engine).default_zero_stage if args.zero_stage is None else args.zero_stage
    layout = Layout.for_devices(args.num_gpus, dp_size=args.dp_size, pp_size=args.pp_size, tp_size=args.tp_size,
                                zero_stage=zero_stage, num_microbatches=args.num_microbatches)
    if args.radius < 0 or args.top_k < 1 or args.search_steps < 1:
        raise InputError("--radius must be >= 0, --top-k and --search-steps >= 1", source="--radius",
                         field="radius")
    return PlanJobConfig(
        preset=args.model, hf_model=args.hf_model, hardware=hardware_by_name(args.hardware), num_gpus=args.num_gpus,
        layout=layout,
        baseline_batch_size=args.batch_size, memory_budget_gib=args.memory_budget,
        memory_headroom=args.memory_headroom, stats_path=args.stats,
        num_samples=args.samples, balance_samples=_balance_samples(args.balance_samples), seed=args.seed,
        profile_path=args.profile, balance_method=args.balance_method, padding=args.padding,
        max_tiles=args.max_tiles, max_tokens=args.max_tokens, oversize=args.oversize,
        baseline_partition=args.baseline_partition, baseline_sampler=args.baseline_sampler,
        baseline_padding=args.baseline_padding,
        schedule=args.schedule, chunks=_chunks(args.chunks), stack=args.stack,
        pack_search=pack_search_config(args.pack_microbatches),
        search=SearchConfig(radius=args.radius, top_k=args.top_k, sample_steps=args.search_steps, seed=args.seed),
        engine=args.engine, convert_stats=args.convert_stats, selective=args.selective_recompute)


def _chunks(text: str) -> tuple[int, ...]:
    """``--chunks`` as a tuple of chunk counts."""
    from omnibal.plan.interleaved import check_chunks

    try:
        return check_chunks(int(x) for x in text.split(","))
    except ValueError:
        raise InputError(f"must be comma-separated integers, got {text!r}", source="--chunks",
                         field="chunks") from None


def pack_search_config(text: str):
    """``--pack-microbatches`` as a PackSearchConfig."""
    from omnibal.errors import InputError
    from omnibal.plan.packsize import PackSearchConfig

    if text.strip().lower() == "none":
        return PackSearchConfig(microbatches=())
    try:
        return PackSearchConfig(microbatches=tuple(int(x) for x in text.split(",")))
    except ValueError:
        raise InputError(f"must be comma-separated integers or 'none', got {text!r}", source="--pack-microbatches",
                         field="pack_microbatches") from None


def _check_hbp_args(args: argparse.Namespace) -> None:
    """``--hbp`` options that single-level planning takes and HBP does not: refused, never ignored."""
    for flag, dest in (("--max-tiles", "max_tiles"), ("--max-tokens", "max_tokens")):
        if getattr(args, dest) is not None:
            raise InputError(f"--hbp chooses each level's caps itself; drop {flag}", source=flag, field=dest)
    if args.oversize == "own_pack":
        raise InputError("--hbp: a sample no level holds (at the largest SP degree) is an error or dropped; use "
                         "--oversize error or drop", source="--oversize", field="oversize")
    if args.baseline_padding != "pad_to_longest":
        raise InputError("--hbp's baseline runs random micro-batches padded to their longest sample (docs/hbp.md); "
                         "drop --baseline-padding", source="--baseline-padding", field="baseline_padding")


def run(args: argparse.Namespace) -> int:
    from omnibal.jobs.plan_job import run_plan_job
    from omnibal.jobs.plan_report import PLAN_OUTPUTS
    from omnibal.outputs import check_replaceable_dir, staged_dir, write_text

    t0 = time.perf_counter()
    config = job_config(args)
    if args.hbp_microbatches is not None and not args.hbp:
        raise InputError("--hbp-microbatches sets the micro-batches of HBP's levels; add --hbp or drop it",
                         source="--hbp-microbatches", field="hbp_microbatches")
    if args.hbp:
        from omnibal.cli.plan_hbp import run_hbp

        _check_hbp_args(args)
        return run_hbp(args, config)
    check_replaceable_dir(args.out, "--out", PLAN_OUTPUTS)  # before minutes of planning, not after
    progress = not args.quiet and sys.stderr.isatty()
    print(f"omnibal plan: {config.hf_model or config.preset} on {config.layout.num_gpus} x {config.hardware_name} "
          f"({config.layout.describe()}, engine {config.engine})", flush=True)
    if args.verify:  # fail in a second, not after planning
        _check_verify(args, config)
        # the measured candidates run one layer range per stage (--stage-layers): no interleaving to verify
        config = replace(config, chunks=(1,))
    result = run_plan_job(config, progress=progress)
    verify_table = None
    if args.verify:
        result, verify_table = _verified(args, config, result)
    # written whole into a temporary folder, then swapped in: an interrupt leaves the earlier plan as it was,
    # and none of its files (a timeline of another ablation, an export this plan has not) stays beside these
    with staged_dir(args.out) as tmp:
        if verify_table is not None:
            write_text(tmp / "verify.md", "# omnibal plan --verify\n\n" + verify_table)
        files = _write_outputs(result, tmp, timelines=not args.no_timelines, progress=progress)
        written, skipped = write_engine_exports(result.plan, tmp / "exports")
    files = {k: Path(args.out) / p.relative_to(tmp) for k, p in files.items()}
    written = {e: [Path(args.out) / Path(p).relative_to(tmp) for p in paths] for e, paths in written.items()}
    _print_plan(result, (written, skipped))
    print(f"\nwrote {files['plan']}, {files['report']} and {sum(1 for k in files if k.startswith('png:'))} "
          f"PNGs into {args.out}/ ({time.perf_counter() - t0:.1f} s)")
    return 0


def _check_verify(args: argparse.Namespace, config) -> None:
    """``--verify``: refuse what cannot be measured here before minutes of planning."""
    from omnibal.measure.verify import check_verifiable, resolve_device

    if args.verify < 1 or args.verify_steps < 1:
        raise InputError("--verify and --verify-steps must be >= 1", source="--verify", field="verify")
    check_verifiable(config, device=resolve_device("auto", config.layout.dp_size * config.layout.pp_size))


def _write_outputs(result, out: str, *, timelines: bool, progress: bool) -> dict:
    """plan.json, ablation.json, report.md and the PNGs, with a progress bar over the pictures."""
    from omnibal.jobs.plan_report import write_job_outputs

    if not progress:
        return write_job_outputs(result, out, timelines=timelines)
    from tqdm import tqdm

    bar = tqdm(total=1 + len(result.ablation) if timelines else 1, desc="writing report", leave=False,
               bar_format="{desc}: {n_fmt}/{total_fmt} pictures |{bar}| {elapsed}{postfix}")
    started = False

    def step(label: str) -> None:
        nonlocal started
        if started:
            bar.update(1)
        started = True
        bar.set_postfix_str(label)

    try:
        return write_job_outputs(result, out, timelines=timelines, progress=step)
    finally:
        bar.close()


def _budget_line(p) -> str:
    """The budget per device and, when a headroom made it, what the headroom left out and why."""
    if p.memory_budget_bytes is None:
        return "none (no device memory limit)"
    line = f"{p.memory_budget_bytes / 2**30:.1f} GiB per device"
    h = p.memory_headroom
    if h is None:
        return line
    device = p.memory_budget_bytes / (1 - h) if h < 1 else p.memory_budget_bytes + h * 2**30
    left = f"{h:.0%}" if h < 1 else f"{h:g} GiB"
    return (f"{line} (the {device / 2**30:.1f} GiB device less {left} headroom for the caching allocator's "
            "reserve, the CUDA context and communication buffers: --memory-headroom)")


def _print_plan(result, exports: tuple[dict, dict]) -> None:
    """The data line, the ablation, the plan's stages, the engine exports (``write_engine_exports``'s answer)
    and the balance."""
    from omnibal.jobs.plan_report import balance_rows, stage_rows
    from omnibal.plan.ablation import ablation_markdown
    from omnibal.tables import fixed, text_table

    plan, p = result.plan, result.plan.inputs
    note = ""
    if result.epoch_scale != 1.0:
        note = (f"; balanced a uniform random subset of {plan.data.settings['balanced_samples']:,} and scaled the "
                f"epoch x{result.epoch_scale:.2f} (--balance-samples all: every sample)")
    print(f"data: {p.stats_source}, {p.num_samples:,} samples{note}; images: {p.stats_convention}")
    print(f"memory budget: {_budget_line(p)}\n")
    if result.ablation[0].paper_gpu_days is not None:
        print("Ablation (predicted by omnibal's simulator; paper: OmniBal's measured 6B+20B on Megatron-DeepSpeed, "
              "A100; why they differ: docs/plan.md):")
    else:
        print("Ablation (predicted by omnibal's simulator):")
    print(ablation_markdown(result.ablation))
    pack = plan.data.settings.get("pack_search")
    if pack and pack["chosen"]:
        caps = plan.data.settings["caps"]
        mean = plan.data.metrics.get("samples_per_microbatch_mean", pack["chosen"]["target_samples"])
        searched = ", ".join(str(x["num_microbatches"]) for x in pack["candidates"])
        print(f"pack size: {plan.inputs.layout.num_microbatches} micro-batches per step of {mean:.2f} samples on "
              f"average (caps {caps['tiles']} tiles / {caps['tokens']} tokens), searched over {searched} "
              f"micro-batches at the same samples per step")
    print(f"\nPlan: {fixed(plan.prediction.step_time_s, 2)} s per step, {fixed(plan.prediction.gpu_days, 1)} GPU days "
          f"per epoch, bubble {plan.prediction.bubble:.1%}")
    if p.num_chunks > 1:
        print(f"schedule: interleaved 1F1B, {p.num_chunks} model chunks per device (stage s runs on device "
              f"s mod {p.layout.pp_size}; planned GiB: the chunk's share of its device, simulated peak: the "
              f"device's; the reference trainer runs it with omnibal train --plan)")
    elif (result.plan.search.get("interleaved") or {}).get("candidates"):
        print("schedule: 1F1B (interleaved 1F1B was tried and is not faster here)")
    print(text_table(stage_rows(plan)))
    written, skipped = exports
    if plan.engine == "omnibal" and p.num_chunks == 1:
        print(f"\nDeepSpeed parts: {list(plan.parts)}")
    for engine, paths in written.items():
        print(f"{engine} export: " + ", ".join(str(p) for p in paths))
    for engine, reason in skipped.items():
        print(f"no {engine} export: {reason}")
    print("\nBalance:")
    print(text_table(balance_rows(result.balance_metrics)))


def _verified(args, config, result):
    """``--verify K``: the result with the plan chosen by measuring its top K candidates, and the table of
    predicted vs measured per candidate (printed here, written to OUT/verify.md by the caller); the plan
    JSON holds them under search.verify."""
    from dataclasses import replace

    from omnibal.measure.verify import VerifyConfig, verify_markdown, verify_plan

    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.quiet else None
    plan, measured = verify_plan(result, VerifyConfig(top_k=args.verify, steps=args.verify_steps), config,
                                 progress=say)
    table = verify_markdown(measured, plan.search["verify"]["chosen"])
    print(f"Verified candidates ({args.verify_steps} timed steps each on {plan.search['verify']['device']}):\n{table}")
    return replace(result, plan=plan), table
