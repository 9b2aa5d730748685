"""The phases of :func:`omnibal.jobs.plan_job.run_plan_job`, one function each: model and cluster, statistics,
balancing, the exact joint plan, the simulator-scored search, the pack-size search, and the ablation epochs.
Each takes the job's config and what the earlier phases produced, and returns a frozen record."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from omnibal.cost.analytic import zero3_gather_reserve, zero_sharded_bytes
from omnibal.cost.hardware import HardwareSpec, get_hardware
from omnibal.cost.units import convention_label, model_stats
from omnibal.errors import InputError
from omnibal.jobs.predict import balance_cost, cost_table, job_stats
from omnibal.jobs.predict import balance_subset as predict_subset
from omnibal.plan.ablation import AblationRow, with_speedups
from omnibal.plan.engines import constraint_rows
from omnibal.plan.joint import JointPlanner, StagePlanSet
from omnibal.plan.packsize import search_pack_size
from omnibal.plan.partition import check_num_stages, even_partition, min_max_partition, vision_first_partition
from omnibal.plan.search import Candidate, sample_steps, search
from omnibal.plan.stages import StageModelConfig, layer_quantities
from omnibal.sim.epoch import score_plan, simulate_epoch

if TYPE_CHECKING:
    from collections.abc import Callable

    from omnibal.cost.spec import ModelSpec
    from omnibal.cost.table import LayerCostTable
    from omnibal.data.balance.api import BalanceConfig
    from omnibal.data.balance.cost import BalanceCost
    from omnibal.data.balance.schedule import Schedule
    from omnibal.sim.costs import SimConfig
    from omnibal.stats.table import SampleStats

GiB = float(1 << 30)
INTERLEAVED_ROW = "+ interleaved schedule"
"""The ablation row of an interleaved plan (after the plain plan's rows)."""


@dataclass(frozen=True, eq=False)
class Model:
    """Phase 1: the model, the hardware and how the cluster runs it."""

    spec: ModelSpec
    hw: HardwareSpec
    table: LayerCostTable
    sim_config: SimConfig
    budget: float | None
    stage_config: StageModelConfig


@dataclass(frozen=True, eq=False)
class Data:
    """Phases 2-3 (and the pack-size search): the statistics (subsampled), the schedules, their features and
    metrics."""

    stats: SampleStats
    stats_source: str
    convention: str
    full_samples: int
    epoch_scale: float
    synthetic: bool = False
    """Whether the statistics are the synthetic mixture (drawn again from the plan's seed and size)."""
    cost: BalanceCost | None = None
    bal_sched: Schedule | None = None
    bal_config: BalanceConfig | None = None
    padding_bal: str = ""
    features: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    num_microbatches: int = 0
    """Micro-batches per step of the plan (the pack-size search's choice, else the job's)."""
    pack_report: dict | None = None
    """The pack-size search's candidates and choice (None: not searched)."""
    pack_desc: str | None = None
    """The ``+ pack size`` row's data description (None: the search kept the job's pack)."""

    @property
    def final_key(self) -> str:
        """The features the plan runs: ``packed`` when the pack-size search chose another pack."""
        return "packed" if "packed" in self.features else "balanced"


@dataclass(frozen=True, eq=False)
class Found:
    """Phases 4-6: the planner, its anchors, the searched plans and what the search scored."""

    planner: JointPlanner
    anchor_joint: StagePlanSet
    anchor_full: StagePlanSet
    score: Callable[[StagePlanSet], tuple[float, bool]]
    """The search's score of a plan: simulated mean step time of ``sample``, and whether a step runs out of memory."""
    sample: np.ndarray | None = None
    """The steps' micro-batch features ``[S, D, M, 4]`` the search scores on."""
    best_full: Candidate | None = None
    best_joint: Candidate | None = None
    best_adaptive: Candidate | None = None
    """The joint plan at the job's own pack with whole-layer recompute (the ``+ adaptive recompute`` row)."""
    best_selective: Candidate | None = None
    """The same with selective recompute too (the ``+ selective recompute`` row; None when not planned)."""
    full_layer_planner: JointPlanner | None = None
    """The planner at the job's own pack that recomputes whole layers only (the paper's adaptive recompute)."""
    default_planner: JointPlanner | None = None
    """The planner at the job's own pack (the ``+ data balance`` row)."""
    scored: list = field(default_factory=list)
    num_enumerated: int = 0
    engine_info: dict = field(default_factory=dict)
    best_plain: Candidate | None = None
    """The plan before interleaving (the ``+ pack size`` or last plain row), when an interleaved one replaced it."""
    num_chunks: int = 1
    """Model chunks per device of the plan (> 1: ``best_joint`` is over the interleaved virtual stages)."""
    sim_config: SimConfig | None = None
    """The simulator's config of the plan when it differs from the job's (interleaved); None: the job's."""
    interleave_report: dict | None = None
    """The interleaved candidates scored and the plain plan they were weighed against (None: not searched)."""


def resolve_hardware(hardware) -> HardwareSpec:
    """A :class:`HardwareSpec` as given, or a preset by name (``cpu`` is measured: the caller resolves it
    with ``omnibal.measure.hardware.hardware_by_name`` and passes the spec)."""
    return hardware if isinstance(hardware, HardwareSpec) else get_hardware(hardware)


def model_phase(config) -> Model:
    """The cost table on the hardware, the simulator's config, the memory budget and the stage model."""
    from omnibal.sim.costs import config_for_hardware

    if config.hf_model is not None:
        from omnibal.cost.hf_spec import load_hf_spec

        spec = load_hf_spec(config.hf_model)
    else:
        from omnibal.cost.presets import get_model_preset

        spec = get_model_preset(config.preset)
    hw = resolve_hardware(config.hardware)
    lay = config.layout
    table = cost_table(spec, hw, profile_path=config.profile_path, tp_size=lay.tp_size, stack=config.stack)
    check_num_stages(lay.pp_size, table.num_layers)
    headroom = None if config.memory_budget_gib is not None else config.memory_headroom
    sim_config = config_for_hardware(hw, dp_size=lay.dp_size, pp_size=lay.pp_size, tp_size=lay.tp_size,
                                     pp_schedule=config.pp_schedule, zero_stage=lay.zero_stage,
                                     memory_headroom=headroom)
    if config.memory_budget_gib is not None:
        sim_config = replace(sim_config, memory_budget_bytes=config.memory_budget_gib * GiB)
    budget = sim_config.memory_budget_bytes
    _check_static_memory(table, config, budget)
    stage_config = StageModelConfig(num_stages=lay.pp_size, num_microbatches=lay.num_microbatches,
                                    dp_size=lay.dp_size, zero_stage=lay.zero_stage,
                                    memory_budget_bytes=None if budget is None else budget - _gather_reserve(
                                        table, config),
                                    p2p_bandwidth=sim_config.p2p_bandwidth, p2p_latency=sim_config.p2p_latency,
                                    dp_bandwidth=sim_config.dp_bandwidth, dp_latency=sim_config.dp_latency,
                                    pp_schedule=config.pp_schedule, selective_recompute=config.selective_recompute)
    return Model(spec=spec, hw=hw, table=table, sim_config=sim_config, budget=budget, stage_config=stage_config)


def _stats(config, spec):
    """The statistics in the model's units (``omnibal.jobs.predict.job_stats``, as ``omnibal simulate``)."""
    stats, convention = job_stats(spec, stats_path=config.stats_path, seed=config.seed,
                                  num_samples=None if config.stats_path is not None else config.num_samples,
                                  convert=config.convert_stats)
    return stats, str(config.stats_path) if config.stats_path is not None else stats.source, convention


def stats_phase(config, model: Model, stats, cache: dict | None) -> Data:
    """The statistics (given, cached, read or synthetic) in the model's units and the uniform subset that
    is balanced."""
    spec = model.spec
    synthetic = stats is None and config.stats_path is None
    if stats is not None:
        convention = convention_label(stats, spec)
        stats = model_stats(stats, spec, convert=config.convert_stats)
        stats_source = stats.source
    else:
        key = ("stats", config.stats_path, config.num_samples, config.seed, spec.name, config.convert_stats)
        if cache is not None and key in cache:
            stats, stats_source, convention = cache[key]
        else:
            stats, stats_source, convention = _stats(config, spec)
            if cache is not None:
                cache[key] = (stats, stats_source, convention)
    full_samples = len(stats)
    stats = balance_subset(stats, config)
    return Data(stats=stats, stats_source=stats_source, convention=convention, full_samples=full_samples,
                epoch_scale=full_samples / len(stats), num_microbatches=config.layout.num_microbatches,
                synthetic=synthetic)


def balance_subset(stats, config):
    """The rows of ``stats`` the job balances (``omnibal.jobs.predict.balance_subset`` with the job's
    ``balance_samples`` and seed): ``omnibal plan``, ``--hbp`` and ``omnibal simulate --plan`` use the same."""
    return predict_subset(stats, config.balance_samples, config.seed)


def _balanced(config, stats, cache: dict | None, bconfig, num_microbatches: int):
    """``stats`` balanced by ``bconfig`` for DP x ``num_microbatches`` slots (memoised in ``cache``)."""
    from omnibal.data.balance.api import balance

    key = ("balance", stats.fingerprint(), config.layout.dp_size, num_microbatches, config.seed,
           repr(bconfig.to_dict()))
    if cache is not None and key in cache:
        return cache[key]
    sched = balance(stats, dp_size=config.layout.dp_size, num_microbatches=num_microbatches, seed=config.seed,
                    config=bconfig)
    if cache is not None:
        cache[key] = sched
    return sched


def balance_phase(config, model: Model, data: Data, cache: dict | None) -> Data:
    """The baseline's and the planned balancer's schedules, their micro-batch features and metrics."""
    from omnibal.data.balance.api import BalanceConfig
    from omnibal.data.metrics import schedule_metrics

    stats, m = data.stats, config.layout.num_microbatches
    cost = balance_cost(model.table, model.spec, model.hw, config.profile_path)
    base_sched = _balanced(config, stats, cache,
                           BalanceConfig(method=config.baseline_sampler, batch_size=config.baseline_batch_size,
                                         cost=cost), m)
    bal_config = BalanceConfig(method=config.balance_method, cost=cost, max_tiles=config.max_tiles,
                               max_tokens=config.max_tokens, oversize=config.oversize)
    bal_sched = _balanced(config, stats, cache, bal_config, m)
    padding_base = config.baseline_padding
    padding_bal = config.padding if config.balance_method != "random" else "pad_to_longest"
    features = {"baseline": base_sched.features(stats, padding=padding_base),
                "balanced": bal_sched.features(stats, padding=padding_bal)}
    metrics = {"baseline": schedule_metrics(replace_padding(base_sched, padding_base), stats, cost),
               "balanced": schedule_metrics(replace_padding(bal_sched, padding_bal), stats, cost)}
    return replace(data, cost=cost, bal_sched=bal_sched, bal_config=bal_config, padding_bal=padding_bal,
                   features=features, metrics=metrics)


def _scorer(model: Model, sample):
    """The search's score: the simulated mean step time of ``sample`` and whether any step runs out of memory."""
    def score(sp: StagePlanSet) -> tuple[float, bool]:
        s = score_plan(model.table, sp.parts, sp.recompute_mask(model.table.num_layers), sample, model.sim_config)
        return s.step_time_mean, s.oom

    return score


def plan_phase(config, model: Model, data: Data) -> Found:
    """The exact joint partition + recompute (and the full-recompute one) on the balanced micro-batches; with
    selective recompute, also the planner that recomputes whole layers only (the ablation's paper row)."""
    q = layer_quantities(model.table, data.features["balanced"], model.stage_config)
    planner = JointPlanner(q, model.stage_config)
    layers_only = planner
    if model.stage_config.selective_recompute:
        layers_only = JointPlanner(q, replace(model.stage_config, selective_recompute=False))
    sample = sample_steps(data.features["balanced"], config.search.sample_steps, config.search.seed)
    return Found(planner=planner, anchor_joint=planner.plan(), anchor_full=planner.plan_fixed_recompute("full"),
                 score=_scorer(model, sample), sample=sample, default_planner=planner, full_layer_planner=layers_only)


def search_phase(config, model: Model, data: Data, found: Found) -> Found:
    """The simulator-scored neighbour search around the anchors (whole-layer recompute, adaptive recompute
    with whole layers only, and with selective recompute when the job plans it)."""
    best_full, _, _ = search(found.planner, found.anchor_full, found.score, config.search, recompute="full")
    layers_only = found.full_layer_planner
    best_adaptive, scored, num_enumerated = search(layers_only, layers_only.plan(), found.score, config.search,
                                                   recompute="adaptive")
    best_selective = None
    if layers_only is not found.planner:
        best_selective, scored, num_enumerated = search(found.planner, found.anchor_joint, found.score,
                                                        config.search, recompute="adaptive")
    return replace(found, best_full=best_full, best_joint=best_selective or best_adaptive, best_adaptive=best_adaptive,
                   best_selective=best_selective, scored=scored, num_enumerated=num_enumerated)


def pack_phase(config, model: Model, data: Data, found: Found, cache: dict | None) -> tuple[Data, Found]:
    """The pack-size search (``plan.packsize``) and, when it picks another pack than the job's, that pack's
    balanced schedule, joint plan and neighbour search: the ``+ pack size`` row and the plan."""
    default_m, bal_config = config.layout.num_microbatches, data.bal_config
    fixed_caps = config.max_tiles is not None or config.max_tokens is not None
    if not config.pack_search.microbatches or config.balance_method != "omnibal" or fixed_caps:
        return data, found
    pack_config = replace(config.pack_search, microbatches=tuple(sorted({*config.pack_search.microbatches, default_m})))
    chosen, cands = search_pack_size(data.stats, model.table, model.stage_config, model.sim_config,
                                     balance_config=bal_config,
                                     samples_per_rank_step=default_m * bal_config.target_samples,
                                     config=pack_config, num_total_samples=data.full_samples, seed=config.seed,
                                     padding=data.padding_bal, incumbent=default_m)
    data = replace(data, pack_report={"candidates": [c.to_dict() for c in cands],
                                      "chosen": None if chosen is None else chosen.to_dict()})
    if chosen is None or chosen.num_microbatches == default_m:
        return data, found
    from omnibal.data.metrics import schedule_metrics

    m, pad = chosen.num_microbatches, data.padding_bal
    pack_bal_config = replace(bal_config, target_samples=chosen.target_samples)
    sched = _balanced(config, data.stats, cache, pack_bal_config, m)
    feats = sched.features(data.stats, padding=pad)
    stage_config = replace(model.stage_config, num_microbatches=m)
    planner = JointPlanner(layer_quantities(model.table, feats, stage_config), stage_config)
    score = _scorer(model, sample_steps(feats, config.search.sample_steps, config.search.seed))
    anchor = planner.plan()
    best, scored, enumerated = search(planner, anchor, score, config.search, recompute="adaptive")
    metrics = {**data.metrics, "packed": schedule_metrics(replace_padding(sched, pad), data.stats, data.cost)}
    data = replace(data, bal_sched=sched, bal_config=pack_bal_config, features={**data.features, "packed": feats},
                   metrics=metrics, num_microbatches=m,
                   pack_desc=f"{config.balance_method} balanced packs ({pad}), {m} micro-batches of "
                             f"~{chosen.target_samples:.2f} samples (searched)")
    found = replace(found, planner=planner, score=score, anchor_joint=anchor, best_joint=best, scored=scored,
                    num_enumerated=enumerated)
    return data, found


def interleave_phase(config, model: Model, data: Data, found: Found) -> Found:
    """Interleaved 1F1B (``plan.interleaved``) over the plan's own micro-batches, for the chunk counts the
    job allows; the plan becomes the fastest interleaved candidate that fits when it beats the plain one on
    the same sampled steps. Only for an engine without constraint rows that runs interleaved 1F1B."""
    from omnibal.plan.engines import get_engine
    from omnibal.plan.interleaved import best_interleaved, interleaved_candidates

    chunks = tuple(v for v in config.chunks if v > 1)
    if not chunks or config.pp_schedule != "1f1b" or config.layout.pp_size < 2 or constraint_rows(config.engine) \
            or "interleaved" not in get_engine(config.engine).pp_schedules:
        return found
    feats = data.features[data.final_key]
    sample = sample_steps(feats, config.search.sample_steps, config.search.seed)

    def score(sp: StagePlanSet, v: int) -> tuple[float, bool, tuple[float, ...]]:
        s = score_plan(model.table, sp.parts, sp.recompute_mask(model.table.num_layers), sample,
                       replace(model.sim_config, pp_schedule="interleaved", num_chunks=v))
        return s.step_time_mean, s.oom, s.peak_memory

    stage_config = replace(model.stage_config, num_microbatches=data.num_microbatches)
    cands = interleaved_candidates(model.table, feats, stage_config, score, chunks)
    best = best_interleaved(cands)
    plain = found.best_joint.sim_step_time
    report = {"plain_step_time_s": plain, "chunks": list(config.chunks), "chosen_chunks": 1,
              "candidates": [{"num_chunks": c.num_chunks, "share_slack": list(c.slack),
                              "parts": list(c.candidate.plan.parts), "sim_step_time_s": c.candidate.sim_step_time,
                              "oom": c.candidate.oom} for c in cands]}
    if best is None or plain is None or best.candidate.sim_step_time >= plain:
        return replace(found, interleave_report=report)
    report["chosen_chunks"] = best.num_chunks
    return replace(found, best_joint=best.candidate, best_plain=found.best_joint, num_chunks=best.num_chunks,
                   interleave_report=report,
                   scored=[c.candidate for c in cands if c.num_chunks == best.num_chunks],
                   sim_config=replace(model.sim_config, pp_schedule="interleaved", num_chunks=best.num_chunks))


def ablation_phase(config, model: Model, data: Data, found: Found):
    """Every ablation row simulated over its whole epoch: (rows, row plans, row results, row data keys,
    found), ``found`` replaced by the engine's constrained plan where the engine has constraints; a row's
    data key names the micro-batch features (``Data.features``) it ran."""
    table = model.table
    specs, found = _ablation_specs(config, model, data, found)
    base_padding = "padded to the longest" if config.baseline_padding == "pad_to_longest" else "variable length"
    data_desc = {"baseline": f"{config.baseline_sampler}, {config.baseline_batch_size} samples per micro-batch, "
                             + base_padding,
                 "balanced": f"{config.balance_method} balanced packs ({data.padding_bal})"}
    if data.pack_desc is not None:
        data_desc["packed"] = data.pack_desc
    rows, row_plans, row_results, row_data = [], {}, {}, {}
    for name, data_key, part_desc, rec_desc, sp, *sim_config in specs:
        mask = sp.recompute_mask(table.num_layers)
        res = simulate_epoch(table, sp.parts, mask, data.features[data_key], (sim_config or [model.sim_config])[0],
                             epoch_scale=data.epoch_scale)
        summary = res.summary()
        rows.append(AblationRow(
            name=name, data=data_desc[data_key], partition=part_desc, recompute=rec_desc, parts=sp.parts,
            num_checkpointed=int((mask == 1).sum()), num_selective=int((mask == 2).sum()),
            num_steps=summary["num_steps"],
            step_time_s=summary["step_time_mean_s"], epoch_time_s=res.total_time,
            gpu_days=res.gpu_days, bubble=summary["bubble_mean"],
            peak_memory_bytes=tuple(st["peak_memory_bytes"] for st in summary["stages"]),
            oom=bool(summary["oom_steps"])))
        row_plans[name] = (sp.parts, mask)
        row_results[name] = res
        row_data[name] = data_key
    # the paper's figures are a pipeline ablation (Megatron-DeepSpeed, PP 4): shown beside pipelined plans only
    rows = with_speedups(rows, model.spec.name if config.layout.pp_size > 1 else None)
    return rows, row_plans, row_results, row_data, found


def _ablation_specs(config, model: Model, data: Data, found: Found):
    """(name, data key, partition text, recompute text, plan) per ablation row, and ``found`` (the
    engine's constrained plan where it has constraints: the last row is the plan)."""
    table = model.table
    base_planner = JointPlanner(layer_quantities(table, data.features["baseline"], model.stage_config),
                                model.stage_config)
    if config.baseline_partition == "even":
        base_parts = even_partition(table.num_layers, config.layout.pp_size)
    else:
        base_parts = vision_first_partition(table.kinds, config.layout.pp_size)
    split_desc = "even layer count" if config.baseline_partition == "even" else "vision encoder on stage 0"
    specs = [
        ("baseline", "baseline", split_desc, "full", base_planner.evaluate(base_parts, "full")),
        ("+ data balance", "balanced", split_desc, "full", found.default_planner.evaluate(base_parts, "full")),
        ("+ balanced partition", "balanced", "exact min-max + search", "full", found.best_full.plan),
        ("+ adaptive recompute", "balanced", "joint min-max + search", "adaptive", found.best_adaptive.plan),
    ]
    if found.best_selective is not None:
        specs.append(("+ selective recompute", "balanced", "joint min-max + search", "adaptive, selective",
                      found.best_selective.plan))
    if data.final_key == "packed":
        pack_recompute = "adaptive, selective" if found.best_selective is not None else "adaptive"
        specs.append(("+ pack size", "packed", "joint min-max + search", pack_recompute,
                      (found.best_plain or found.best_joint).plan))
    if constraint_rows(config.engine):  # deepspeed and reference express every plan: no extra rows
        from omnibal.plan.engine_plan import engine_row_specs

        engine_specs, engine_final = engine_row_specs(config.engine, found.planner, found.score, config.search)
        specs += [(name, data.final_key, part, rec, sp) for name, part, rec, sp in engine_specs]
        anchor_joint, best_joint, scored, num_enumerated, engine_info = engine_final
        found = replace(found, anchor_joint=anchor_joint, best_joint=best_joint, scored=scored,
                        num_enumerated=num_enumerated, engine_info=engine_info)
    if found.num_chunks > 1:
        specs.append((INTERLEAVED_ROW, data.final_key, f"joint min-max over {found.num_chunks} chunks per device",
                      specs[-1][3], found.best_joint.plan, found.sim_config))
    return specs, found


def _gather_reserve(table, config) -> float:
    """Bytes of gathered ZeRO-3 weights (and one layer's gradient) the stage model leaves out of its budget
    (the simulator counts them as static: ``omnibal.sim.costs``)."""
    return zero3_gather_reserve(table, zero_stage=config.layout.zero_stage, dp_size=config.layout.dp_size)


def _check_static_memory(table, config, budget: float | None) -> None:
    """Fail before balancing when parameters, gradients and optimizer state alone cannot fit (the exact
    check, activations included, follows once the micro-batches are known)."""
    if budget is None:
        return
    lay = config.layout
    static = sum(zero_sharded_bytes(table, dp_size=lay.dp_size, zero_stage=lay.zero_stage))
    reserve = _gather_reserve(table, config)
    part = min_max_partition(static, lay.pp_size)
    if part.bottleneck + reserve > budget:
        worst = int(np.argmax(part.stage_costs))
        gathered = f" + {reserve / GiB:.2f} GiB of layers gathered by ZeRO-3" if reserve else ""
        raise InputError(
            f"parameters, gradients and optimizer state alone need at least {part.bottleneck / GiB:.2f} GiB"
            f"{gathered} on stage {worst} of the best split into {lay.pp_size} stages (ZeRO-{lay.zero_stage} "
            f"over DP {lay.dp_size}), more than the {budget / GiB:.2f} GiB budget; use more pipeline stages, tensor "
            f"parallelism, a higher ZeRO stage or a larger budget", source="--memory-budget", record=f"stage {worst}",
            field="memory_budget_gib")


def replace_padding(schedule, padding: str):
    """The schedule as it runs with ``padding`` (metrics read the schedule's own padding)."""
    if schedule.padding == padding:
        return schedule
    return replace(schedule, padding=padding)
