"""How much HBP can gain over the single level at most, under omnibal's cost model.

In this cost model a sample costs the same whatever it is packed with (its vision + LLM cost, attention over
its own sequence) and SP splits a pack's work exactly (a rank of a group of ``d`` runs ``1/d`` of it). So the
levels of HBP do not change the work of a sample; what they can change is

1. the recompute that memory forces (a short level's rank holds fewer tokens),
2. the Ulysses all-to-all (a short level needs a smaller SP degree),
3. how steps are filled (balance, pipeline bubbles, the per-step costs of the number of steps).

**(a) Free single level.** The single level's time with (1) and (2) made free: its own packing, and the
longest level's packing at every SP degree dividing dp_size, each simulated with no recompute, no all-to-all
and no memory limit (on the min-max partition without recompute, or the single level's own, whichever is
faster); the least of them. HBP pays at least the work and the step filling of one of these, so its gain over
the single level is at most ``single / free``. It is a bound under the model only in as far as HBP's levels
fill their steps no better than a single level does (3): the check is that every HBP result so far lies
under it (tests/test_hbp_short.py).

**(c) Work floor.** With a micro-batch count per level (``HBPConfig.microbatches == "tokens"``) a short
level's steps hold more micro-batches, so they pay the pipeline fill and drain and the gradient sync less
often than the single level does: (3) changes and (a) is no bound. What no packing changes is the work: the
forward and backward of every sample (without the per-micro-batch fixed term) on the min-max partition of
that total work, every device of a stage equally loaded, with no pipeline idle, gradient sync, recompute or
all-to-all. Every level set takes at least that time, so the gain is at most ``single / floor``.

**(b) Longest level (Amdahl).** A sample longer than the second-longest candidate length needs the longest
level in every level set, where it runs as in the single level (the same pack length, per-rank share and
micro-batch count, so the same recompute and all-to-all). With ``f`` its share of the cost, only ``1 - f``
of the single level's time can shrink, at most by the bound that holds for the level set's micro-batch
counts ((a) when every level has the job's count, else (c)): gain ``<= 1 / (f + (1 - f) / gain)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from omnibal.data.balance.api import BalanceConfig
from omnibal.errors import InputError
from omnibal.hbp.levels import HBPConfig, candidate_lengths
from omnibal.hbp.planning import HBPContext, HBPPlanConfig, level_a2a, level_features, level_recompute_mask
from omnibal.hbp.sp_cost import sp_table
from omnibal.plan.joint import JointPlanner
from omnibal.plan.partition import min_max_partition
from omnibal.plan.stages import layer_quantities
from omnibal.sim.epoch import SECONDS_PER_DAY, simulate_epoch


@dataclass(frozen=True, kw_only=True)
class HBPBound:
    """The bounds (module docstring) next to the result they bound."""

    single_gpu_days: float
    """The single-level row."""
    hbp_gpu_days: float
    """The hbp row."""
    free_gpu_days: float
    """(a): the least of ``free_trials``."""
    free_trials: tuple[tuple[str, float], ...]
    """``(packing, GPU days)`` of every free single level simulated."""
    long_length: int
    """Samples over this many tokens need the longest level in every level set."""
    long_share: float
    """``f``: their share of the balancer's cost."""
    floor_gpu_days: float = 0.0
    """(c): the work floor (:func:`work_floor_gpu_days`)."""
    same_microbatches: bool = True
    """Whether every level runs the job's micro-batch count (then (a) holds; else only (c))."""

    @property
    def hbp_gain(self) -> float:
        return self.single_gpu_days / self.hbp_gpu_days

    @property
    def gain_free(self) -> float:
        """(a): HBP's gain over the single level is at most this."""
        return self.single_gpu_days / self.free_gpu_days

    @property
    def gain_floor(self) -> float:
        """(c): HBP's gain over the single level is at most this, whatever the micro-batch counts."""
        return self.single_gpu_days / self.floor_gpu_days

    @property
    def gain_limit(self) -> float:
        """The bound that holds for the plan's micro-batch counts: (a) with one count, else (c)."""
        return self.gain_free if self.same_microbatches else self.gain_floor

    @property
    def gain_amdahl(self) -> float:
        """(b): at most this."""
        return 1.0 / (self.long_share + (1.0 - self.long_share) / self.gain_limit)

    def to_dict(self) -> dict:
        return {"single_gpu_days": self.single_gpu_days, "hbp_gpu_days": self.hbp_gpu_days,
                "free_gpu_days": self.free_gpu_days, "free_trials": [[k, v] for k, v in self.free_trials],
                "long_length": self.long_length, "long_share": self.long_share, "hbp_gain": self.hbp_gain,
                "floor_gpu_days": self.floor_gpu_days, "same_microbatches": self.same_microbatches,
                "gain_bound_free": self.gain_free, "gain_bound_floor": self.gain_floor,
                "gain_bound_amdahl": self.gain_amdahl}

    def lines(self) -> list[str]:
        free = (f"(a) the single level with recompute and all-to-all free takes {self.free_gpu_days:.1f} of its "
                f"{self.single_gpu_days:.1f} GPU days: gain <= {self.gain_free:.2f}x"
                + ("" if self.same_microbatches else " with one micro-batch count for every level"))
        floor = (f"(c) the work alone (no pipeline idle, sync, recompute or all-to-all) takes "
                 f"{self.floor_gpu_days:.1f}: gain <= {self.gain_floor:.2f}x")
        return [f"Bound on HBP's gain under this cost model (omnibal.hbp.bound): {free}; {floor}; (b) samples "
                f"over {self.long_length:,} tokens need the longest level and carry {self.long_share:.1%} of the "
                f"cost: gain <= {self.gain_amdahl:.2f}x. HBP: {self.hbp_gain:.2f}x."]


