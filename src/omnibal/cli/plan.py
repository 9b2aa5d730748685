"""``omnibal plan``: plan data caps, pipeline partition and per-stage recompute for a model on a cluster"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HELP = "plan data caps, pipeline partition and per-stage recompute for a model on a cluster"
DESCRIPTION = (
    "Plan a VLM training job the OmniBal way: balanced micro-batches (data), the exact min-max pipeline "
    "partition searched jointly with per-stage activation checkpointing (model + memory), scored by the "
    "step-time simulator. With no arguments: InternVL-Chat-1.5 (InternViT-6B + InternLM2-20B) on 128 A100-80G "
    "(DP 32 x PP 4 x TP 1, ZeRO-1, 8 micro-batches per step) with a synthetic InternVL-like 1.2M-sample "
    "dataset. Prints the plan and the paper's ablation (baseline -> + data balance -> + balanced partition -> "
    "+ adaptive recompute) and writes plan.json, ablation.json, report.md and PNGs into --out."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and cluster")
    g.add_argument("--preset", default="internvl-chat-1.5", help="model preset (omnibal.cost.presets)")
    g.add_argument("--hf-model", metavar="DIR", help="plan a local Hugging Face checkpoint (Llava / InternVL; reads "
                   "its config.json) instead of --preset")
    g.add_argument("--hardware", default="a100-80g", help="hardware preset (a100-40g, a100-80g, h100, h200)")
    g.add_argument("--gpus", type=int, default=128, help="devices in the job; DP x PP x TP must equal it")
    g.add_argument("--dp", type=int, default=None, help="data-parallel size (default: gpus / (pp x tp))")
    g.add_argument("--pp", type=int, default=4, help="pipeline stages")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--zero-stage", type=int, default=None, choices=(0, 1, 2),
                   help="ZeRO stage over DP (default: 1; torchtitan: 2, FSDP with reshard_after_forward never)")
    g.add_argument("--engine", default="omnibal", choices=("omnibal", "deepspeed", "megatron", "torchtitan"),
                   help="engine that will run the plan: its constraints are planner inputs, the ablation prices "
                        "each of them, and its ready-to-use files go to OUT/exports/ (docs/engines/)")
    g.add_argument("--num-microbatches", type=int, default=8, help="micro-batches per step per DP rank")
    g.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="bytes per device the plan may use, in GiB (default: 95%% of the device memory)")
    g.add_argument("--profile", default=None, metavar="FILE",
                   help="measured layer profile (omnibal profile) to use instead of the analytic cost model")
    g.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"), help="pipeline schedule")
    d = parser.add_argument_group("data")
    d.add_argument("--stats", default=None, metavar="FILE",
                   help="per-sample statistics (omnibal stats); default: synthetic InternVL-like mixture")
    d.add_argument("--samples", type=int, default=1_200_000, help="size of the synthetic mixture")
    d.add_argument("--balance-samples", default="200000", metavar="N",
                   help="balance a uniform random subset of N samples and scale the epoch to the whole "
                        "dataset ('all': every sample; balancing 1.2M samples takes ~30 s of CPU)")
    d.add_argument("--balance-method", default="omnibal", help="balancer of the planned job")
    d.add_argument("--padding", default="varlen", choices=("varlen", "fixed_buffer"),
                   help="how balanced packs run: variable length, or padded to the caps (static shapes)")
    d.add_argument("--baseline-batch-size", type=int, default=4, help="samples per baseline micro-batch")
    d.add_argument("--hbp", nargs="?", const="job", default=None, choices=("job", "long-context"),
                   help="plan HBP multi-level packing instead (docs/hbp.md): per-level pack length, SP degree and "
                        "recompute vs single-level packing, on the job's data or the long-context mixture")
    s = parser.add_argument_group("search")
    s.add_argument("--radius", type=int, default=2, help="move each stage boundary by up to this many layers")
    s.add_argument("--top-k", type=int, default=8, help="candidates scored with the simulator")
    s.add_argument("--search-steps", type=int, default=192, help="steps the simulator scores candidates on")
    s.add_argument("--baseline-partition", default="even", choices=("even", "vision-first"),
                   help="the baseline's layer split")
    s.add_argument("--seed", type=int, default=0, help="seed of data, shuffles and step sample")
    o = parser.add_argument_group("output")
    o.add_argument("--out", default="omnibal-out", metavar="DIR", help="folder for plan.json, report.md and PNGs")
    o.add_argument("--no-timelines", action="store_true", help="skip the per-row pipeline timeline PNGs")
    o.add_argument("--quiet", action="store_true", help="no progress bar")


def job_config(args: argparse.Namespace):
    from omnibal.errors import InputError
    from omnibal.plan.job import PlanJobConfig
    from omnibal.plan.search import SearchConfig

    for name in ("gpus", "pp", "tp"):
        value = getattr(args, name)
        if value is None or value < 1:
            raise InputError(f"must be a positive integer, got {value!r}", source=f"--{name}", field=name)
    dp = args.dp
    if dp is None:
        if args.gpus % (args.pp * args.tp):
            raise InputError(f"{args.gpus} devices do not split into PP {args.pp} x TP {args.tp} x DP: "
                             f"{args.gpus} is not a multiple of {args.pp * args.tp}", source="--gpus", field="gpus")
        dp = args.gpus // (args.pp * args.tp)
    if str(args.balance_samples).lower() == "all":
        balance_samples = None
    else:
        try:
            balance_samples = int(args.balance_samples)
        except ValueError:
            raise InputError(f"must be a number of samples or 'all', got {args.balance_samples!r}",
                             source="--balance-samples", field="balance_samples") from None
    from omnibal.plan.engines import get_engine

    zero_stage = get_engine(args.engine).default_zero_stage if args.zero_stage is None else args.zero_stage
    if args.radius < 0 or args.top_k < 1 or args.search_steps < 1:
        raise InputError("--radius must be >= 0, --top-k and --search-steps >= 1", source="--radius",
                         field="radius")
    return PlanJobConfig(
        preset=args.preset, hf_model=args.hf_model, hardware=args.hardware, num_gpus=args.gpus, dp_size=dp, pp_size=args.pp,
        tp_size=args.tp, zero_stage=zero_stage, num_microbatches=args.num_microbatches,
        baseline_batch_size=args.baseline_batch_size, memory_budget_gib=args.memory_budget,
        stats_path=args.stats, num_samples=args.samples, balance_samples=balance_samples, seed=args.seed,
        profile_path=args.profile, balance_method=args.balance_method, padding=args.padding,
        baseline_partition=args.baseline_partition, schedule=args.schedule,
        search=SearchConfig(radius=args.radius, top_k=args.top_k, sample_steps=args.search_steps, seed=args.seed),
        engine=args.engine)


def run(args: argparse.Namespace) -> int:
    from omnibal.plan.ablation import ablation_markdown
    from omnibal.plan.job import run_plan_job
    from omnibal.plan.report import balance_rows, stage_rows, text_table, write_job_outputs

    from omnibal.outputs import check_dir

    t0 = time.perf_counter()
    config = job_config(args)
    if args.hbp:
        from omnibal.cli.plan_hbp import run_hbp

        return run_hbp(args, config)
    check_dir(args.out, "--out")  # before minutes of planning, not after
    progress = not args.quiet and sys.stderr.isatty()
    inp = config
    print(f"omnibal plan: {inp.hf_model or inp.preset} on {inp.dp_size * inp.pp_size * inp.tp_size} x {inp.hardware} "
          f"(DP {inp.dp_size} x PP {inp.pp_size} x TP {inp.tp_size}, ZeRO-{inp.zero_stage}, "
          f"{inp.num_microbatches} micro-batches per step, engine {inp.engine})", flush=True)
    result = run_plan_job(config, progress=progress)
    plan = result.plan
    t_report = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=1 if args.no_timelines else 1 + len(result.ablation), desc="writing report", leave=False,
                   bar_format="{desc}: {n_fmt}/{total_fmt} pictures |{bar}| {elapsed}{postfix}")

    def step(label: str) -> None:
        if bar is not None:
            if step.started:
                bar.update(1)
            step.started = True
            bar.set_postfix_str(label)

    step.started = False
    try:
        files = write_job_outputs(result, args.out, timelines=not args.no_timelines, progress=step)
    finally:
        if bar is not None:
            bar.close()
    result.timings["report"] = round(time.perf_counter() - t_report, 3)
    (Path(args.out) / "ablation.json").write_text(json.dumps(
        {**json.loads((Path(args.out) / "ablation.json").read_text()), "timings": result.timings}, indent=2) + "\n")
    p = plan.inputs
    note = ""
    if result.epoch_scale != 1.0:
        note = (f"; balanced a uniform random subset of {plan.data.settings['balanced_samples']:,} and scaled the "
                f"epoch x{result.epoch_scale:.2f} (--balance-samples all: every sample)")
    print(f"data: {p.stats_source}, {p.num_samples:,} samples{note}")
    print(f"memory budget: {p.memory_budget_bytes / 2**30:.1f} GiB per device\n")
    if result.ablation[0].paper_gpu_days is not None:
        print("Ablation (predicted by omnibal's simulator; paper: OmniBal's measured 6B+20B on Megatron-DeepSpeed, "
              "A100; why they differ: docs/plan.md):")
    else:
        print("Ablation (predicted by omnibal's simulator):")
    print(ablation_markdown(result.ablation))
    print(f"\nPlan: {plan.prediction.step_time_s:.2f} s per step, {plan.prediction.gpu_days:.1f} GPU days per epoch, "
          f"bubble {plan.prediction.bubble:.1%}")
    print(text_table(stage_rows(plan)))
    written, skipped = write_engine_exports(plan, Path(args.out) / "exports")
    if plan.engine == "omnibal":
        print(f"\nDeepSpeed parts: {list(plan.parts)}")
    for engine, paths in written.items():
        print(f"{engine} export: " + ", ".join(str(p) for p in paths))
    for engine, reason in skipped.items():
        print(f"no {engine} export: {reason}")
    print("\nBalance:")
    print(text_table(balance_rows(result.balance_metrics)))
    print(f"\nwrote {files['plan']}, {files['report']} and {sum(1 for k in files if k.startswith('png:'))} "
          f"PNGs into {args.out}/ ({time.perf_counter() - t0:.1f} s)")
    return 0


def write_engine_exports(plan, out_dir: Path) -> tuple[dict, dict]:
    """The plan's engine files under ``out_dir`` (``--engine omnibal``: every engine that can express the plan).
    Returns ({engine: [paths]}, {engine: why not written})."""
    from omnibal.errors import InputError
    from omnibal.plan.exports import EXPORT_ENGINES

    engines = EXPORT_ENGINES if plan.engine == "omnibal" else (plan.engine,)
    written, skipped = {}, {}
    for engine in engines:
        module = __import__(f"omnibal.integrations.{engine}", fromlist=["write_exports"])
        try:
            written[engine] = module.write_exports(plan, out_dir)
        except InputError as exc:
            if plan.engine != "omnibal":
                raise  # the engine's own plan must be expressible: a bug, not a user choice
            skipped[engine] = str(exc)
    return written, skipped
