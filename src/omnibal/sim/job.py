"""``omnibal simulate`` as a library call: a cluster, a partition and data in, a serialisable result out.

Phases (each a call into the layer that owns it):

1. the cluster: explicit settings win, a plan (:class:`PlannedRun`) fills the rest, then the defaults;
2. model preset -> per-layer cost table (analytic, or a measured profile), per TP rank;
3. the partition and recompute set (the plan's, or ``even`` / stage starts and ``full`` / ``none`` / counts);
4. per-sample stats (a file, or the synthetic InternVL-like mixture) in the model's units
   (``sim.predict.model_stats``, as ``omnibal plan``);
5. the balanced schedule (``data.balance`` by ``sim.predict.balance_cost``, or a schedule file) and its
   micro-batch features (``sim.predict.schedule_features``);
6. ``sim.epoch``: the whole epoch, then one step drawn for the timeline, and the report files.

The plan arrives as a :class:`PlannedRun` (read from a ``Plan`` by duck typing) so that ``sim`` does not
import ``plan`` (the layer above it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from omnibal.cost.hardware import HardwareSpec, get_hardware
from omnibal.cost.stack import DEFAULT_STACK
from omnibal.errors import InputError
from omnibal.layout import Layout, check_layout_fields
from omnibal.sim.predict import balance_cost, cost_table, model_stats, schedule_features

DEFAULTS = {"model": "internvl-chat-1.5", "hardware": "a100-80g", "dp_size": 1, "pp_size": 1, "tp_size": 1,
            "num_microbatches": 4, "zero_stage": 1, "stack": DEFAULT_STACK}
"""What an unset cluster setting is when no plan gives it."""
MUST_MATCH_PLAN = ("model", "pp_size")
"""Settings that, given explicitly, must agree with the plan's (the partition depends on them)."""
FLAGS = {"model": "--model", "dp_size": "--dp", "pp_size": "--pp", "tp_size": "--tp",
         "num_microbatches": "--microbatches", "samples": "--samples"}
"""How errors name a setting (the CLI's spelling)."""


@dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """What ``simulate`` takes from a plan: its cluster, partition and recompute set."""

    source: str
    """Where the plan came from (errors name it)."""
    model: str
    """Model preset the plan is for."""
    hardware: str
    """Hardware preset the plan is for."""
    layout: Layout
    """The plan's cluster layout."""
    parts: tuple[int, ...]
    """Cut points ``[P + 1]`` of its partition."""
    recompute: frozenset[str]
    """Names of the layers it recomputes."""
    num_layers: int
    """Layers of the model it was made for."""
    stack: str | None = None
    """Software stack its memory model counted (None: a plan from before ``--stack``)."""
    padding: str | None = None
    """How its balanced packs run (the padding ``omnibal plan`` scored it with; None: not recorded)."""

    @classmethod
    def of(cls, plan, source: str) -> PlannedRun:
        """From an ``omnibal.plan.Plan`` (duck-typed: ``sim`` sits below ``plan``)."""
        i = plan.inputs
        return cls(source=str(source), model=i.model, hardware=i.hardware, layout=i.layout,
                   parts=tuple(int(c) for c in plan.parts), recompute=frozenset(plan.recompute_modules()),
                   num_layers=plan.num_layers, stack=plan.data.settings.get("stack"),
                   padding=plan.data.settings.get("padding"))