def free_gpu_days(ctx: HBPContext, level_feats, parts=None) -> float:
    """GPU days of levels run with no recompute, no all-to-all and no memory limit, each level on the
    faster of the min-max partition without recompute and ``parts``."""
    stage_config = replace(ctx.stage_config, memory_budget_bytes=None)
    sim_config = replace(ctx.sim_config, memory_budget_bytes=None)
    none = np.zeros(ctx.table.num_layers, bool)
    total = 0.0
    for _, feats, _ in level_feats:
        planner = JointPlanner(layer_quantities(ctx.table, feats, stage_config), stage_config)
        options = {tuple(planner.plan_fixed_recompute("none").parts), *([tuple(parts)] if parts else [])}
        total += min(simulate_epoch(ctx.table, p, none, feats, sim_config).total_time for p in options)
    return total * ctx.epoch_scale * ctx.num_gpus / SECONDS_PER_DAY


def work_floor_gpu_days(ctx: HBPContext, level_feats) -> float:
    """(c): GPU days of the levels' forward + backward work (tensor-parallel collectives included, the
    per-micro-batch fixed term not), on the min-max partition of that work (interleaved chunks: spread evenly
    over the pipeline devices), every DP rank equally loaded."""
    total = sum(np.asarray(f, np.float64).reshape(-1, 4).sum(axis=0) for _, f, _ in level_feats)
    total = np.array(total, np.float64)
    total[0] = 0.0  # more, shorter micro-batches pay more fixed terms: leave them out of a floor
    work = ctx.table.evaluate("fwd_time", total) + ctx.table.evaluate("bwd_time", total)
    if ctx.table.tp_comm_time is not None:
        work = work + ctx.table.evaluate("tp_comm_time", total)
    stages = ctx.stage_config.num_stages
    if ctx.sim_config.num_chunks == 1:
        per_stage = max(min_max_partition(work, stages).stage_costs)
    else:
        per_stage = float(work.sum()) / stages
    return per_stage / ctx.dp_size * ctx.epoch_scale * ctx.num_gpus / SECONDS_PER_DAY


