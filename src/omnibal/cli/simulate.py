"""``omnibal simulate``: simulate DP x PP training steps of a plan and report time, bubbles and memory"""

from __future__ import annotations

import argparse
import sys

from omnibal.cost.stack import DEFAULT_STACK, STACKS
from omnibal.errors import InputError

HELP = "simulate DP x PP training steps of a plan and report time, bubbles and memory"
DESCRIPTION = (
    "Simulate one epoch of DP x PP (x TP) training: the balancer's micro-batches (or a schedule file), a "
    "pipeline partition and recompute set (even / explicit / from a plan), per-layer costs from the "
    "analytic model. Prints step time, bubble, per-stage busy/idle/memory, OOM and epoch GPU days, and "
    "writes a report (markdown, JSON, a pipeline timeline PNG and per-rank load histograms)."
)

BALANCE_METHODS = ("omnibal", "isf", "isf+assign", "random", "length-grouped")
PADDINGS = ("auto", "varlen", "pad_to_longest", "fixed_buffer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model and cluster (default: the plan's when --plan is given)")
    g.add_argument("--model", default=None, help="model preset (default internvl-chat-1.5)")
    g.add_argument("--hardware", default=None, help="hardware preset: a100-40g, a100-80g, h100, h200, cpu "
                   "(default a100-80g)")
    g.add_argument("--dp", type=int, default=None, help="data-parallel size (default 1)")
    g.add_argument("--pp", type=int, default=None, help="pipeline stages (default 1)")
    g.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 1)")
    g.add_argument("--microbatches", type=int, default=None, help="micro-batches per DP rank per step "
                   "(default 4)")
    g.add_argument("--schedule", choices=("1f1b", "gpipe", "interleaved"), default="1f1b",
                   help="pipeline schedule (interleaved: Megatron's interleaved 1F1B, with --chunks)")
    g.add_argument("--chunks", type=int, default=None, help="model chunks per pipeline stage for "
                   "--schedule interleaved (default 2); partition and recompute lists then name pp x chunks "
                   "virtual stages")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2), default=None,
                   help="ZeRO stage over DP (default 1: optimizer state sharded)")
    g.add_argument("--memory-fraction", type=float, default=0.95,
                   help="share of the device memory a rank may use (OOM flags)")
    g.add_argument("--step-overhead", type=float, default=0.0,
                   help="fixed seconds per step outside the pipeline (optimizer, launch)")
    g.add_argument("--jitter", type=float, default=0.0,
                   help="relative standard deviation of a rank's unpredicted step-time variation (stragglers: "
                        "the gradient sync waits for the expected slowest DP rank); 0 = none")
    g.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"), help="training dtype")
    g.add_argument("--stack", default=None, choices=tuple(STACKS),
                   help="software stack whose weight/gradient/optimizer bytes the memory model counts and the "
                        f"gradient all-reduce moves (default: the plan's, else {DEFAULT_STACK}, as omnibal plan)")
    g.add_argument("--profile", default=None, help="measured layer profile JSON (omnibal profile) instead of the "
                   "analytic cost model")

    g = parser.add_argument_group("data")
    g.add_argument("--stats", default=None, help="per-sample stats file (default: the synthetic "
                   "InternVL-1.2M-like mixture)")
    g.add_argument("--samples", type=int, default=None, help="synthetic mixture size (default 1,200,000); "
                   "with --stats: replicate the rows up to this many")
    g.add_argument("--convert-stats", action="store_true", help="convert --stats made in another image convention "
                   "(InternVL tiles / LLaVA single image) to the model's instead of refusing them")
    g.add_argument("--schedule-file", default=None, help="a balanced schedule JSON (omnibal balance) "
                   "instead of balancing here")
    g.add_argument("--balance", choices=BALANCE_METHODS, default="omnibal", help="balancer method")
    g.add_argument("--batch-size", type=int, default=4, help="samples per micro-batch of the random and "
                   "length-grouped baselines")
    g.add_argument("--padding", choices=PADDINGS, default="auto", help="how a micro-batch runs; auto: the "
                   "schedule's own for compute, and with pp > 1 the fixed buffer (the caps) for p2p transfers")
    g.add_argument("--seed", type=int, default=0, help="seed of the balancer / synthetic data")
    g.add_argument("--epoch", type=int, default=0, help="epoch to balance")

    g = parser.add_argument_group("plan")
    g.add_argument("--plan", default=None, help="plan JSON (omnibal plan): partition, recompute and cluster")
    g.add_argument("--partition", default="even", help="'even' or the first layer of each stage, e.g. "
                   "'0,20,41,70'")
    g.add_argument("--recompute", default="full", help="'full', 'none' or per-stage counts of recomputed "
                   "layers (each stage's first layers), e.g. '20,10,4,0'")

    g = parser.add_argument_group("online vs offline")
    g.add_argument("--online-vs-offline", action="store_true",
                   help="compare baseline (random micro-batches of --batch-size), online (OrchMLLM-style "
                        "post-balancing of the same draws, per-phase dispatch, with its all-gather and all-to-alls) "
                        "and omnibal (offline balance) on one cluster, even partition and full recompute, and exit; "
                        "defaults: the 128-GPU plan job (internvl-chat-1.5, a100-80g, --dp 32 --pp 4 "
                        "--microbatches 8), --samples 20000 synthetic rows scaled to a 1.2M epoch")

    g = parser.add_argument_group("output")
    g.add_argument("--out", default="simulate-report", help="report folder")
    g.add_argument("--no-report", action="store_true", help="print the tables only")
    g.add_argument("--timeline-step", type=int, default=None, help="step drawn in the timeline (default: "
                   "the slowest)")
    g.add_argument("--quiet", action="store_true", help="no progress output")


