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
from omnibal.plan.ablation import AblationRow, with_speedups
from omnibal.plan.engines import constraint_rows
from omnibal.plan.joint import JointPlanner, StagePlanSet
from omnibal.plan.packsize import PackSearchConfig, search_pack_size
from omnibal.plan.partition import check_num_stages, even_partition
from omnibal.plan.plan import DataPlan, Plan, PlanInputs, Prediction, plan_stages
from omnibal.plan.search import Candidate, SearchConfig, sample_steps, search
from omnibal.plan.stages import StageModelConfig, layer_quantities

GiB = float(1 << 30)
BASELINE_PARTITIONS = ("even", "vision-first")


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
    dp_size: int = 32
    """Data-parallel size."""
    pp_size: int = 4
    """Pipeline stages."""
    tp_size: int = 1
    """Tensor-parallel size."""
    zero_stage: int = 1
    """ZeRO stage over DP (1: optimizer state sharded)."""
    num_microbatches: int = 8
    """Micro-batches per step per DP rank (baseline: 8 x 4 samples x DP 32 = global batch 1024)."""
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
    baseline_partition: str = "vision-first"
    """The baseline's layer split: ``vision-first`` (the vision encoder and projector on stage 0, LLM layers
    split evenly over the rest, as Megatron-core's LLaVA and torchtitan do; the paper's baseline most
    likely, docs/plan.md) or ``even`` (equal layer counts)."""
    stack: str = "megatron-deepspeed"
    """Software stack whose weight/gradient/optimizer bytes the memory model counts (``omnibal.cost.stack``:
    ``megatron-deepspeed``, the paper's, ``fsdp`` or ``omnibal``)."""
    pack_search: PackSearchConfig = field(default_factory=lambda: PackSearchConfig(microbatches=()))
    """Pack sizes (micro-batches per step, samples per pack) searched with partition and recompute; the job's
    own ``num_microbatches`` is always a candidate. Off here (a library caller's M stays M); ``omnibal plan``
    turns it on (``--pack-microbatches``, default 8,12,16,24,32)."""
    schedule: str = "1f1b"
    """Pipeline schedule the simulator runs."""
    search: SearchConfig = field(default_factory=SearchConfig)
    """Neighbour search around the exact optimum."""
    convert_stats: bool = False
    """Convert statistics made in another image convention (InternVL tiles vs LLaVA single image) to the
    model's (``--convert-stats``); without it such statistics are an InputError naming both
    (``omnibal.sim.predict.model_stats``). The synthetic InternVL-like mixture is always converted."""
    engine: str = "omnibal"
    """Engine the plan is for (``omnibal.plan.engines``): its constraints are inputs to the planner, and the
    ablation gets one row per constraint (and one with all of them: the plan)."""

    def validate(self) -> None:
        from omnibal.plan.engines import check_job

        check_job(self.engine, schedule=self.schedule, zero_stage=self.zero_stage)
        for name in ("dp_size", "pp_size", "tp_size", "num_microbatches", "baseline_batch_size", "num_samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"must be a positive integer, got {value!r}", source=f"--{name.replace('_', '-')}",
                                 field=name)
        product = self.dp_size * self.pp_size * self.tp_size
        if self.num_gpus is not None and self.num_gpus != product:
            raise InputError(f"DP x PP x TP = {self.dp_size} x {self.pp_size} x {self.tp_size} = {product} does not "
                             f"match the {self.num_gpus} devices of the job; choose sizes whose product is "
                             f"{self.num_gpus}", source="--gpus", field="num_gpus")
        if self.memory_budget_gib is not None and not self.memory_budget_gib > 0:
            raise InputError(f"must be positive, got {self.memory_budget_gib}", source="--memory-budget",
                             field="memory_budget_gib")
        if self.baseline_partition not in BASELINE_PARTITIONS:
            raise InputError(f"unknown baseline partition {self.baseline_partition!r}; choose one of "
                             f"{', '.join(BASELINE_PARTITIONS)}", source="--baseline-partition",
                             field="baseline_partition")
        if self.padding not in ("varlen", "fixed_buffer"):
            raise InputError(f"must be varlen or fixed_buffer, got {self.padding!r}", source="--padding",
                             field="padding")
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
    balanced_schedule: object = None
    """The planned job's balanced ``Schedule`` (``omnibal plan --verify`` runs its first steps)."""
    stats: object = None
    """The ``SampleStats`` it balanced, in the model's units (the subset when ``balance_samples`` subsampled)."""


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


