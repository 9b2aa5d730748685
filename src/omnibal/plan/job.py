"""``omnibal plan`` as a library call: model + cluster + data in, a :class:`Plan` and the ablation out.

Flow (each phase is a pure call into the layer that owns it):

1. model preset -> ``cost.analytic_cost_table`` (or a measured profile) on the hardware preset, per TP rank;
2. per-sample stats (a file, or the synthetic InternVL-like 1.2M mixture);
3. ``data.balance``: the baseline schedule (random fixed micro-batches of 4, padded to the longest sample)
   and omnibal's balanced schedule, both for DP x M micro-batch slots per step;
4. ``plan.joint``: the exact joint partition + recompute on the balanced schedule's micro-batches, then the
   simulator-scored neighbour search (``plan.search``);
5. ``sim``: every ablation row simulated over its whole epoch; the plan's prediction is its row.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from omnibal.errors import InputError
from omnibal.layout import (PLAN_PADDINGS, PLANNER_SCHEDULES, BalanceMethod, BaselinePartition, Engine, Layout,
                            check_choice, default_layout, holds_layout)
from omnibal.plan.ablation import AblationRow, with_speedups
from omnibal.plan.engines import constraint_rows
from omnibal.plan.joint import JointPlanner, StagePlanSet
from omnibal.plan.partition import check_num_stages, even_partition
from omnibal.plan.plan import DataPlan, Plan, PlanInputs, Prediction, plan_stages
from omnibal.plan.search import Candidate, SearchConfig, sample_steps, search
from omnibal.plan.stages import StageModelConfig, layer_quantities
from omnibal.sim.epoch import simulate_epoch

GiB = float(1 << 30)
BASELINE_PARTITIONS = tuple(BaselinePartition)


@holds_layout
@dataclass(frozen=True, kw_only=True)
class PlanJobConfig:
    """Everything ``omnibal plan`` needs. Defaults: the README's main job (see docs/plan.md for why)."""

    preset: str = "internvl-chat-1.5"
    """Model preset (``omnibal.cost.presets``)."""
    hf_model: str | None = None
    """Plan a local Hugging Face checkpoint (Llava / InternVL; only its ``config.json`` is read) instead of
    ``preset``: the plan then names the chain ``omnibal train --hf-model`` builds from that checkpoint."""
    hardware: str = "a100-80g"
    """Hardware preset (``omnibal.cost.hardware``)."""
    num_gpus: int | None = None
    """Devices in the job; None: dp_size * pp_size * tp_size. Must equal that product."""
    layout: Layout = default_layout(dp_size=32, pp_size=4, tp_size=1, zero_stage=1, num_microbatches=8)
    """DP x PP x TP, ZeRO stage and micro-batches per step per DP rank (default DP 32 x PP 4, ZeRO-1, 8
    micro-batches: 8 x 4 samples x DP 32 = global batch 1024). Its fields also read and construct flat:
    ``PlanJobConfig(pp_size=2).pp_size``."""
    baseline_batch_size: int = 4
    """Samples per micro-batch of the baseline (random, fixed size, padded to the longest sample)."""
    memory_budget_gib: float | None = None
    """Per-device budget in GiB; None: 95% of the device memory (the rest: CUDA context, NCCL buffers,
    allocator fragmentation)."""
    stats_path: str | None = None
    """Per-sample stats file; None: the synthetic InternVL-like mixture."""
    num_samples: int = 1_200_000
    """Size of the synthetic mixture."""
    balance_samples: int | None = 200_000
    """Balance a uniform random subset of this many samples and scale the epoch to the full dataset
    (None: balance every sample). The default keeps ``omnibal plan`` under 30 s on one core: balancing all
    1.2M samples alone takes ~28 s of CPU; a 200k subset predicts the epoch within ~1% (docs/plan.md)."""
    seed: int = 0
    """Seed of the synthetic data, the shuffles and the step sample of the search."""
    profile_path: str | None = None
    """Measured profile to use instead of the analytic cost model."""
    balance_method: str = "omnibal"
    """Balancer of the planned job."""
    padding: str = "varlen"
    """How balanced packs run: ``varlen`` (variable-length micro-batches, Megatron's variable_seq_lengths)
    or ``fixed_buffer`` (padded to the caps: static shapes, e.g. torch.distributed.pipelining)."""
    baseline_partition: str = "even"
    """The baseline's layer split: ``even`` (equal layer counts) or ``vision-first`` (the vision encoder
    and projector on stage 0, LLM layers split evenly over the rest, as torchtitan and Megatron VLMs do)."""
    schedule: str = "1f1b"
    """Pipeline schedule the simulator runs."""
    search: SearchConfig = field(default_factory=SearchConfig)
    """Neighbour search around the exact optimum."""
    engine: str = "omnibal"
    """Engine the plan is for (``omnibal.plan.engines``): its constraints are inputs to the planner, and the
    ablation gets one row per constraint (and one with all of them: the plan)."""

    def validate(self) -> None:
        from omnibal.plan.engines import check_job

        check_choice(self.engine, Engine, source="--engine", field="engine")
        check_choice(self.schedule, PLANNER_SCHEDULES, source="--schedule", field="schedule")
        check_job(self.engine, schedule=self.schedule, zero_stage=self.zero_stage)
        for name in ("baseline_batch_size", "num_samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"must be a positive integer, got {value!r}", source=f"--{name.replace('_', '-')}",
                                 field=name)
        self.layout.check_devices(self.num_gpus)
        if self.memory_budget_gib is not None and not self.memory_budget_gib > 0:
            raise InputError(f"must be positive, got {self.memory_budget_gib}", source="--memory-budget",
                             field="memory_budget_gib")
        check_choice(self.baseline_partition, BaselinePartition, source="--baseline-partition",
                     field="baseline_partition")
        check_choice(self.padding, PLAN_PADDINGS, source="--padding", field="padding")
        check_choice(self.balance_method, BalanceMethod, source="--balance-method", field="balance_method")
        if self.balance_samples is not None and self.balance_samples < self.dp_size * self.num_microbatches:
            raise InputError(f"needs at least dp_size x num_microbatches = {self.dp_size * self.num_microbatches} "
                             f"samples, got {self.balance_samples}", source="--balance-samples",
                             field="balance_samples")