def _say(args, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)


def _positive(name: str, value: int) -> int:
    if value is None or value < 1:
        raise InputError(f"must be a positive integer, got {value!r}", source=f"--{name}", field=name)
    return value


def parse_partition(text: str, num_layers: int, num_stages: int):
    """``even`` or comma-separated stage start layers -> cut points ``[P+1]``."""
    from omnibal.sim.costs import cuts_from_starts, even_cuts

    if text.strip() == "even":
        return even_cuts(num_layers, num_stages)
    try:
        starts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"expected 'even' or comma-separated integers, got {text!r}", source="--partition",
                         field="partition") from None
    if len(starts) != num_stages:
        raise InputError(f"{len(starts)} stage starts for {num_stages} pipeline stages", source="--partition",
                         field="partition")
    return cuts_from_starts(starts, num_layers, source="--partition")


def parse_recompute(text: str, cuts):
    """``full`` / ``none`` / per-stage counts -> a per-layer mask."""
    import numpy as np

    from omnibal.sim.costs import recompute_mask_from_counts

    num_layers = int(cuts[-1])
    if text.strip() == "full":
        return np.ones(num_layers, bool)
    if text.strip() == "none":
        return np.zeros(num_layers, bool)
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"expected 'full', 'none' or comma-separated counts, got {text!r}", source="--recompute",
                         field="recompute") from None
    return recompute_mask_from_counts(cuts, counts, source="--recompute")


def _load_plan(path: str):
    from omnibal.plan.plan import Plan

    return Plan.load(path)


def _resolve_cluster(args, plan) -> dict:
    """Cluster settings: explicit options win; a plan fills the rest; then the defaults."""
    defaults = {"model": "internvl-chat-1.5", "hardware": "a100-80g", "dp": 1, "pp": 1, "tp": 1,
                "microbatches": 4, "zero_stage": 1, "stack": DEFAULT_STACK}
    from_plan = {}
    if plan is not None:
        i = plan.inputs
        from_plan = {"model": i.model, "hardware": i.hardware, "dp": i.dp_size, "pp": i.pp_size, "tp": i.tp_size,
                     "microbatches": i.num_microbatches, "zero_stage": i.zero_stage}
        if "stack" in plan.data.settings:
            from_plan["stack"] = plan.data.settings["stack"]
    out = {}
    for key, default in defaults.items():
        given = getattr(args, key)
        if given is not None and key in from_plan and given != from_plan[key] and key in ("pp", "model"):
            raise InputError(f"--{key.replace('_', '-')} {given} contradicts the plan's {from_plan[key]}",
                             source=args.plan, field=key)
        out[key] = given if given is not None else from_plan.get(key, default)
    for key in ("dp", "pp", "tp", "microbatches"):
        _positive(key, out[key])
    return out