def _stats(config: PlanJobConfig, spec):
    """The statistics in the model's units (``omnibal.sim.predict.model_stats``, as ``omnibal simulate``)."""
    from omnibal.sim.predict import convention_label, model_stats

    if config.stats_path is not None:
        from omnibal.stats.io import load_stats

        raw = load_stats(config.stats_path)
        stats = model_stats(raw, spec, convert=config.convert_stats)
        return stats, str(config.stats_path), convention_label(raw, spec)
    from omnibal.stats.synthetic import synthetic_internvl_mixture

    raw = synthetic_internvl_mixture(config.num_samples, config.seed)
    stats = model_stats(raw, spec, convert=True)
    return stats, stats.source, convention_label(raw, spec)


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
    from omnibal import __version__
    from omnibal.cost.hardware import get_hardware
    from omnibal.cost.presets import get_model_preset
    from omnibal.data.balance.api import BalanceConfig, balance
    from omnibal.data.metrics import schedule_metrics
    from omnibal.sim.costs import config_for_hardware
    from omnibal.sim.epoch import score_plan, simulate_epoch
    from omnibal.sim.predict import balance_cost, convention_label, cost_table, model_stats

    config.validate()
    phases = _Phases(progress, {"model": 1, "stats": 2, "balance": 8, "plan": 3, "search": 3, "ablation": 5})
    try:
        phases.start("model", "cost model")
        if config.hf_model is not None:
            from omnibal.cost.hf_spec import load_hf_spec

            spec = load_hf_spec(config.hf_model)
        else:
            spec = get_model_preset(config.preset)
        hw = get_hardware(config.hardware)
        table = cost_table(spec, hw, profile_path=config.profile_path, tp_size=config.tp_size, stack=config.stack)
        check_num_stages(config.pp_size, table.num_layers)
        fraction = None if config.memory_budget_gib is not None else 0.95
        sim_config = config_for_hardware(hw, dp_size=config.dp_size, pp_size=config.pp_size, tp_size=config.tp_size,
                                         schedule=config.schedule, zero_stage=config.zero_stage,
                                         memory_fraction=fraction)
        if config.memory_budget_gib is not None:
            sim_config = replace(sim_config, memory_budget_bytes=config.memory_budget_gib * GiB)
        budget = sim_config.memory_budget_bytes
        _check_static_memory(table, config, budget)

        phases.start("stats", "statistics")
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
        if config.balance_samples is not None and config.balance_samples < full_samples:
            rows = np.sort(np.random.default_rng(config.seed).choice(full_samples, config.balance_samples,
                                                                     replace=False))
            stats = stats.take(rows)
        epoch_scale = full_samples / len(stats)

        phases.start("balance", "balancing (baseline and omnibal)")
        cost = balance_cost(table, spec, hw, config.profile_path)

        def balanced(bconfig, num_mb=config.num_microbatches):
            key = ("balance", stats.fingerprint(), config.dp_size, num_mb, config.seed, repr(bconfig.to_dict()))
            if cache is not None and key in cache:
                return cache[key]
            sched = balance(stats, dp_size=config.dp_size, num_microbatches=num_mb, seed=config.seed,
                            config=bconfig)
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

        phases.start("plan", "joint partition + recompute")
        stage_config = StageModelConfig(num_stages=config.pp_size, num_microbatches=config.num_microbatches,
                                        dp_size=config.dp_size, zero_stage=config.zero_stage,
                                        memory_budget_bytes=budget, p2p_bandwidth=sim_config.p2p_bandwidth,
                                        p2p_latency=sim_config.p2p_latency, schedule=config.schedule)
        q_bal = layer_quantities(table, features["balanced"], stage_config)
        planner = JointPlanner(q_bal, stage_config)
        anchor_joint = planner.plan()
        anchor_full = planner.plan_fixed_recompute("full")

        phases.start("search", "simulator-scored search")
        sample = sample_steps(features["balanced"], config.search.sample_steps, config.search.seed)

        def score(sp: StagePlanSet) -> tuple[float, bool]:
            s = score_plan(table, sp.parts, sp.recompute_mask(table.num_layers), sample, sim_config)
            return s.step_time_mean, s.oom

        best_full, _, _ = search(planner, anchor_full, score, config.search, recompute="full")
        best_joint, scored, num_enumerated = search(planner, anchor_joint, score, config.search, recompute="adaptive")
        best_full_joint, default_planner = best_joint, planner
        pack = _pack_row(config, stats, table, stage_config, sim_config, bal_config, full_samples, balanced,
                         padding_bal)
        if pack["row"] is not None:  # the plan runs the searched pack size
            features["packed"], planner, score = pack["features"], pack["planner"], pack["score"]
            anchor_joint, best_joint, scored, num_enumerated, bal_sched = pack["row"]
            metrics["packed"] = schedule_metrics(replace_padding(bal_sched, padding_bal), stats, cost)

        phases.start("ablation", "simulating the ablation epochs")
        q_base = layer_quantities(table, features["baseline"], stage_config)
        base_planner = JointPlanner(q_base, stage_config)
        if config.baseline_partition == "even":
            base_parts = even_partition(table.num_layers, config.pp_size)
        else:
            base_parts = vision_first_partition(table.kinds, config.pp_size)
        base_full = base_planner.evaluate(base_parts, "full")
        bal_even_full = default_planner.evaluate(base_parts, "full")
        data_desc = {"baseline": f"random, {config.baseline_batch_size} samples per micro-batch, padded to the longest",
                     "balanced": f"{config.balance_method} balanced packs ({padding_bal})"}
        split_desc = "even layer count" if config.baseline_partition == "even" else "vision encoder on stage 0"
        specs = [
            ("baseline", "baseline", split_desc, "full", base_full),
            ("+ data balance", "balanced", split_desc, "full", bal_even_full),
            ("+ balanced partition", "balanced", "exact min-max + search", "full", best_full.plan),
            ("+ adaptive recompute", "balanced", "joint min-max + search", "adaptive", best_full_joint.plan),
        ]
        if pack["row"] is not None:
            specs.append(("+ pack size", "packed", "joint min-max + search", "adaptive", best_joint.plan))
            data_desc["packed"] = pack["desc"]
        engine_info: dict = {}
        if constraint_rows(config.engine):  # deepspeed and omnibal express every plan: no extra rows
            from omnibal.plan.engine_plan import engine_row_specs

            engine_specs, engine_final = engine_row_specs(config.engine, planner, score, config.search)
            final_data = "packed" if pack["row"] is not None else "balanced"
            specs += [(name, final_data, part, rec, sp) for name, part, rec, sp in engine_specs]
            anchor_joint, best_joint, scored, num_enumerated, engine_info = engine_final
        rows, row_plans, row_results = [], {}, {}
        for name, data_key, part_desc, rec_desc, sp in specs:
            mask = sp.recompute_mask(table.num_layers)
            res = simulate_epoch(table, sp.parts, mask, features[data_key], sim_config)
            summary = res.summary()
            epoch_time = res.total_time * epoch_scale
            rows.append(AblationRow(
                name=name, data=data_desc[data_key], partition=part_desc, recompute=rec_desc, parts=sp.parts,
                num_checkpointed=int(mask.sum()), num_steps=int(round(len(res.step_time) * epoch_scale)),
                step_time_s=summary["step_time_mean_s"], epoch_time_s=epoch_time,
                gpu_days=epoch_time * res.num_gpus / 86400.0, bubble=summary["bubble_mean"],
                peak_memory_bytes=tuple(st["peak_memory_bytes"] for st in summary["stages"]),
                oom=bool(summary["oom_steps"])))
            row_plans[name] = (sp.parts, mask)
            row_results[name] = res
        rows = with_speedups(rows, spec.name)
    finally:
        phases.close()

    final = rows[-1]
    final_res = row_results[final.name]
    plan = Plan(
        inputs=PlanInputs(
            model=spec.name, model_spec=asdict(spec), hardware=hw.name,
            num_gpus=config.dp_size * config.pp_size * config.tp_size, dp_size=config.dp_size,
            pp_size=config.pp_size, tp_size=config.tp_size, zero_stage=config.zero_stage,
            num_microbatches=pack["num_microbatches"], memory_budget_bytes=budget, stats_source=stats_source,
            stats_fingerprint=stats.fingerprint(), num_samples=full_samples, profile=config.profile_path,
            omnibal_version=__version__, stats_convention=convention),
        data=DataPlan(method=bal_sched.method, settings={"caps": bal_sched.caps.to_dict(), "padding": padding_bal,
                                                         "config": pack.get("bal_config", bal_config).to_dict(),
                                                         "balanced_samples": len(stats),
                                                         "pack_search": pack["report"], "stack": config.stack},
                      num_steps=final.num_steps, metrics=_jsonable(metrics.pop("packed", metrics["balanced"]))),
        stages=plan_stages(table.names, best_joint.plan, final_res.peak_memory.max(axis=(0, 1))),
        prediction=Prediction(step_time_s=final.step_time_s, epoch_time_s=final.epoch_time_s,
                              gpu_days=final.gpu_days, bubble=final.bubble, num_steps=final.num_steps,
                              oom=final.oom),
        engine=config.engine,
        search={"anchor_parts": list(anchor_joint.parts), "anchor_bottleneck_s": anchor_joint.bottleneck,
                "radius": config.search.radius, "enumerated": num_enumerated, "scored": len(scored),
                "sample_steps": int(len(sample)),
                "candidates": [{"parts": list(c.plan.parts), "model_step_time_s": c.model_step_time,
                                "sim_step_time_s": c.sim_step_time, "oom": c.oom} for c in scored],
                "chosen_parts": list(best_joint.plan.parts), "epoch_scale": epoch_scale,
                "schedule": config.schedule, "baseline_partition": config.baseline_partition,
                "sim_config": asdict(sim_config), **engine_info})
    return PlanJobResult(plan=plan, ablation=rows, balance_metrics=_jsonable(metrics), timings=phases.timings,
                         table=table, sim_config=sim_config, features=features, row_plans=row_plans,
                         scored=scored, epoch_scale=epoch_scale,
                         row_step_times={k: v.step_time for k, v in row_results.items()},
                         balanced_schedule=bal_sched, stats=stats)


