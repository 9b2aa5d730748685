"""``omnibal simulate`` as a library call: a cluster, a partition and data in, a serialisable result out.

Phases (each a call into the layer that owns it):

1. the cluster: explicit settings win, a plan (:class:`omnibal.plan.plan.Plan`) fills the rest, then the defaults; with
   neither a plan nor a model there is nothing to simulate (an InputError naming ``--plan`` and ``--model``);
2. model spec (the plan's, else the preset) -> per-layer cost table (analytic, or a measured profile), per TP
   rank, and the simulator's config (the plan's memory budget);
3. the partition and recompute set (the plan's, or ``even`` / stage starts and ``full`` / ``none`` / counts);
4. per-sample stats (a file, or the synthetic InternVL-like mixture) in the model's units and, with a plan,
   the uniform sample of them the plan balanced (``jobs.predict.job_stats`` and ``balance_subset``, as
   ``omnibal plan``);
5. the balanced schedule (``data.balance`` with the plan's balancer settings, ``jobs.simulate_plan``, by
   ``jobs.predict.balance_cost``, or a schedule file) and its micro-batch features
   (``jobs.predict.schedule_features``);
6. ``sim.epoch``: the whole epoch (scaled from the balanced sample), then one step drawn for the timeline,
   and the report files.

So ``simulate --plan`` reproduces the plan's own prediction (tests/test_simulate_plan.py); what it reads from
the plan is ``jobs.simulate_plan``'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import numpy as np

from omnibal.cost.hardware import DEFAULT_MEMORY_HEADROOM, HardwareSpec, get_hardware
from omnibal.cost.stack import DEFAULT_STACK, check_stack_zero
from omnibal.cost.table import RECOMPUTE_FULL, RECOMPUTE_NONE, RECOMPUTE_SELECTIVE
from omnibal.errors import InputError
from omnibal.jobs.predict import balance_cost, balance_subset, cost_table, job_stats, schedule_features
from omnibal.jobs.simulate_plan import missing, planned_balance_config, planned_data, planned_spec
from omnibal.layout import (
    LAYOUT_FLAGS,
    BalanceMethod,
    Dtype,
    Layout,
    Padding,
    PartialLayout,
    PipelineSchedule,
    check_layout_fields,
)
from omnibal.plan.plan import Plan

if TYPE_CHECKING:
    from omnibal.cost.hardware import HardwareSpec
    from omnibal.cost.spec import ModelSpec
    from omnibal.cost.table import LayerCostTable
    from omnibal.sim.costs import SimConfig

DEFAULTS = {"model": None, "hardware": "a100-80g", "stack": DEFAULT_STACK}
"""What an unset cluster setting is when no plan gives it (the model has no default: it must be asked for)."""
SIMULATE_LAYOUT = Layout(num_microbatches=4)
"""The layout unset layout fields are when no plan gives them: DP 1 x PP 1 x TP 1, ZeRO-1, 4 micro-batches."""
LAYOUT_HELP = {name: f"{spec['help'][0].upper()}{spec['help'][1:]}; None: the plan's, else "
                     f"{getattr(SIMULATE_LAYOUT, name)}." for name, spec in LAYOUT_FLAGS.items()}
"""Each layout flag's help here: the layout's help, and what the field is when left unset."""
PADDINGS = ("auto", *Padding)
"""How a simulated micro-batch may run: ``auto`` (see ``SimulateJobConfig.padding``) or a :class:`Padding`."""
MUST_MATCH_PLAN = ("model", "pp_size")
"""Settings that, given explicitly, must agree with the plan's (the partition depends on them)."""