def _stats(args, spec):
    """The stats the balancer sees, in the model's units (``omnibal.sim.predict.model_stats``, as ``plan``)."""
    from omnibal.sim.predict import model_stats

    if args.stats:
        from omnibal.stats.io import load_stats

        stats = load_stats(args.stats)
        if args.samples is not None:
            stats = stats.replicate(_positive("samples", args.samples))
        return model_stats(stats, spec, convert=args.convert_stats)
    from omnibal.stats.synthetic import synthetic_internvl_mixture

    stats = synthetic_internvl_mixture(_positive("samples", args.samples or 1_200_000), seed=args.seed)
    return model_stats(stats, spec, convert=True)  # the stand-in mixture is InternVL-tiled: any model's units


def _schedule(args, stats, table, cluster, spec, hardware):
    from omnibal.data.balance import BalanceConfig, Schedule, balance
    from omnibal.sim.predict import balance_cost

    if args.schedule_file:
        sched = Schedule.from_json(args.schedule_file)
        if sched.dp_size != cluster["dp"] or sched.num_microbatches != cluster["microbatches"]:
            raise InputError(f"schedule is for dp {sched.dp_size} x {sched.num_microbatches} micro-batches, "
                             f"simulating dp {cluster['dp']} x {cluster['microbatches']}",
                             source=args.schedule_file, field="dp_size")
        return sched
    config = BalanceConfig(method=args.balance, batch_size=args.batch_size,
                           cost=balance_cost(table, spec, hardware, args.profile))
    return balance(stats, dp_size=cluster["dp"], num_microbatches=cluster["microbatches"], seed=args.seed,
                   epoch=args.epoch, config=config)


def _paddings(args, sched, plan) -> tuple[str, str | None]:
    """``(compute padding, p2p padding)``. ``auto``: with a plan, the padding ``omnibal plan`` scored it with
    (so both predict the same step); else the schedule's own for compute and, with pp > 1, the fixed buffer
    (the caps) for p2p, as the reference trainer sends one buffer shape between stages."""
    if args.padding != "auto":
        return args.padding, None
    if plan is not None and sched.method != "random" and "padding" in plan.data.settings:
        return str(plan.data.settings["padding"]), None
    return sched.padding, "fixed_buffer"