@dataclass(frozen=True, eq=False)
class PlanJobResult:
    """What the job produced: the plan, the ablation and what is needed to draw them."""

    plan: Plan
    ablation: list[AblationRow]
    balance_metrics: dict
    """``{"baseline": {...}, "balanced": {...}}`` metrics of both schedules."""
    timings: dict
    """Seconds per phase."""
    table: object
    """The LayerCostTable used."""
    sim_config: object
    """The SimConfig used."""
    features: dict
    """``{"baseline": [S, D, M, 4], "balanced": [S, D, M, 4]}`` micro-batch features."""
    row_plans: dict
    """Row name -> (cut points, recompute mask)."""
    scored: list[Candidate]
    """The candidates the simulator scored for the final plan."""
    epoch_scale: float
    """Full dataset samples / balanced samples (1.0 unless ``balance_samples`` subsampled)."""
    row_step_times: dict
    """Row name -> ``[S]`` simulated step times of its epoch."""


class _Phases:
    """Progress over the job's phases (a tqdm bar on stderr; silent when disabled)."""

    def __init__(self, enabled: bool, weights: dict[str, float]) -> None:
        self.weights = weights
        self.timings: dict[str, float] = {}
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=round(sum(weights.values()), 3), desc="omnibal plan", unit="", leave=False,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}{postfix}")
        self._name, self._t0 = None, time.perf_counter()

    def start(self, name: str, label: str) -> None:
        self._finish()
        self._name, self._t0 = name, time.perf_counter()
        if self.bar is not None:
            self.bar.set_postfix_str(label)

    def _finish(self) -> None:
        if self._name is not None:
            self.timings[self._name] = round(time.perf_counter() - self._t0, 3)
            if self.bar is not None:
                self.bar.update(self.weights.get(self._name, 0))
            self._name = None

    def close(self) -> None:
        self._finish()
        if self.bar is not None:
            self.bar.close()