@dataclass(frozen=True, kw_only=True)
class SimulateJobConfig:
    """Everything ``omnibal simulate`` needs. A cluster setting left None is the plan's, else ``DEFAULTS``."""

    model: str | None = None
    """Model preset (``omnibal.cost.presets``)."""
    hardware: str | HardwareSpec | None = None
    """Hardware preset (``omnibal.cost.hardware``) or a :class:`HardwareSpec` (``--hardware cpu``: the CLI
    measures this machine with ``omnibal.measure.hardware.hardware_by_name`` and passes the spec)."""
    dp_size: int | None = None
    """Data-parallel size."""
    pp_size: int | None = None
    """Pipeline stages."""
    tp_size: int | None = None
    """Tensor-parallel size."""
    num_microbatches: int | None = None
    """Micro-batches per DP rank per step."""
    zero_stage: int | None = None
    """ZeRO stage over DP."""
    schedule: str = "1f1b"
    """Pipeline schedule (``omnibal.layout.PipelineSchedule``)."""
    num_chunks: int | None = None
    """Model chunks per stage for the interleaved schedule (None: 2 there, else 1)."""
    memory_fraction: float = 0.95
    """Share of the device memory a rank may use (OOM flags)."""
    step_overhead: float = 0.0
    """Fixed seconds per step outside the pipeline."""
    jitter: float = 0.0
    """Relative standard deviation of a rank's unpredicted step-time variation."""
    dtype: str = "bf16"
    """Training dtype of the analytic cost model."""
    stack: str | None = None
    """Software stack whose weight/gradient/optimizer bytes the memory model counts and the gradient
    all-reduce moves (``omnibal.cost.stack``); None: the plan's, else ``DEFAULT_STACK`` (as ``omnibal plan``)."""
    profile_path: str | None = None
    """Measured layer profile instead of the analytic cost model."""
    stats_path: str | None = None
    """Per-sample stats file; None: the synthetic mixture."""
    samples: int | None = None
    """Synthetic mixture size (None: 1,200,000); with ``stats_path``: replicate its rows up to this many."""
    convert_stats: bool = False
    """Convert statistics made in another image convention to the model's (``--convert-stats``); without it
    they are an InputError naming both (``omnibal.sim.predict.model_stats``)."""
    schedule_file: str | None = None
    """A balanced schedule JSON instead of balancing here."""
    balance_method: str = "omnibal"
    """Balancer (``omnibal.layout.BalanceMethod``)."""
    batch_size: int = 4
    """Samples per micro-batch of the random and length-grouped baselines."""
    padding: str = "auto"
    """How a micro-batch runs; ``auto``: with a plan, the padding ``omnibal plan`` scored it with; else the
    schedule's own, and with pp > 1 the fixed buffer for p2p."""
    seed: int = 0
    """Seed of the balancer and the synthetic data."""
    epoch: int = 0
    """Epoch to balance."""
    partition: str = "even"
    """``even`` or the first layer of each (virtual) stage, comma-separated (ignored with a plan)."""
    recompute: str = "full"
    """``full``, ``none`` or per-stage counts of recomputed layers (ignored with a plan)."""
    out: str | None = "simulate-report"
    """Report folder; None: no report files."""
    timeline_step: int | None = None
    """Step drawn in the timeline (None: the slowest)."""


