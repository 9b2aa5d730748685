"""``omnibal plan``: plan data caps, pipeline partition and per-stage recompute for a model on a cluster"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

from omnibal.cli.fields import add_config_arguments, config_from_args
from omnibal.cli.options import add_option, check_layout_args
from omnibal.cli.plan_hbp import MIXTURES
from omnibal.errors import InputError
from omnibal.jobs.exports import write_engine_exports
from omnibal.layout import Layout

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


HBP_CLI_FIELDS = ("microbatches",)
"""The :class:`omnibal.hbp.planning.HBPPlanConfig` fields ``omnibal plan --hbp`` takes as flags; it takes the
rest from the plan job (baseline batch size, oversize policy, partition search) or keeps their defaults."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan job's knobs, one per :class:`omnibal.jobs.plan_config.PlanJobConfig` field (its docstring is
    the help) and per :class:`omnibal.plan.search.SearchConfig` field (but its seed: the job's ``--seed``);
    then the command line's own: ``--hbp`` (plan HBP instead), ``--verify`` (measure after planning) and the
    output options."""
    from omnibal.hbp.planning import HBPPlanConfig
    from omnibal.jobs.plan_config import PlanJobConfig
    from omnibal.plan.search import SearchConfig

    add_config_arguments(parser.add_argument_group(
        "plan job (omnibal.jobs.plan_config.PlanJobConfig; --dp defaults to what --gpus leaves after PP x TP, "
        "--zero-stage to the engine's)"), PlanJobConfig)
    add_config_arguments(parser.add_argument_group("search (omnibal.plan.search.SearchConfig)"), SearchConfig,
                         skip=("seed",))
    h = parser.add_argument_group("HBP (omnibal.hbp.planning.HBPPlanConfig)")
    h.add_argument("--hbp", nargs="?", const="job", default=None, choices=MIXTURES,
                   help="plan HBP multi-level packing instead (docs/hbp.md): per-level pack length, SP degree and "
                        "recompute vs single-level packing, on the job's data or the long-context mixture")
    add_config_arguments(h, HBPPlanConfig, skip=tuple(f.name for f in fields(HBPPlanConfig)
                                                      if f.name not in HBP_CLI_FIELDS))
    v = parser.add_argument_group("verify (omnibal.measure.verify)")
    v.add_argument("--verify", type=int, default=0, metavar="K", help="measure the top K candidates (partition x "
                   "recompute) in the reference trainer and choose by measurement (tiny / CPU profile, or CUDA)")
    v.add_argument("--verify-steps", type=int, default=3, metavar="N", help="timed steps per --verify candidate")
    o = parser.add_argument_group("output")
    add_option(o, "out", default="omnibal-out", metavar="DIR", help="folder for plan.json, report.md and PNGs")
    o.add_argument("--no-timelines", action="store_true", help="skip the per-row pipeline timeline PNGs")
    add_option(o, "quiet", help="no progress bar")


def _layout_args(args: argparse.Namespace, default) -> argparse.Namespace:
    """``args`` with the whole layout: what is not given is the default job's (``default``), but DP, which is
    what ``--gpus`` (default: the default layout's devices) leaves after PP x TP, and the ZeRO stage, which is
    the engine's."""
    from omnibal.plan.engines import get_engine

    given = {name: getattr(args, name, None) for name in (*default.layout.to_dict(), "num_gpus", "engine")}
    rest = {name: default.layout.to_dict()[name] if given[name] is None else given[name]
            for name in ("pp_size", "tp_size", "num_microbatches")}
    zero_stage = given["zero_stage"]
    if zero_stage is None:
        zero_stage = get_engine(given["engine"] or default.engine).default_zero_stage
    gpus = default.layout.num_gpus if given["num_gpus"] is None else given["num_gpus"]
    layout = Layout.for_devices(gpus, dp_size=given["dp_size"], zero_stage=zero_stage, **rest)
    return argparse.Namespace(**{**vars(args), **layout.to_dict(), "num_gpus": gpus})


def job_config(args: argparse.Namespace):
    """The :class:`PlanJobConfig` the arguments describe (refusing bad ones, named by their flags)."""
    from omnibal.jobs.plan_config import PlanJobConfig
    from omnibal.measure.hardware import hardware_by_name
    from omnibal.plan.search import SearchConfig

    check_layout_args(args)
    default = PlanJobConfig()
    search = config_from_args(SearchConfig, args, seed=getattr(args, "seed", default.seed))
    if search.radius < 0 or search.top_k < 1 or search.sample_steps < 1:
        raise InputError("--radius must be >= 0, --top-k and --search-steps >= 1", source="--radius",
                         field="radius")
    config = config_from_args(PlanJobConfig, _layout_args(args, default), search=search)
    return replace(config, hardware=hardware_by_name(config.hardware))


def _check_hbp_args(config) -> None:
    """``--hbp`` options that single-level planning takes and HBP does not: refused, never ignored."""
    for flag, dest in (("--max-tiles", "max_tiles"), ("--max-tokens", "max_tokens")):
        if getattr(config, dest) is not None:
            raise InputError(f"--hbp chooses each level's caps itself; drop {flag}", source=flag, field=dest)
    if config.oversize == "own_pack":
        raise InputError("--hbp: a sample no level holds (at the largest SP degree) is an error or dropped; use "
                         "--oversize error or drop", source="--oversize", field="oversize")
    if config.baseline_padding != "pad_to_longest":
        raise InputError("--hbp's baseline runs random micro-batches padded to their longest sample (docs/hbp.md); "
                         "drop --baseline-padding", source="--baseline-padding", field="baseline_padding")


def run(args: argparse.Namespace) -> int:
    from omnibal.jobs.plan_job import run_plan_job
    from omnibal.jobs.plan_report import PLAN_OUTPUTS
    from omnibal.outputs import check_replaceable_dir, staged_dir, write_text

    t0 = time.perf_counter()
    config = job_config(args)
    if hasattr(args, "microbatches") and not args.hbp:
        raise InputError("--hbp-microbatches sets the micro-batches of HBP's levels; add --hbp or drop it",
                         source="--hbp-microbatches", field="hbp_microbatches")
    if args.hbp:
        from omnibal.cli.plan_hbp import run_hbp

        _check_hbp_args(config)
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
        print(f"pp schedule: interleaved 1F1B, {p.num_chunks} model chunks per device (stage s runs on device "
              f"s mod {p.layout.pp_size}; planned GiB: the chunk's share of its device, simulated peak: the "
              f"device's; the reference trainer runs it with omnibal train --plan)")
    elif (result.plan.search.get("interleaved") or {}).get("candidates"):
        print("pp schedule: 1F1B (interleaved 1F1B was tried and is not faster here)")
    print(text_table(stage_rows(plan)))
    written, skipped = exports
    if plan.engine == "reference" and p.num_chunks == 1:
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
    from omnibal.measure.verify import VerifyConfig, verify_markdown, verify_plan

    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.quiet else None
    plan, measured = verify_plan(result, VerifyConfig(top_k=args.verify, steps=args.verify_steps), config,
                                 progress=say)
    table = verify_markdown(measured, plan.search["verify"]["chosen"])
    print(f"Verified candidates ({args.verify_steps} timed steps each on {plan.search['verify']['device']}):\n{table}")
    return replace(result, plan=plan), table