@dataclass(frozen=True, kw_only=True)
class SimulateJobConfig:
    """Everything ``omnibal simulate`` needs. A cluster setting left None is the plan's, else ``DEFAULTS``."""

    plan: str | None = None
    """A ``plan.json`` of ``omnibal plan`` to simulate (read here unless the caller hands the :class:`Plan`
    over; errors name it)."""
    model: str | None = None
    """Model preset (``omnibal.cost.presets``); None: the plan's (without a plan: an InputError)."""
    hardware: str | HardwareSpec | None = field(default=None, metadata={"parse": str})
    """Hardware preset (``omnibal.cost.hardware``: a100-40g, a100-80g, h100, h200) or a :class:`HardwareSpec`
    (``--hardware cpu``: the CLI measures this machine with ``omnibal.measure.hardware.hardware_by_name`` and
    passes the spec); None: the plan's, else a100-80g."""
    layout: PartialLayout = field(default_factory=PartialLayout, metadata={"fields": LAYOUT_HELP})
    """DP x PP x TP, ZeRO stage and micro-batches per DP rank per step; a field left None is the plan's, else
    ``SIMULATE_LAYOUT``'s."""
    pp_schedule: PipelineSchedule | None = None
    """Pipeline schedule; None: the plan's, else ``1f1b`` (``interleaved``: Megatron's interleaved 1F1B, with
    ``num_chunks``)."""
    num_chunks: int | None = field(default=None, metadata={"option": "chunks"})
    """Model chunks per stage for the interleaved schedule (None: 2 there, else 1); partition and recompute
    lists then name pp x chunks virtual stages."""
    memory_fraction: float | None = None
    """Share of the device memory a rank may use (OOM flags); None: the plan's budget, else the device less
    ``omnibal.cost.hardware.DEFAULT_MEMORY_HEADROOM``."""
    step_overhead: float = 0.0
    """Fixed seconds per step outside the pipeline."""
    jitter: float = 0.0
    """Relative standard deviation of a rank's unpredicted step-time variation."""
    dtype: Dtype = "bf16"
    """Training dtype of the analytic cost model."""
    stack: str | None = None
    """Software stack whose weight/gradient/optimizer bytes the memory model counts and the gradient
    all-reduce moves (``omnibal.cost.stack``); None: the plan's, else ``DEFAULT_STACK`` (as ``omnibal plan``)."""
    profile_path: str | None = field(default=None, metadata={"option": "profile"})
    """Measured layer profile instead of the analytic cost model; None: the plan's (if it had one)."""
    stats_path: str | None = field(default=None, metadata={"option": "stats"})
    """Per-sample stats file; None: the plan's data, else the synthetic mixture."""
    samples: int | None = None
    """Synthetic mixture size (None: the plan's, else 1,200,000); with ``stats_path``: replicate its rows up
    to this many."""
    convert_stats: bool = False
    """Convert statistics made in another image convention to the model's (``--convert-stats``); without it
    they are an InputError naming both (``omnibal.cost.units.model_stats``)."""
    schedule_file: str | None = None
    """A balanced schedule JSON instead of balancing here."""
    balance_method: BalanceMethod | None = None
    """Balancer (``omnibal.layout.BalanceMethod``); None: the plan's, with its settings, else ``omnibal``."""
    batch_size: int | None = None
    """Samples per micro-batch of the random and length-grouped baselines (None: the plan's, else 4)."""
    padding: str = field(default="auto", metadata={"choices": PADDINGS})
    """How a micro-batch runs; ``auto``: with a plan, the padding ``omnibal plan`` scored it with; else the
    schedule's own, and with pp > 1 the fixed buffer for p2p."""
    seed: int | None = None
    """Seed of the balancer, the balanced sample and the synthetic data (None: the plan's, else 0)."""
    epoch: int = 0
    """Epoch to balance."""
    partition: str = "even"
    """``even`` or the first layer of each (virtual) stage, comma-separated (ignored with a plan)."""
    recompute: str = "full"
    """``full``, ``none`` or per-stage counts of recomputed layers (ignored with a plan)."""
    out: str | None = "simulate-report"
    """Report folder; None (``--no-report``): no report files."""
    timeline_step: int | None = None
    """Step drawn in the timeline (None: the slowest)."""


