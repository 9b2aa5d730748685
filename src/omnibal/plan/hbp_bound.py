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

**(b) Longest level (Amdahl).** A sample longer than the second-longest candidate length needs the longest
level in every level set, where it runs as in the single level (the same pack length and per-rank share,
so the same recompute and all-to-all). With ``f`` its share of the cost, only ``1 - f`` of the single
level's time can shrink, at most by (a): gain ``<= 1 / (f + (1 - f) / gain_a)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from omnibal.data.balance.api import BalanceConfig
from omnibal.data.hbp import HBPConfig, candidate_lengths
from omnibal.errors import InputError
from omnibal.plan.hbp import HBPContext, HBPPlanConfig, level_features
from omnibal.plan.joint import JointPlanner
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

    @property
    def hbp_gain(self) -> float:
        return self.single_gpu_days / self.hbp_gpu_days

    @property
    def gain_free(self) -> float:
        """(a): HBP's gain over the single level is at most this."""
        return self.single_gpu_days / self.free_gpu_days

    @property
    def gain_amdahl(self) -> float:
        """(b): at most this."""
        return 1.0 / (self.long_share + (1.0 - self.long_share) / self.gain_free)

    def to_dict(self) -> dict:
        return {"single_gpu_days": self.single_gpu_days, "hbp_gpu_days": self.hbp_gpu_days,
                "free_gpu_days": self.free_gpu_days, "free_trials": [[k, v] for k, v in self.free_trials],
                "long_length": self.long_length, "long_share": self.long_share, "hbp_gain": self.hbp_gain,
                "gain_bound_free": self.gain_free, "gain_bound_amdahl": self.gain_amdahl}

    def lines(self) -> list[str]:
        return [f"Bound on HBP's gain under this cost model (omnibal.plan.hbp_bound): (a) the single level with "
                f"recompute and all-to-all free takes {self.free_gpu_days:.1f} of its {self.single_gpu_days:.1f} "
                f"GPU days: gain <= {self.gain_free:.2f}x; (b) samples over {self.long_length:,} tokens need the "
                f"longest level and carry {self.long_share:.1%} of the cost: gain <= {self.gain_amdahl:.2f}x. "
                f"HBP: {self.hbp_gain:.2f}x."]


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
    """The bounds of ``result`` (an :class:`omnibal.plan.hbp.HBPPlanResult` of ``stats``)."""
    cands = candidate_lengths(np.asarray(stats.tokens), HBPConfig(candidate_lengths=hbp.candidate_lengths))
    trials = _free_trials(ctx, hbp, stats, result, cands[-1], cache)
    length, share = long_share(stats, result.model.cost, cands)
    return HBPBound(single_gpu_days=result.row("single level").gpu_days, hbp_gpu_days=result.row("hbp").gpu_days,
                    free_gpu_days=min(v for _, v in trials), free_trials=tuple(trials), long_length=length,
                    long_share=share)