def _online_vs_offline(args: argparse.Namespace) -> int:
    """``--online-vs-offline``: baseline, online and offline balancing of one cluster, as a table."""
    from omnibal.sim.online import compare_online_offline, comparison_markdown

    print(comparison_markdown(compare_online_offline(
        model=args.model or "internvl-chat-1.5", hardware=args.hardware or "a100-80g", dp_size=args.dp or 32,
        pp_size=args.pp or 4, num_microbatches=args.microbatches or 8, batch_size=args.batch_size,
        num_samples=_positive("samples", args.samples or 20_000), seed=args.seed)), end="")
    return 0


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from omnibal.cost.presets import get_model_preset
    from omnibal.measure.hardware import hardware_by_name
    from omnibal.sim.costs import config_for_hardware
    from omnibal.sim.epoch import simulate_epoch, simulate_one_step
    from omnibal.sim.predict import cost_table, schedule_features
    from omnibal.sim.report import format_text_table, stage_table, totals_rows, write_report

    if args.online_vs_offline:
        return _online_vs_offline(args)
    if not args.no_report:
        from omnibal.outputs import check_dir

        check_dir(args.out, "--out")  # before the simulation, not after it
    plan = _load_plan(args.plan) if args.plan else None
    cluster = _resolve_cluster(args, plan)
    spec = get_model_preset(cluster["model"])
    hardware = hardware_by_name(cluster["hardware"])
    table = cost_table(spec, hardware, profile_path=args.profile, tp_size=cluster["tp"], dtype=args.dtype,
                       stack=cluster["stack"])
    if cluster["pp"] > table.num_layers:
        raise InputError(f"{cluster['pp']} stages for {table.num_layers} layers", source="--pp", field="pp")

    chunks = args.chunks if args.chunks is not None else (2 if args.schedule == "interleaved" else 1)
    num_virtual = cluster["pp"] * chunks
    if num_virtual > table.num_layers:
        raise InputError(f"{num_virtual} virtual stages for {table.num_layers} layers", source="--chunks",
                         field="chunks")
    if plan is not None:
        if chunks != 1:
            raise InputError("a plan describes one layer range per stage; it cannot be run interleaved",
                             source=args.plan, field="schedule")
        if plan.num_layers != table.num_layers:
            raise InputError(f"plan has {plan.num_layers} layers, model {spec.name} has {table.num_layers}",
                             source=args.plan, field="stages")
        cuts = np.asarray(plan.parts, dtype=np.int64)
        names = set(plan.recompute_modules())
        rec = np.array([n in names for n in table.names])
    else:
        cuts = parse_partition(args.partition, table.num_layers, num_virtual)
        rec = parse_recompute(args.recompute, cuts)
    if args.memory_fraction is not None and not 0 < args.memory_fraction <= 1:
        raise InputError(f"must be in (0, 1], got {args.memory_fraction}", source="--memory-fraction",
                         field="memory_fraction")
    config = config_for_hardware(hardware, dp_size=cluster["dp"], pp_size=cluster["pp"], tp_size=cluster["tp"],
                                 schedule=args.schedule, num_chunks=chunks, zero_stage=cluster["zero_stage"],
                                 memory_fraction=args.memory_fraction, step_overhead=args.step_overhead,
                                 compute_jitter=args.jitter)

    _say(args, f"stats: {'synthetic mixture' if not args.stats else args.stats} ...")
    stats = _stats(args, spec)
    _say(args, f"balancing {len(stats):,} samples ({args.balance if not args.schedule_file else args.schedule_file})"
               f" for dp {cluster['dp']} x {cluster['microbatches']} micro-batches ...")
    sched = _schedule(args, stats, table, cluster, spec, hardware)
    padding, p2p = _paddings(args, sched, plan)
    features, buffer = schedule_features(sched, stats, padding=padding, p2p_padding=p2p, pp_size=cluster["pp"])
    if buffer is not None:
        padding += f" (p2p: {p2p})"
    _say(args, f"simulating {features.shape[0]} steps x {cluster['dp']} ranks x {cluster['microbatches']} "
               f"micro-batches x {cluster['pp']} stages ...")
    result = simulate_epoch(table, cuts, rec, features, config, buffer_features=buffer,
                            progress=not args.quiet and sys.stderr.isatty())
    if len(result.step_time) == 0:
        raise InputError("the schedule has no steps", source="--stats", field="samples")

    print(format_text_table(totals_rows(result)))
    print()
    print(format_text_table(stage_table(result)))
    if args.no_report:
        return 0
    step_index = int(np.argmax(result.step_time)) if args.timeline_step is None else args.timeline_step
    if not 0 <= step_index < len(result.step_time):
        raise InputError(f"step {step_index} is outside 0..{len(result.step_time) - 1}", source="--timeline-step",
                         field="timeline_step")
    costs, step = simulate_one_step(table, cuts, rec, features[step_index], config,
                                    None if buffer is None else buffer[step_index])
    header = {
        "model": spec.name, "hardware": hardware.name, "dp x pp x tp": f"{cluster['dp']} x {cluster['pp']} x "
        f"{cluster['tp']}", "micro-batches per step": cluster["microbatches"],
        "schedule": args.schedule + (f" ({chunks} chunks per stage)" if chunks > 1 else ""),
        "data": f"{stats.source}, {len(stats):,} samples", "balance": sched.method, "padding": padding,
        "caps (tiles, tokens)": f"{sched.caps.tiles}, {sched.caps.tokens}",
        "plan": args.plan or f"partition {args.partition}, recompute {args.recompute}",
        "costs": f"profile {args.profile}" if args.profile else f"analytic ({args.dtype})",
    }
    paths = write_report(result, costs, step, step_index, args.out, header=header, layer_names=table.names)
    _say(args, f"report: {paths['markdown']} (+ {paths['timeline'].name}, {paths['load'].name}, "
               f"{paths['json'].name})")
    return 0