def _cost_table(config: PlanJobConfig, spec, hw):
    if config.profile_path is None:
        from omnibal.cost.analytic import analytic_cost_table

        # InternViT-6B's 25 heads do not divide by TP > 1: replicate the vision encoder in that case
        tp_vision = spec.vision.num_heads % config.tp_size == 0 and spec.vision.mlp_hidden % config.tp_size == 0
        return analytic_cost_table(spec, hw, tp_size=config.tp_size, tp_vision=tp_vision)
    from omnibal.cost.profile import cost_table_from_profile, load_profile

    profile = load_profile(config.profile_path, spec)
    return cost_table_from_profile(spec, profile, hardware=hw, tp_size=config.tp_size)


def _stats(config: PlanJobConfig):
    if config.stats_path is not None:
        from omnibal.stats.io import load_stats

        return load_stats(config.stats_path), str(config.stats_path)
    from omnibal.stats.synthetic import synthetic_internvl_mixture

    stats = synthetic_internvl_mixture(config.num_samples, config.seed)
    return stats, stats.source


def _check_static_memory(table, config: PlanJobConfig, budget: float | None) -> None:
    """Fail before balancing when parameters, gradients and optimizer state alone cannot fit (the exact
    check, activations included, follows once the micro-batches are known)."""
    if budget is None:
        return
    from omnibal.plan.partition import min_max_partition

    dp = config.dp_size
    static = (table.param_bytes + table.grad_bytes / (dp if config.zero_stage >= 2 else 1)
              + table.optim_bytes / (dp if config.zero_stage >= 1 else 1))
    part = min_max_partition(static, config.pp_size)
    if part.bottleneck > budget:
        worst = int(np.argmax(part.stage_costs))
        raise InputError(
            f"parameters, gradients and optimizer state alone need at least {part.bottleneck / GiB:.2f} GiB on "
            f"stage {worst} of the best split into {config.pp_size} stages (ZeRO-{config.zero_stage} over DP "
            f"{dp}), more than the {budget / GiB:.2f} GiB budget; use more pipeline stages, tensor parallelism, "
            f"a higher ZeRO stage or a larger budget", source="--memory-budget", record=f"stage {worst}",
            field="memory_budget_gib")


def vision_first_partition(kinds: tuple[str, ...], num_stages: int) -> tuple[int, ...]:
    """Vision encoder + projector on stage 0, the LLM layers split evenly (by count) over the others."""
    check_num_stages(num_stages, len(kinds))
    if num_stages == 1:
        return (0, len(kinds))
    first_llm = next((i for i, k in enumerate(kinds) if k.startswith("llm") or k == "lm_head"), len(kinds))
    rest = even_partition(len(kinds) - first_llm, num_stages - 1)
    return (0, *(first_llm + c for c in rest))


def run_plan_job(config: PlanJobConfig, *, progress: bool = False, stats=None,
                 cache: dict | None = None) -> PlanJobResult:
    """Run the whole job (see the module docstring).

    ``stats``: a ``SampleStats`` to use instead of ``config.stats_path`` / the synthetic mixture (its
    ``source`` is recorded). ``cache``: a dict kept between calls (benchmarks running several variants)
    that memoises the synthetic stats and the balanced schedules by their inputs.
    """
    config.validate()
    phases = _Phases(progress, {"model": 1, "stats": 2, "balance": 8, "plan": 3, "search": 3, "ablation": 5})
    try:
        phases.start("model", "cost model")
        model = _model_phase(config)
        phases.start("stats", "statistics")
        data = _stats_phase(config, stats, cache)
        phases.start("balance", "balancing (baseline and omnibal)")
        data = _balance_phase(config, model, data, cache)
        phases.start("plan", "joint partition + recompute")
        found = _plan_phase(config, model, data)
        phases.start("search", "simulator-scored search")
        found = _search_phase(config, model, data, found)
        phases.start("ablation", "simulating the ablation epochs")
        rows, row_plans, row_results, found = _ablation_phase(config, model, data, found)
    finally:
        phases.close()
    plan = _assemble_plan(config, model, data, found, rows[-1], row_results[rows[-1].name])
    return PlanJobResult(plan=plan, ablation=rows, balance_metrics=_jsonable(data.metrics), timings=phases.timings,
                         table=model.table, sim_config=model.sim_config, features=data.features,
                         row_plans=row_plans, scored=found.scored, epoch_scale=data.epoch_scale,
                         row_step_times={k: v.step_time for k, v in row_results.items()})