@dataclass(frozen=True)
class SimulateJobResult:
    """What ``omnibal simulate`` prints and wrote; every field is JSON-serialisable."""

    header: dict
    """The report's header: model, cluster, schedule, data, balance, padding, caps, plan, costs."""
    summary: dict
    """``EpochResult.summary()``: step times, bubbles, per-stage busy / memory, OOM, GPU days."""
    totals: list = field(default_factory=list)
    """Rows (first: header) of the totals table."""
    stages: list = field(default_factory=list)
    """Rows (first: header) of the per-stage table."""
    files: dict = field(default_factory=dict)
    """Report files written: markdown, json, timeline, load (empty without ``out``)."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, eq=False)
class _Setup:
    """The resolved inputs of one simulation (phases 1-3)."""

    cluster: dict
    spec: object
    hardware: object
    table: object
    cuts: np.ndarray
    recompute: np.ndarray
    sim_config: object
    num_chunks: int


def run_simulate_job(config: SimulateJobConfig, *, plan: PlannedRun | None = None, progress: bool = False,
                     log: Callable[[str], None] | None = None) -> SimulateJobResult:
    """Simulate one epoch (see the module docstring). ``progress``: a bar on stderr over the steps;
    ``log(line)``: told what each phase is doing."""
    from omnibal.sim.epoch import simulate_epoch

    log = log or (lambda line: None)
    setup = _setup(config, plan)
    cluster = setup.cluster
    log(f"stats: {'synthetic mixture' if not config.stats_path else config.stats_path} ...")
    stats = _stats(config, setup.spec)
    log(f"balancing {len(stats):,} samples ({config.schedule_file or config.balance_method}) for dp "
        f"{cluster['dp_size']} x {cluster['num_microbatches']} micro-batches ...")
    sched = _schedule(config, stats, setup, cluster)
    padding, features, buffer = _features(config, plan, sched, stats, cluster["pp_size"])
    log(f"simulating {features.shape[0]} steps x {cluster['dp_size']} ranks x {cluster['num_microbatches']} "
        f"micro-batches x {cluster['pp_size']} stages ...")
    epoch = simulate_epoch(setup.table, setup.cuts, setup.recompute, features, setup.sim_config,
                           buffer_features=buffer, progress=progress)
    if len(epoch.step_time) == 0:
        raise InputError("the schedule has no steps", source="--stats", field="samples")
    header = _header(config, plan, setup, stats, sched, padding)
    files = {} if config.out is None else _write(config, setup, epoch, features, buffer, header)
    from omnibal.sim.report import stage_table, totals_rows

    return SimulateJobResult(header=header, summary=epoch.summary(), totals=totals_rows(epoch),
                             stages=stage_table(epoch), files={k: str(v) for k, v in files.items()})


def resolve_cluster(config: SimulateJobConfig, plan: PlannedRun | None) -> dict:
    """Cluster settings: explicit ones win; a plan fills the rest; then ``DEFAULTS``."""
    from_plan = {}
    if plan is not None:
        from_plan = {"model": plan.model, "hardware": plan.hardware, **plan.layout.to_dict()}
        if plan.stack is not None:
            from_plan["stack"] = plan.stack
    out = {}
    for key, default in DEFAULTS.items():
        given = getattr(config, key)
        if given is not None and key in MUST_MATCH_PLAN and key in from_plan and given != from_plan[key]:
            raise InputError(f"{FLAGS[key]} {given} contradicts the plan's {from_plan[key]}", source=plan.source,
                             field=key.removesuffix("_size"))
        out[key] = given if given is not None else from_plan.get(key, default)
    for key in ("dp_size", "pp_size", "tp_size", "num_microbatches"):
        check_layout_fields({key: out[key]}, source=FLAGS[key])
    return out


def _setup(config: SimulateJobConfig, plan: PlannedRun | None) -> _Setup:
    from omnibal.cost.presets import get_model_preset
    from omnibal.sim.costs import config_for_hardware

    cluster = resolve_cluster(config, plan)
    spec = get_model_preset(cluster["model"])
    hardware = cluster["hardware"]
    if not isinstance(hardware, HardwareSpec):  # ``cpu`` is measured: the caller passes its spec
        hardware = get_hardware(hardware)
    table = cost_table(spec, hardware, profile_path=config.profile_path, tp_size=cluster["tp_size"],
                       dtype=config.dtype, stack=cluster["stack"])
    if cluster["pp_size"] > table.num_layers:
        raise InputError(f"{cluster['pp_size']} stages for {table.num_layers} layers", source="--pp", field="pp")
    chunks = config.num_chunks if config.num_chunks is not None else (2 if config.schedule == "interleaved" else 1)
    num_virtual = cluster["pp_size"] * chunks
    if num_virtual > table.num_layers:
        raise InputError(f"{num_virtual} virtual stages for {table.num_layers} layers", source="--chunks",
                         field="chunks")
    cuts, rec = _partition(config, plan, table, spec.name, chunks, num_virtual)
    if config.memory_fraction is not None and not 0 < config.memory_fraction <= 1:
        raise InputError(f"must be in (0, 1], got {config.memory_fraction}", source="--memory-fraction",
                         field="memory_fraction")
    sim_config = config_for_hardware(
        hardware, dp_size=cluster["dp_size"], pp_size=cluster["pp_size"], tp_size=cluster["tp_size"],
        schedule=config.schedule, num_chunks=chunks, zero_stage=cluster["zero_stage"],
        memory_fraction=config.memory_fraction, step_overhead=config.step_overhead,
        compute_jitter=config.jitter)
    return _Setup(cluster=cluster, spec=spec, hardware=hardware, table=table, cuts=cuts, recompute=rec,
                  sim_config=sim_config, num_chunks=chunks)


def _partition(config: SimulateJobConfig, plan: PlannedRun | None, table, model: str, chunks: int,
               num_virtual: int):
    """Cut points and the per-layer recompute mask: the plan's, or parsed from the config."""
    if plan is None:
        cuts = parse_partition(config.partition, table.num_layers, num_virtual)
        return cuts, parse_recompute(config.recompute, cuts)
    if chunks != 1:
        raise InputError("a plan describes one layer range per stage; it cannot be run interleaved",
                         source=plan.source, field="schedule")
    if plan.num_layers != table.num_layers:
        raise InputError(f"plan has {plan.num_layers} layers, model {model} has {table.num_layers}",
                         source=plan.source, field="stages")
    return np.asarray(plan.parts, dtype=np.int64), np.array([n in plan.recompute for n in table.names])


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


def _stats(config: SimulateJobConfig, spec):
    """The stats the balancer sees, in the model's units (``omnibal.sim.predict.model_stats``, as ``plan``)."""
    if config.stats_path:
        from omnibal.stats.io import load_stats

        stats = load_stats(config.stats_path)
        if config.samples is not None:
            _check_positive("samples", config.samples)
            stats = stats.replicate(config.samples)
        return model_stats(stats, spec, convert=config.convert_stats)
    from omnibal.stats.synthetic import synthetic_internvl_mixture

    samples = 1_200_000 if config.samples is None else config.samples
    _check_positive("samples", samples)
    stats = synthetic_internvl_mixture(samples, seed=config.seed)
    return model_stats(stats, spec, convert=True)  # the stand-in mixture is InternVL-tiled: any model's units