def _pack_row(config: PlanJobConfig, stats, table, stage_config, sim_config, bal_config, full_samples, balanced,
              padding) -> dict:
    """The pack-size search (``plan.packsize``) and, when it picks another pack than the job's, that pack's
    balanced schedule, joint plan and neighbour search: the ``+ pack size`` row and the plan."""
    from omnibal.sim.epoch import score_plan

    default_m, default_target = config.num_microbatches, bal_config.target_samples
    out = {"row": None, "num_microbatches": default_m, "report": None}
    if not config.pack_search.microbatches or config.balance_method != "omnibal":
        return out
    pack_config = replace(config.pack_search, microbatches=tuple(sorted({*config.pack_search.microbatches, default_m})))
    chosen, cands = search_pack_size(stats, table, stage_config, sim_config, balance_config=bal_config,
                                     samples_per_rank_step=default_m * default_target, config=pack_config,
                                     num_total_samples=full_samples, seed=config.seed, padding=padding,
                                     incumbent=default_m)
    out["report"] = {"candidates": [c.to_dict() for c in cands],
                     "chosen": None if chosen is None else chosen.to_dict()}
    if chosen is None or chosen.num_microbatches == default_m:
        return out
    m = chosen.num_microbatches
    out["bal_config"] = replace(bal_config, target_samples=chosen.target_samples)
    sched = balanced(out["bal_config"], m)
    feats = sched.features(stats, padding=padding)
    cfg = replace(stage_config, num_microbatches=m)
    planner = JointPlanner(layer_quantities(table, feats, cfg), cfg)
    psample = sample_steps(feats, config.search.sample_steps, config.search.seed)

    def pscore(sp: StagePlanSet) -> tuple[float, bool]:
        s = score_plan(table, sp.parts, sp.recompute_mask(table.num_layers), psample, sim_config)
        return s.step_time_mean, s.oom

    anchor = planner.plan()
    best, scored, enumerated = search(planner, anchor, pscore, config.search, recompute="adaptive")
    out.update(row=(anchor, best, scored, enumerated, sched), features=feats, planner=planner, score=pscore,
               num_microbatches=m,
               desc=f"{config.balance_method} balanced packs ({padding}), {m} micro-batches of "
                    f"~{chosen.target_samples:.2f} samples (searched)")
    return out


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