@dataclass(frozen=True, eq=False)
class _Model:
    """Phase 1: the model, the hardware and how the cluster runs it."""

    spec: object
    hw: object
    table: object
    sim_config: object
    budget: float | None
    stage_config: StageModelConfig


@dataclass(frozen=True, eq=False)
class _Data:
    """Phases 2-3: the statistics (subsampled), and both schedules' features and metrics."""

    stats: object
    stats_source: str
    full_samples: int
    epoch_scale: float
    bal_sched: object = None
    bal_config: object = None
    padding_bal: str = ""
    features: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class _Found:
    """Phases 4-6: the planner, its anchors, the searched plans and what the search scored."""

    planner: JointPlanner
    anchor_joint: StagePlanSet
    anchor_full: StagePlanSet
    score: object
    sample: object = None
    best_full: Candidate | None = None
    best_joint: Candidate | None = None
    scored: list = field(default_factory=list)
    num_enumerated: int = 0
    engine_info: dict = field(default_factory=dict)


def _model_phase(config: PlanJobConfig) -> _Model:
    from omnibal.cost.hardware import get_hardware
    from omnibal.cost.presets import get_model_preset
    from omnibal.sim.costs import config_for_hardware

    if config.hf_model is not None:
        from omnibal.cost.hf_spec import load_hf_spec

        spec = load_hf_spec(config.hf_model)
    else:
        spec = get_model_preset(config.preset)
    hw = get_hardware(config.hardware)
    table = _cost_table(config, spec, hw)
    check_num_stages(config.pp_size, table.num_layers)
    fraction = None if config.memory_budget_gib is not None else 0.95
    sim_config = config_for_hardware(hw, dp_size=config.dp_size, pp_size=config.pp_size, tp_size=config.tp_size,
                                     schedule=config.schedule, zero_stage=config.zero_stage,
                                     memory_fraction=fraction)
    if config.memory_budget_gib is not None:
        sim_config = replace(sim_config, memory_budget_bytes=config.memory_budget_gib * GiB)
    budget = sim_config.memory_budget_bytes
    _check_static_memory(table, config, budget)
    stage_config = StageModelConfig(num_stages=config.pp_size, num_microbatches=config.num_microbatches,
                                    dp_size=config.dp_size, zero_stage=config.zero_stage,
                                    memory_budget_bytes=budget, p2p_bandwidth=sim_config.p2p_bandwidth,
                                    p2p_latency=sim_config.p2p_latency, schedule=config.schedule)
    return _Model(spec=spec, hw=hw, table=table, sim_config=sim_config, budget=budget, stage_config=stage_config)


def _stats_phase(config: PlanJobConfig, stats, cache: dict | None) -> _Data:
    """The statistics (given, cached, read or synthetic) and the uniform subset that is balanced."""
    if stats is not None:
        stats_source = stats.source
    else:
        key = ("stats", config.stats_path, config.num_samples, config.seed)
        if cache is not None and key in cache:
            stats, stats_source = cache[key]
        else:
            stats, stats_source = _stats(config)
            if cache is not None:
                cache[key] = (stats, stats_source)
    full_samples = len(stats)
    if config.balance_samples is not None and config.balance_samples < full_samples:
        rows = np.sort(np.random.default_rng(config.seed).choice(full_samples, config.balance_samples,
                                                                 replace=False))
        stats = stats.take(rows)
    return _Data(stats=stats, stats_source=stats_source, full_samples=full_samples,
                 epoch_scale=full_samples / len(stats))