@dataclass(frozen=True)
class SimulateJobResult:
    """What ``omnibal simulate`` prints and wrote; every field is JSON-serialisable."""

    header: dict
    """The report's header: model, cluster, pp schedule, data, balance, padding, caps, plan, costs."""
    summary: dict
    """``EpochResult.summary()``: step times, bubbles, per-stage busy / memory, OOM, GPU days."""
    totals: list = field(default_factory=list)
    """Rows (first: header) of the totals table."""
    stages: list = field(default_factory=list)
    """Rows (first: header) of the per-stage table."""
    files: dict = field(default_factory=dict)
    """Report files written: markdown, json, timeline, load (empty without ``out``)."""
    notes: list = field(default_factory=list)
    """Where this simulation departs from the plan it was given (fields the plan does not record, other
    statistics, other caps); empty when it is the plan's own prediction or there is no plan."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, eq=False)
class _Setup:
    """The resolved inputs of one simulation (phases 1-3)."""

    cluster: dict
    spec: ModelSpec
    hardware: HardwareSpec
    table: LayerCostTable
    cuts: np.ndarray
    recompute: np.ndarray
    sim_config: SimConfig
    num_chunks: int
    pp_schedule: str
    profile: str | None


def plan_source(config: SimulateJobConfig) -> str:
    """How errors name the plan: its file, else ``plan``."""
    return config.plan or "plan"


def load_plan(config: SimulateJobConfig) -> Plan | None:
    """The plan ``config.plan`` names (None without one)."""
    return None if config.plan is None else Plan.load(config.plan)


def run_simulate_job(config: SimulateJobConfig, *, plan: Plan | None = None, progress: bool = False,
                     log: Callable[[str], None] | None = None) -> SimulateJobResult:
    """Simulate one epoch (see the module docstring). ``plan``: the plan already read (default: ``config.plan``
    read here); ``progress``: a bar on stderr over the steps; ``log(line)``: told what each phase is doing."""
    from omnibal.sim.epoch import simulate_epoch

    log = log or (lambda line: None)
    plan = plan if plan is not None else load_plan(config)
    setup = _setup(config, plan)
    cluster = setup.cluster
    notes = [f"plan.json has no {', '.join(missing(plan))}: flags and defaults stand in"] if (
        plan is not None and missing(plan)) else []
    data = planned_data(plan, plan_source(config), stats_path=config.stats_path, samples=config.samples,
                        seed=config.seed, convert=config.convert_stats)
    log(f"stats: {data['stats_path'] or 'synthetic mixture'} ...")
    stats, scale = _stats(config, setup.spec, data)
    bconfig = planned_balance_config(plan, plan_source(config), method=config.balance_method,
                                     batch_size=config.batch_size,
                                     cost=balance_cost(setup.table, setup.spec, setup.hardware, setup.profile))
    log(f"balancing {len(stats):,} samples ({config.schedule_file or bconfig.method}) for dp "
        f"{cluster['dp_size']} x {cluster['num_microbatches']} micro-batches ...")
    sched = _schedule(config, stats, cluster, bconfig, data["seed"])
    notes += _departures(plan, stats, sched)
    padding, features, buffer = _features(config, plan, sched, stats, cluster["pp_size"])
    log(f"simulating {features.shape[0]} steps x {cluster['dp_size']} ranks x {cluster['num_microbatches']} "
        f"micro-batches x {cluster['pp_size']} stages ...")
    epoch = simulate_epoch(setup.table, setup.cuts, setup.recompute, features, setup.sim_config,
                           buffer_features=buffer, progress=progress, epoch_scale=scale)
    if len(epoch.step_time) == 0:
        raise InputError("the schedule has no steps", source="--stats", field="samples")
    header = _header(config, plan, setup, stats, sched, padding, scale)
    files = {} if config.out is None else _write(config, setup, epoch, features, buffer, header)
    from omnibal.sim.report import stage_table, totals_rows

    return SimulateJobResult(header=header, summary=epoch.summary(), totals=totals_rows(epoch),
                             stages=stage_table(epoch), files={k: str(v) for k, v in files.items()}, notes=notes)


def _departures(plan: Plan | None, stats, sched) -> list[str]:
    """Where the balanced data differs from the plan's (other statistics, other caps): said, not refused, as
    simulating a plan on other data is a question one may ask."""
    if plan is None:
        return []
    notes = []
    fingerprint = plan.inputs.stats_fingerprint
    if fingerprint and stats.fingerprint() != fingerprint:
        notes.append(f"the statistics differ from the plan's (fingerprint {stats.fingerprint()}, the plan's "
                     f"{fingerprint}): this is not the plan's prediction")
    caps, planned = {"tiles": int(sched.caps.tiles), "tokens": int(sched.caps.tokens)}, plan.data.settings.get("caps")
    if planned is not None and caps != planned and sched.method == plan.data.method:
        notes.append(f"balanced to caps {caps['tiles']} tiles / {caps['tokens']} tokens, the plan's are "
                     f"{planned['tiles']} / {planned['tokens']}")
    return notes


def resolve_cluster(config: SimulateJobConfig, plan: Plan | None) -> dict:
    """Cluster settings (model, hardware, stack and the layout's fields): explicit ones win; a plan fills the
    rest; then ``DEFAULTS`` and ``SIMULATE_LAYOUT``."""
    planned, base = {}, SIMULATE_LAYOUT
    if plan is not None:
        base = plan.inputs.layout
        planned = {"model": plan.inputs.model, "hardware": plan.inputs.hardware, **base.to_dict()}
        if plan.data.settings.get("stack") is not None:
            planned["stack"] = plan.data.settings["stack"]
    for key, value in config.layout.given().items():
        check_layout_fields({key: value}, source=LAYOUT_FLAGS[key]["flag"])
    given = {**{key: getattr(config, key) for key in DEFAULTS if getattr(config, key) is not None},
             **config.layout.given()}
    for key in MUST_MATCH_PLAN:
        if key in given and key in planned and given[key] != planned[key]:
            # a layout setting is named by its flag; another by the field, which the CLI names by its flag
            raise InputError(f"{given[key]} contradicts the plan's {planned[key]} ({plan_source(config)})",
                             source=LAYOUT_FLAGS[key]["flag"] if key in LAYOUT_FLAGS else None, field=key)
    out = {key: given.get(key, planned.get(key, default)) for key, default in DEFAULTS.items()}
    if out["model"] is None:
        raise InputError("nothing to simulate: give --plan FILE (a plan.json of omnibal plan) or --model NAME "
                         "(with --hardware, --dp, --pp and --microbatches)")
    return {**out, **config.layout.resolve(base).to_dict()}


def _setup(config: SimulateJobConfig, plan: Plan | None) -> _Setup:
    from omnibal.sim.costs import config_for_hardware

    cluster = resolve_cluster(config, plan)
    check_stack_zero(cluster["stack"], cluster["zero_stage"])
    spec = planned_spec(cluster["model"], plan, plan_source(config))
    hardware = cluster["hardware"]
    if not isinstance(hardware, HardwareSpec):  # ``cpu`` is measured: the caller passes its spec
        hardware = get_hardware(hardware)
    profile = config.profile_path if config.profile_path is not None or plan is None else plan.inputs.profile
    table = cost_table(spec, hardware, profile_path=profile, tp_size=cluster["tp_size"], dtype=config.dtype,
                       stack=cluster["stack"])
    if cluster["pp_size"] > table.num_layers:
        raise InputError(f"{cluster['pp_size']} stages for {table.num_layers} layers",
                         source=LAYOUT_FLAGS["pp_size"]["flag"], field="pp_size")
    planned_pp_schedule = plan.pp_schedule if plan is not None else None
    pp_schedule = config.pp_schedule or planned_pp_schedule or "1f1b"
    chunks = config.num_chunks if config.num_chunks is not None else (
        plan.inputs.num_chunks if plan is not None and pp_schedule == planned_pp_schedule
        else 2 if pp_schedule == "interleaved" else 1)
    num_virtual = cluster["pp_size"] * chunks
    if num_virtual > table.num_layers:
        raise InputError(f"{num_virtual} virtual stages for {table.num_layers} layers", source="--chunks",
                         field="chunks")
    cuts, rec = _partition(config, plan, table, spec.name, chunks, num_virtual)
    if config.memory_fraction is not None and not 0 < config.memory_fraction <= 1:
        raise InputError(f"must be in (0, 1], got {config.memory_fraction}", source="--memory-fraction",
                         field="memory_fraction")
    planned_budget = config.memory_fraction is None and plan is not None
    sim_config = config_for_hardware(
        hardware, dp_size=cluster["dp_size"], pp_size=cluster["pp_size"], tp_size=cluster["tp_size"],
        pp_schedule=pp_schedule, num_chunks=chunks, zero_stage=cluster["zero_stage"],
        memory_headroom=DEFAULT_MEMORY_HEADROOM if config.memory_fraction is None else 1.0 - config.memory_fraction,
        step_overhead=config.step_overhead, compute_jitter=config.jitter)
    if planned_budget:  # the budget the plan fitted (``omnibal plan --memory-budget``, else less its headroom)
        sim_config = replace(sim_config, memory_budget_bytes=plan.inputs.memory_budget_bytes)
    return _Setup(cluster=cluster, spec=spec, hardware=hardware, table=table, cuts=cuts, recompute=rec,
                  sim_config=sim_config, num_chunks=chunks, pp_schedule=pp_schedule, profile=profile)


def _partition(config: SimulateJobConfig, plan: Plan | None, table, model: str, chunks: int,
               num_virtual: int):
    """Cut points and the per-layer recompute mask: the plan's, or parsed from the config."""
    if plan is None:
        cuts = parse_partition(config.partition, table.num_layers, num_virtual)
        return cuts, parse_recompute(config.recompute, cuts)
    if chunks != plan.inputs.num_chunks:
        raise InputError(f"the plan describes {plan.inputs.num_chunks} layer range(s) per pipeline stage; it cannot "
                         f"be run with {chunks}", source=plan_source(config), field="inputs.num_chunks")
    if plan.num_layers != table.num_layers:
        raise InputError(f"plan has {plan.num_layers} layers, model {model} has {table.num_layers}",
                         source=plan_source(config), field="stages")
    full, selective = set(plan.recompute_modules()), set(plan.selective_modules())
    codes = np.array([RECOMPUTE_FULL if n in full else RECOMPUTE_SELECTIVE if n in selective
                      else RECOMPUTE_NONE for n in table.names], dtype=np.int8)
    return np.asarray(plan.parts, dtype=np.int64), codes


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


def _stats(config: SimulateJobConfig, spec, data: dict):
    """``(stats the balancer sees, epoch scale)``: the data in the model's units
    (``omnibal.jobs.predict.job_stats``) and, with a plan, the uniform sample of them it balanced
    (``balance_subset``, as ``omnibal plan``: the epoch is scaled from it); a schedule file is its own epoch."""
    stats, _ = job_stats(spec, stats_path=data["stats_path"], num_samples=data["num_samples"], seed=data["seed"],
                         convert=data["convert"])
    if config.schedule_file:
        return stats, 1.0
    sample = balance_subset(stats, data["balance_samples"], data["seed"])
    return sample, len(stats) / len(sample)


def _schedule(config: SimulateJobConfig, stats, cluster: dict, bconfig, seed: int):
    from omnibal.data.balance import Schedule, balance

    if config.schedule_file:
        sched = Schedule.from_json(config.schedule_file)
        if sched.caps is None:  # the report and the plan comparison are in the balancer's caps
            raise InputError("missing key 'caps': omnibal simulate takes the balancer's schedules (omnibal balance "
                             "--out)", source=config.schedule_file, field="caps")
        if sched.levels is not None:  # one table and one micro-batch count would price it wrongly
            raise InputError("a multi-level (HBP) schedule runs each level with its own SP degree and micro-batch "
                             "count; omnibal simulate takes single-level schedules (omnibal plan --hbp simulates "
                             "levels)", source=config.schedule_file, field="levels")
        if sched.dp_size != cluster["dp_size"] or sched.num_microbatches != cluster["num_microbatches"]:
            raise InputError(f"schedule is for dp {sched.dp_size} x {sched.num_microbatches} micro-batches, "
                             f"simulating dp {cluster['dp_size']} x {cluster['num_microbatches']}",
                             source=config.schedule_file, field="dp_size")
        return sched
    return balance(stats, dp_size=cluster["dp_size"], num_microbatches=cluster["num_microbatches"], seed=seed,
                   epoch=config.epoch, config=bconfig)


def _features(config: SimulateJobConfig, plan: Plan | None, sched, stats, pp_size: int):
    """(padding description, compute features, p2p buffer features or None). ``auto``: with a plan, the
    padding ``omnibal plan`` scored it with (so both predict the same step); else the schedule's own for
    compute and, with pp > 1, the fixed buffer (the caps) for p2p, as the reference trainer sends one buffer
    shape between stages."""
    if config.padding != "auto":
        padding, p2p = config.padding, None
    elif plan is not None and sched.method != "random" and plan.data.settings.get("padding") is not None:
        padding, p2p = plan.data.settings["padding"], None
    else:
        padding, p2p = sched.padding, "fixed_buffer"
    features, buffer = schedule_features(sched, stats, padding=padding, p2p_padding=p2p, pp_size=pp_size)
    if buffer is not None:
        padding += f" (p2p: {p2p})"
    return padding, features, buffer


def _header(config: SimulateJobConfig, plan: Plan | None, setup: _Setup, stats, sched, padding: str,
            scale: float) -> dict:
    c, chunks = setup.cluster, setup.num_chunks
    data = f"{stats.source}, {len(stats):,} samples"
    if scale != 1.0:
        data += f" (a uniform sample of the epoch, scaled x{scale:.3g})"
    return {
        "model": setup.spec.name, "hardware": setup.hardware.name,
        "dp x pp x tp": f"{c['dp_size']} x {c['pp_size']} x {c['tp_size']}",
        "micro-batches per step": c["num_microbatches"],
        "pp schedule": setup.pp_schedule + (f" ({chunks} chunks per stage)" if chunks > 1 else ""),
        "data": data, "balance": sched.method, "padding": padding,
        "caps (tiles, tokens)": f"{sched.caps.tiles}, {sched.caps.tokens}",
        "plan": plan_source(config) if plan is not None else (
            f"partition {config.partition}, recompute {config.recompute}"),
        "costs": f"profile {setup.profile}" if setup.profile else f"analytic ({config.dtype})",
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