def _free_trials(ctx: HBPContext, hbp: HBPPlanConfig, stats, result, top: int, cache) -> list[tuple[str, float]]:
    """The single level's own packing and the longest level (``top`` tokens) at every SP degree dividing
    dp_size, run free."""
    single = result.single
    out = [(f"single level ({', '.join(f'{lv.length:,} x SP {lv.sp}' for lv in single.row.levels)})",
            free_gpu_days(ctx, single.level_feats, single.row.parts))]
    # every degree, memory ignored: a degree memory rules out still bounds what the others can do
    model = replace(result.model, max_tokens_per_rank=1 << 62)
    config = HBPConfig(model=model, pack_lengths=(top,), oversize=hbp.oversize, balance=BalanceConfig(cost=model.cost))
    for d in model.sp_degrees:
        try:
            sched = ctx.balance(stats, replace(config, level_sp=(d,)), cache)
        except InputError:  # too few samples to fill a step at this degree
            continue
        out.append((f"{top:,} x SP {d}", free_gpu_days(ctx, level_features(sched, stats))))
    return out


def long_share(stats, cost, candidates) -> tuple[int, float]:
    """(length, share): samples longer than the second-longest candidate need the longest level; their share
    of the balancer's cost (1.0 with a single candidate)."""
    if len(candidates) < 2:
        return 0, 1.0
    vision, llm = cost.sample_costs(stats.tiles, stats.tokens)
    costs = vision + llm
    length = int(candidates[-2])
    return length, float(costs[np.asarray(stats.tokens) > length].sum() / costs.sum())


def hbp_bound(ctx: HBPContext, hbp: HBPPlanConfig, stats, result, *, cache: dict | None = None) -> HBPBound:
    """The bounds of ``result`` (an :class:`omnibal.hbp.planning.HBPPlanResult` of ``stats``)."""
    cands = candidate_lengths(np.asarray(stats.tokens), HBPConfig(candidate_lengths=hbp.candidate_lengths))
    trials = _free_trials(ctx, hbp, stats, result, cands[-1], cache)
    length, share = long_share(stats, result.model.cost, cands)
    return HBPBound(single_gpu_days=result.row("single level").gpu_days, hbp_gpu_days=result.row("hbp").gpu_days,
                    free_gpu_days=min(v for _, v in trials), free_trials=tuple(trials), long_length=length,
                    long_share=share, floor_gpu_days=work_floor_gpu_days(ctx, result.single.level_feats),
                    same_microbatches=hbp.microbatches == "same")


BREAKDOWN_PARTS = ("work", "recompute", "a2a", "pipeline_idle", "dp_imbalance", "grad_sync")
"""Where a level's time goes (:func:`time_breakdown`), seconds per device of the scaled epoch."""


def time_breakdown(ctx: HBPContext, hbp: HBPPlanConfig, row, schedule, stats) -> list[dict]:
    """Per level of ``row`` (an ``HBPRow`` simulated from ``schedule``): its simulated time split per device
    into :data:`BREAKDOWN_PARTS` (work includes the per-micro-batch fixed term; recompute is the busy time the
    level's checkpoints add; pipeline idle is fill/drain and stage imbalance; DP imbalance the wait for the
    slowest DP rank; the gradient sync one all-reduce per step). The parts add up to the level's time."""
    out = []
    for lv, (d, feats, _) in zip(row.levels, level_features(schedule, stats)):
        a2a = level_a2a(ctx, hbp, d)
        table = sp_table(ctx.table, a2a)
        mask = level_recompute_mask(ctx, table, feats, row.parts)
        res = simulate_epoch(table, row.parts, mask, feats, ctx.sim_config)
        bare = simulate_epoch(table, row.parts, np.zeros_like(mask), feats, replace(ctx.sim_config,
                                                                                    memory_budget_bytes=None))
        devices = res.busy.shape[1] * res.busy.shape[2]
        busy, recompute = res.busy.sum() / devices, (res.busy.sum() - bare.busy.sum()) / devices
        comm = float(feats.reshape(-1, feats.shape[-1]).sum(axis=0) @ a2a.sum(axis=0)) / devices
        sync = float(res.allreduce_time.max()) * len(feats)
        wait = float(res.sync_wait.sum()) / devices
        parts = {"work": busy - recompute - comm, "recompute": recompute, "a2a": comm,
                 "pipeline_idle": res.total_time - busy - sync - wait, "dp_imbalance": wait, "grad_sync": sync}
        out.append({"length": lv.length, "sp": lv.sp, "microbatches": lv.microbatches, "steps": lv.steps,
                    "time_s": res.total_time * ctx.epoch_scale,
                    **{k: float(v) * ctx.epoch_scale for k, v in parts.items()}})
    return out
