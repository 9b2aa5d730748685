"""``omnibal plan`` as a library call: model + cluster + data in, a :class:`Plan` and the ablation out.

Flow (each phase is a pure call into the layer that owns it):

1. model preset -> ``cost.analytic_cost_table`` (or a measured profile) on the hardware preset, per TP rank;
2. per-sample stats (a file, or the synthetic InternVL-like 1.2M mixture);
3. ``data.balance``: the baseline schedule (fixed micro-batches of 4, length-grouped or random, padded to the
   longest sample)
   and omnibal's balanced schedule, both for DP x M micro-batch slots per step;
4. ``plan.joint``: the exact joint partition + recompute on the balanced schedule's micro-batches, then the
   simulator-scored neighbour search (``plan.search``);
5. ``sim``: every ablation row simulated over its whole epoch; the plan's prediction is its row.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from omnibal.jobs.plan_config import PlanJobConfig
from omnibal.jobs.plan_phases import (
    Data,
    Found,
    Model,
    ablation_phase,
    balance_phase,
    interleave_phase,
    model_phase,
    pack_phase,
    plan_phase,
    search_phase,
    stats_phase,
)
from omnibal.plan.ablation import AblationRow
from omnibal.plan.plan import DataPlan, Plan, PlanInputs, Prediction, plan_stages
from omnibal.plan.search import Candidate

if TYPE_CHECKING:
    from omnibal.cost.table import LayerCostTable
    from omnibal.data.balance.schedule import Schedule
    from omnibal.sim.costs import SimConfig
    from omnibal.stats.table import SampleStats


@dataclass(frozen=True, eq=False)
class PlanJobResult:
    """What the job produced: the plan, the ablation and what is needed to draw them."""

    plan: Plan
    ablation: list[AblationRow]
    balance_metrics: dict
    """``{"baseline": {...}, "balanced": {...}}``: metrics of the baseline's schedule and of the plan's (the
    pack the plan runs); when the pack-size search chose another pack, ``"balanced before pack search"`` (the
    job's own micro-batch count, the ``+ data balance`` .. ``+ adaptive recompute`` rows') sits between them."""
    timings: dict
    """Seconds per phase."""
    table: LayerCostTable
    """The cost table used."""
    sim_config: SimConfig
    """The simulator's config used."""
    features: dict
    """``{"baseline": [S, D, M, 4], "balanced": [S, D, M, 4]}`` micro-batch features, and ``"packed"`` when
    the pack-size search chose another pack (``row_data`` says which a row ran)."""
    row_plans: dict
    """Row name -> (cut points, recompute mask)."""
    scored: list[Candidate]
    """The candidates the simulator scored for the final plan."""
    epoch_scale: float
    """Full dataset samples / balanced samples (1.0 unless ``balance_samples`` subsampled)."""
    row_step_times: dict
    """Row name -> ``[S]`` simulated step times of its epoch."""
    balanced_schedule: Schedule | None = None
    """The planned job's balanced schedule (``omnibal plan --verify`` runs its first steps)."""
    stats: SampleStats | None = None
    """The statistics it balanced, in the model's units (the subset when ``balance_samples`` subsampled)."""
    row_data: dict = field(default_factory=dict)
    """Row name -> key of its micro-batch features in ``features``."""
    row_sim_configs: dict = field(default_factory=dict)
    """Row name -> the ``SimConfig`` its epoch ran with (the interleaved row's differs from the others')."""

    def row_sim_config(self, name: str):
        """The simulator config ablation row ``name`` ran with (default: the plan's)."""
        return self.row_sim_configs.get(name, self.sim_config)

    def row_features(self, name: str):
        """``[S, D, M, 4]`` micro-batch features ablation row ``name`` ran (its own pack and caps)."""
        return self.features[self.row_data[name]]

    @property
    def plan_features(self):
        """The micro-batch features of the plan's schedule (its last ablation row's)."""
        return self.row_features(self.ablation[-1].name)


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