def _balance_phase(config: PlanJobConfig, model: _Model, data: _Data, cache: dict | None) -> _Data:
    """The baseline's and the planned balancer's schedules, their micro-batch features and metrics."""
    from omnibal.data.balance.api import BalanceConfig, balance
    from omnibal.data.balance.cost import BalanceCost
    from omnibal.data.metrics import schedule_metrics

    stats = data.stats
    cost = BalanceCost.from_cost_table(model.table, name=f"analytic:{model.spec.name}@{model.hw.name}")

    def balanced(bconfig):
        key = ("balance", stats.fingerprint(), config.dp_size, config.num_microbatches, config.seed,
               repr(bconfig.to_dict()))
        if cache is not None and key in cache:
            return cache[key]
        sched = balance(stats, dp_size=config.dp_size, num_microbatches=config.num_microbatches,
                        seed=config.seed, config=bconfig)
        if cache is not None:
            cache[key] = sched
        return sched

    base_sched = balanced(BalanceConfig(method="random", batch_size=config.baseline_batch_size, cost=cost))
    bal_config = BalanceConfig(method=config.balance_method, cost=cost)
    bal_sched = balanced(bal_config)
    padding_base = "pad_to_longest"
    padding_bal = config.padding if config.balance_method != "random" else "pad_to_longest"
    features = {"baseline": base_sched.features(stats, padding=padding_base),
                "balanced": bal_sched.features(stats, padding=padding_bal)}
    metrics = {"baseline": schedule_metrics(replace_padding(base_sched, padding_base), stats, cost),
               "balanced": schedule_metrics(replace_padding(bal_sched, padding_bal), stats, cost)}
    return replace(data, bal_sched=bal_sched, bal_config=bal_config, padding_bal=padding_bal, features=features,
                   metrics=metrics)


def _plan_phase(config: PlanJobConfig, model: _Model, data: _Data) -> _Found:
    """The exact joint partition + recompute (and the full-recompute one) on the balanced micro-batches."""
    from omnibal.sim.epoch import score_plan

    planner = JointPlanner(layer_quantities(model.table, data.features["balanced"], model.stage_config),
                           model.stage_config)
    sample = sample_steps(data.features["balanced"], config.search.sample_steps, config.search.seed)

    def score(sp: StagePlanSet) -> tuple[float, bool]:
        s = score_plan(model.table, sp.parts, sp.recompute_mask(model.table.num_layers), sample, model.sim_config)
        return s.step_time_mean, s.oom

    return _Found(planner=planner, anchor_joint=planner.plan(), anchor_full=planner.plan_fixed_recompute("full"),
                  score=score, sample=sample)


def _search_phase(config: PlanJobConfig, model: _Model, data: _Data, found: _Found) -> _Found:
    """The simulator-scored neighbour search around both anchors."""
    best_full, _, _ = search(found.planner, found.anchor_full, found.score, config.search, recompute="full")
    best_joint, scored, num_enumerated = search(found.planner, found.anchor_joint, found.score, config.search,
                                                recompute="adaptive")
    return replace(found, best_full=best_full, best_joint=best_joint, scored=scored, num_enumerated=num_enumerated)


def _ablation_phase(config: PlanJobConfig, model: _Model, data: _Data, found: _Found):
    """Every ablation row simulated over its whole epoch: (rows, row plans, row results, found), ``found``
    replaced by the engine's constrained plan where the engine has constraints."""
    table = model.table
    specs, found = _ablation_specs(config, model, data, found)
    data_desc = {"baseline": f"random, {config.baseline_batch_size} samples per micro-batch, padded to the longest",
                 "balanced": f"{config.balance_method} balanced packs ({data.padding_bal})"}
    rows, row_plans, row_results = [], {}, {}
    for name, data_key, part_desc, rec_desc, sp in specs:
        mask = sp.recompute_mask(table.num_layers)
        res = simulate_epoch(table, sp.parts, mask, data.features[data_key], model.sim_config)
        summary = res.summary()
        epoch_time = res.total_time * data.epoch_scale
        rows.append(AblationRow(
            name=name, data=data_desc[data_key], partition=part_desc, recompute=rec_desc, parts=sp.parts,
            num_checkpointed=int(mask.sum()), num_steps=int(round(len(res.step_time) * data.epoch_scale)),
            step_time_s=summary["step_time_mean_s"], epoch_time_s=epoch_time,
            gpu_days=epoch_time * res.num_gpus / 86400.0, bubble=summary["bubble_mean"],
            peak_memory_bytes=tuple(st["peak_memory_bytes"] for st in summary["stages"]),
            oom=bool(summary["oom_steps"])))
        row_plans[name] = (sp.parts, mask)
        row_results[name] = res
    return with_speedups(rows, model.spec.name), row_plans, row_results, found