def _check_positive(name: str, value) -> None:
    if value is None or value < 1:
        raise InputError(f"must be a positive integer, got {value!r}", source=FLAGS.get(name, name), field=name)


def _schedule(config: SimulateJobConfig, stats, setup: _Setup, cluster: dict):
    from omnibal.data.balance import BalanceConfig, Schedule, balance

    if config.schedule_file:
        sched = Schedule.from_json(config.schedule_file)
        if sched.levels is not None:  # one table and one micro-batch count would price it wrongly
            raise InputError("a multi-level (HBP) schedule runs each level with its own SP degree and micro-batch "
                             "count; omnibal simulate takes single-level schedules (omnibal plan --hbp simulates "
                             "levels)", source=config.schedule_file, field="levels")
        if sched.dp_size != cluster["dp_size"] or sched.num_microbatches != cluster["num_microbatches"]:
            raise InputError(f"schedule is for dp {sched.dp_size} x {sched.num_microbatches} micro-batches, "
                             f"simulating dp {cluster['dp_size']} x {cluster['num_microbatches']}",
                             source=config.schedule_file, field="dp_size")
        return sched
    bconfig = BalanceConfig(method=config.balance_method, batch_size=config.batch_size,
                            cost=balance_cost(setup.table, setup.spec, setup.hardware, config.profile_path))
    return balance(stats, dp_size=cluster["dp_size"], num_microbatches=cluster["num_microbatches"], seed=config.seed,
                   epoch=config.epoch, config=bconfig)


def _features(config: SimulateJobConfig, plan: PlannedRun | None, sched, stats, pp_size: int):
    """(padding description, compute features, p2p buffer features or None). ``auto``: with a plan, the
    padding ``omnibal plan`` scored it with (so both predict the same step); else the schedule's own for
    compute and, with pp > 1, the fixed buffer (the caps) for p2p, as the reference trainer sends one buffer
    shape between stages."""
    if config.padding != "auto":
        padding, p2p = config.padding, None
    elif plan is not None and sched.method != "random" and plan.padding is not None:
        padding, p2p = plan.padding, None
    else:
        padding, p2p = sched.padding, "fixed_buffer"
    features, buffer = schedule_features(sched, stats, padding=padding, p2p_padding=p2p, pp_size=pp_size)
    if buffer is not None:
        padding += f" (p2p: {p2p})"
    return padding, features, buffer


def _header(config: SimulateJobConfig, plan: PlannedRun | None, setup: _Setup, stats, sched, padding: str) -> dict:
    c, chunks = setup.cluster, setup.num_chunks
    return {
        "model": setup.spec.name, "hardware": setup.hardware.name,
        "dp x pp x tp": f"{c['dp_size']} x {c['pp_size']} x {c['tp_size']}",
        "micro-batches per step": c["num_microbatches"],
        "schedule": config.schedule + (f" ({chunks} chunks per stage)" if chunks > 1 else ""),
        "data": f"{stats.source}, {len(stats):,} samples", "balance": sched.method, "padding": padding,
        "caps (tiles, tokens)": f"{sched.caps.tiles}, {sched.caps.tokens}",
        "plan": plan.source if plan is not None else f"partition {config.partition}, recompute {config.recompute}",
        "costs": f"profile {config.profile_path}" if config.profile_path else f"analytic ({config.dtype})",
    }


def _write(config: SimulateJobConfig, setup: _Setup, epoch, features, buffer, header: dict) -> dict:
    """The report (markdown, JSON, timeline of one step, load histograms) into ``config.out``."""
    from omnibal.sim.epoch import simulate_one_step
    from omnibal.sim.report import write_report

    step_index = int(np.argmax(epoch.step_time)) if config.timeline_step is None else config.timeline_step
    if not 0 <= step_index < len(epoch.step_time):
        raise InputError(f"step {step_index} is outside 0..{len(epoch.step_time) - 1}", source="--timeline-step",
                         field="timeline_step")
    costs, step = simulate_one_step(setup.table, setup.cuts, setup.recompute, features[step_index],
                                    setup.sim_config, None if buffer is None else buffer[step_index])
    return write_report(epoch, costs, step, step_index, config.out, header=header, layer_names=setup.table.names)