def run_plan_job(config: PlanJobConfig, *, progress: bool = False, stats=None,
                 cache: dict | None = None) -> PlanJobResult:
    """Run the whole job (see the module docstring; one function per phase in ``omnibal.jobs.plan_phases``).

    ``stats``: a ``SampleStats`` to use instead of ``config.stats_path`` / the synthetic mixture (its
    ``source`` is recorded). ``cache``: a dict kept between calls (benchmarks running several variants)
    that memoises the synthetic stats and the balanced schedules by their inputs.
    """
    config.validate()
    phases = _Phases(progress, {"model": 1, "stats": 2, "balance": 8, "plan": 3, "search": 3, "interleave": 2,
                                "ablation": 5})
    try:
        phases.start("model", "cost model")
        model = model_phase(config)
        phases.start("stats", "statistics")
        data = stats_phase(config, model, stats, cache)
        phases.start("balance", "balancing (baseline and omnibal)")
        data = balance_phase(config, model, data, cache)
        phases.start("plan", "joint partition + recompute")
        found = plan_phase(config, model, data)
        phases.start("search", "simulator-scored search")
        found = search_phase(config, model, data, found)
        data, found = pack_phase(config, model, data, found, cache)
        phases.start("interleave", "interleaved 1F1B")
        found = interleave_phase(config, model, data, found)
        phases.start("ablation", "simulating the ablation epochs")
        rows, row_plans, row_results, row_data, found = ablation_phase(config, model, data, found)
    finally:
        phases.close()
    model = replace(model, sim_config=found.sim_config or model.sim_config)
    plan = _assemble_plan(config, model, data, found, rows[-1], row_results[rows[-1].name])
    return PlanJobResult(plan=plan, ablation=rows, balance_metrics=_jsonable(_balance_columns(data.metrics)),
                         timings=phases.timings, table=model.table, sim_config=model.sim_config,
                         features=data.features, row_plans=row_plans, scored=found.scored,
                         epoch_scale=data.epoch_scale, row_step_times={k: v.step_time for k, v in row_results.items()},
                         balanced_schedule=data.bal_sched, stats=data.stats, row_data=row_data,
                         row_sim_configs={k: v.config for k, v in row_results.items()})


def _balance_columns(metrics: dict) -> dict:
    """The Balance table's columns (``PlanJobResult.balance_metrics``): ``balanced`` is the plan's own schedule."""
    if "packed" not in metrics:
        return {"baseline": metrics["baseline"], "balanced": metrics["balanced"]}
    return {"baseline": metrics["baseline"], "balanced before pack search": metrics["balanced"],
            "balanced": metrics["packed"]}


def _assemble_plan(config: PlanJobConfig, model: Model, data: Data, found: Found, final: AblationRow,
                   final_res) -> Plan:
    """The :class:`Plan`: its inputs, data plan, stages, prediction (the last ablation row) and search."""
    from omnibal import __version__

    table, stats, bal_sched = model.table, data.stats, data.bal_sched
    return Plan(
        inputs=PlanInputs(
            model=model.spec.name, model_spec=asdict(model.spec), hardware=model.hw.name,
            layout=replace(config.layout, num_microbatches=data.num_microbatches),
            memory_budget_bytes=model.budget, stats_source=data.stats_source, stats_fingerprint=stats.fingerprint(),
            memory_headroom=None if config.memory_budget_gib is not None or model.budget is None
            else float(config.memory_headroom),
            num_samples=data.full_samples, profile=config.profile_path, omnibal_version=__version__,
            stats_convention=data.convention, num_chunks=found.num_chunks),
        data=DataPlan(method=bal_sched.method, settings={"caps": bal_sched.caps.to_dict(), "padding": data.padding_bal,
                                                         "config": data.bal_config.to_dict(),
                                                         "balanced_samples": len(stats),
                                                         "pack_search": data.pack_report, "stack": config.stack,
                                                         **_data_recipe(config, data)},
                      num_steps=final.num_steps, metrics=_jsonable(data.metrics[data.final_key])),
        stages=plan_stages(table.names, found.best_joint.plan,
                           np.tile(final_res.peak_memory.max(axis=(0, 1)), found.num_chunks)),
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
                "pp_schedule": model.sim_config.pp_schedule, "num_chunks": found.num_chunks,
                "interleaved": found.interleave_report, "baseline_partition": config.baseline_partition,
                "baseline_sampler": config.baseline_sampler,
                "baseline_padding": config.baseline_padding,
                "sim_config": asdict(model.sim_config), **found.engine_info})


def _data_recipe(config: PlanJobConfig, data: Data) -> dict:
    """What else ``omnibal simulate --plan`` needs to draw the plan's data again (``omnibal.jobs.simulate_plan``):
    the seed, where the statistics came from and whether they were converted."""
    return {"seed": config.seed, "synthetic_stats": data.synthetic,
            "stats_path": None if config.stats_path is None else str(config.stats_path),
            "convert_stats": bool(config.convert_stats)}


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