def _ablation_specs(config: PlanJobConfig, model: _Model, data: _Data, found: _Found):
    """(name, data key, partition text, recompute text, plan) per ablation row, and ``found`` (the
    engine's constrained plan where it has constraints: the last row is the plan)."""
    table = model.table
    base_planner = JointPlanner(layer_quantities(table, data.features["baseline"], model.stage_config),
                                model.stage_config)
    if config.baseline_partition == "even":
        base_parts = even_partition(table.num_layers, config.pp_size)
    else:
        base_parts = vision_first_partition(table.kinds, config.pp_size)
    split_desc = "even layer count" if config.baseline_partition == "even" else "vision encoder on stage 0"
    specs = [
        ("baseline", "baseline", split_desc, "full", base_planner.evaluate(base_parts, "full")),
        ("+ data balance", "balanced", split_desc, "full", found.planner.evaluate(base_parts, "full")),
        ("+ balanced partition", "balanced", "exact min-max + search", "full", found.best_full.plan),
        ("+ adaptive recompute", "balanced", "joint min-max + search", "adaptive", found.best_joint.plan),
    ]
    if constraint_rows(config.engine):  # deepspeed and omnibal express every plan: no extra rows
        from omnibal.plan.engine_plan import engine_row_specs

        engine_specs, engine_final = engine_row_specs(config.engine, found.planner, found.score, config.search)
        specs += [(name, "balanced", part, rec, sp) for name, part, rec, sp in engine_specs]
        anchor_joint, best_joint, scored, num_enumerated, engine_info = engine_final
        found = replace(found, anchor_joint=anchor_joint, best_joint=best_joint, scored=scored,
                        num_enumerated=num_enumerated, engine_info=engine_info)
    return specs, found


def _assemble_plan(config: PlanJobConfig, model: _Model, data: _Data, found: _Found, final: AblationRow,
                   final_res) -> Plan:
    """The :class:`Plan`: its inputs, data plan, stages, prediction (the last ablation row) and search."""
    from omnibal import __version__

    table, stats, bal_sched = model.table, data.stats, data.bal_sched
    return Plan(
        inputs=PlanInputs(
            model=model.spec.name, model_spec=asdict(model.spec), hardware=model.hw.name,
            num_gpus=config.layout.num_gpus, dp_size=config.dp_size, pp_size=config.pp_size, tp_size=config.tp_size,
            zero_stage=config.zero_stage, num_microbatches=config.num_microbatches,
            memory_budget_bytes=model.budget, stats_source=data.stats_source, stats_fingerprint=stats.fingerprint(),
            num_samples=data.full_samples, profile=config.profile_path, omnibal_version=__version__),
        data=DataPlan(method=bal_sched.method, settings={"caps": bal_sched.caps.to_dict(), "padding": data.padding_bal,
                                                         "config": data.bal_config.to_dict(),
                                                         "balanced_samples": len(stats)},
                      num_steps=final.num_steps, metrics=_jsonable(data.metrics["balanced"])),
        stages=plan_stages(table.names, found.best_joint.plan, final_res.peak_memory.max(axis=(0, 1))),
        prediction=Prediction(step_time_s=final.step_time_s, epoch_time_s=final.epoch_time_s,
                              gpu_days=final.gpu_days, bubble=final.bubble, num_steps=final.num_steps,
                              oom=final.oom),
        engine=config.engine,
        search={"anchor_parts": list(found.anchor_joint.parts), "anchor_bottleneck_s": found.anchor_joint.bottleneck,
                "radius": config.search.radius, "enumerated": found.num_enumerated, "scored": len(found.scored),
                "sample_steps": int(len(found.sample)),
                "candidates": [{"parts": list(c.plan.parts), "model_step_time_s": c.model_step_time,
                                "sim_step_time_s": c.sim_step_time, "oom": c.oom} for c in found.scored],
                "chosen_parts": list(found.best_joint.plan.parts), "epoch_scale": data.epoch_scale,
                "schedule": config.schedule, "baseline_partition": config.baseline_partition,
                "sim_config": asdict(model.sim_config), **found.engine_info})


def replace_padding(schedule, padding: str):
    """The schedule as it runs with ``padding`` (metrics read the schedule's own padding)."""
    if schedule.padding == padding:
        return schedule
    return replace(schedule, padding=padding)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj
