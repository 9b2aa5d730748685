"""Joint pipeline partition and per-stage recompute (the AdaPipe idea), exact under the stage model.

Moving a layer to another stage changes that stage's memory, and so the recompute its memory forces; and
the same layers cost more memory on an early stage (1F1B keeps ``min(P - s, M)`` micro-batches in flight
on stage ``s``) than on a late one. So the stage cost used by the partition's dynamic program is

    T_s(i, j) = compute(i, j) + p2p(i, j) + least recompute time that fits stage s's budget (inf if none)

and the min-max partition over these per-stage matrices is the exact joint optimum: the best partition
*and* the best checkpoint set per stage, found together, not one after the other.

Only the cells that can matter are solved with the knapsack: a feasible plan gives an upper bound ``U``
on the optimum, and a stage whose compute alone exceeds ``U`` can never be part of a better plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from omnibal.cost.table import RECOMPUTE_FULL, RECOMPUTE_SELECTIVE
from omnibal.errors import InputError
from omnibal.plan.partition import (
    check_num_stages,
    check_parts,
    even_partition,
    interval_cost_matrix,
    min_max_partition_matrices,
)
from omnibal.plan.recompute import RecomputeSolver, fits, full_recompute
from omnibal.plan.stages import LayerQuantities, StageModelConfig, stage_boundary_time, stage_memory


class RecomputeMode(StrEnum):
    """How a partition's checkpoints are chosen."""

    ADAPTIVE = "adaptive"
    """The least recompute that fits."""
    FULL = "full"
    """Checkpoint every layer."""
    NONE = "none"
    """Checkpoint nothing."""


@dataclass(frozen=True)
class StagePlan:
    """One stage of a plan under the stage model (times are seconds per micro-batch)."""

    stage: int
    start: int
    stop: int
    in_flight: int
    """Micro-batches whose activations the stage holds at its peak."""
    compute_time: float
    """Forward + backward of its layers."""
    boundary_time: float
    """Point-to-point transfers at its boundaries."""
    recompute_time: float
    """Forward recomputation of its checkpointed layers."""
    memory_bytes: float
    """Peak bytes with the chosen checkpoints."""
    checkpointed: tuple[int, ...]
    """Global indices of the layers recomputed whole."""
    selective: tuple[int, ...] = ()
    """Global indices of the layers under selective recompute."""

    @property
    def time(self) -> float:
        return self.compute_time + self.boundary_time + self.recompute_time


@dataclass(frozen=True)
class StagePlanSet:
    """A full partition with its per-stage recompute choice."""

    parts: tuple[int, ...]
    stages: tuple[StagePlan, ...]
    recompute: str
    """How the checkpoints were chosen (a :class:`RecomputeMode`)."""

    @property
    def bottleneck(self) -> float:
        return max(st.time for st in self.stages)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def recompute_mask(self, num_layers: int) -> np.ndarray:
        """``[L]`` recompute codes (:func:`omnibal.cost.table.recompute_codes`: full 1, selective 2)."""
        mask = np.zeros(num_layers, dtype=np.int8)
        for st in self.stages:
            mask[list(st.checkpointed)] = RECOMPUTE_FULL
            mask[list(st.selective)] = RECOMPUTE_SELECTIVE
        return mask

    def fits(self, budget: float | None) -> bool:
        return all(fits(st.memory_bytes, budget) for st in self.stages)


def _interval_sum(values: np.ndarray) -> np.ndarray:
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    return prefix[None, :] - prefix[:, None]


def _interval_max(values: np.ndarray) -> np.ndarray:
    num = len(values)
    out = np.zeros((num + 1, num + 1))
    for i in range(num):
        out[i, i + 1:] = np.maximum.accumulate(values[i:])
    return out


class JointPlanner:
    """Exact joint partition + recompute for one :class:`LayerQuantities` and :class:`StageModelConfig`."""

    def __init__(self, q: LayerQuantities, config: StageModelConfig) -> None:
        config.validate(q.num_layers)
        self.q, self.config = q, config
        self.solver = RecomputeSolver(q, selective=config.selective_recompute)
        self.num_layers = q.num_layers
        self.base_time = interval_cost_matrix(q.compute_time, q.boundary_time)
        self._static = _interval_sum(q.static_bytes)
        self._act = _interval_sum(q.act_bytes)
        self._saving = _interval_sum(q.saving_bytes)
        self._working = _interval_max(q.saving_bytes)
        self._full_recompute = _interval_sum(np.where(q.saving_bytes > 0, q.recompute_time, 0.0))
        self.in_flight = tuple(config.in_flight(s) for s in range(config.num_stages))
        self.num_solved = 0
        """Knapsacks solved exactly by the last :meth:`plan` (the rest were pruned)."""

    # ---- evaluation of given cut points ----------------------------------------------------------
    def stage_plan(self, stage: int, start: int, stop: int, recompute: str) -> StagePlan | None:
        """The stage with its checkpoints chosen by ``recompute``; None when adaptive finds nothing that fits."""
        k = self.in_flight[stage]
        q = self.q
        compute = float(q.compute_time[start:stop].sum())
        boundary = stage_boundary_time(q, start, stop)
        if recompute == "adaptive":
            choice = self.solver.solve(start, stop, k, self.config.stage_budget(stage))
            if choice is None:
                return None
            ckpt, sel, rtime, mem = choice.checkpointed, choice.selective, choice.recompute_time, choice.memory_bytes
        else:
            sel = ()
            ckpt = full_recompute(q, start, stop) if recompute == "full" else ()
            rtime = float(q.recompute_time[list(ckpt)].sum())
            mask = np.zeros(stop - start, dtype=bool)
            mask[[c - start for c in ckpt]] = True
            mem = stage_memory(q, start, stop, k, mask)
        return StagePlan(stage=stage, start=start, stop=stop, in_flight=k, compute_time=compute,
                         boundary_time=boundary, recompute_time=rtime, memory_bytes=mem, checkpointed=tuple(ckpt),
                         selective=tuple(sel))

    def evaluate(self, parts: Sequence[int], recompute: str = "adaptive") -> StagePlanSet | None:
        """Given cut points: per-stage plans (None when ``adaptive`` and some stage cannot fit)."""
        assert recompute in tuple(RecomputeMode), recompute
        parts = check_parts(parts, self.num_layers)
        if len(parts) - 1 != self.config.num_stages:
            raise InputError(f"{len(parts) - 1} stages in the cut points, config has {self.config.num_stages}",
                             source="parts", field="parts")
        stages = []
        for s in range(len(parts) - 1):
            st = self.stage_plan(s, parts[s], parts[s + 1], recompute)
            if st is None:
                return None
            stages.append(st)
        return StagePlanSet(parts=parts, stages=tuple(stages), recompute=recompute)

    # ---- memory feasibility --------------------------------------------------------------------
    def min_memory_matrix(self, stage: int) -> np.ndarray:
        k = self.in_flight[stage]
        out = self._static + k * (self._act - self._saving) + self._working
        out[~np.isfinite(self.base_time)] = np.inf
        return out

    def min_memory_partition(self):
        """The partition whose largest stage memory (every layer checkpointed) is smallest: decides whether
        any plan fits and, if not, the smallest budget that would (with budget shares: memory over each
        stage's share, so the bottleneck is the budget that fits, the shares kept)."""
        shares = self.config.budget_shares or (1.0,) * self.config.num_stages
        return min_max_partition_matrices([self.min_memory_matrix(s) / shares[s]
                                           for s in range(self.config.num_stages)])

    def check_budget(self) -> None:
        budget = self.config.memory_budget_bytes
        if budget is None:
            return
        part = self.min_memory_partition()
        if fits(part.bottleneck, budget):
            return
        worst = int(np.argmax(part.stage_costs))
        a, b = part.parts[worst], part.parts[worst + 1]
        raise InputError(
            f"no partition and recompute choice fits {budget / 2**30:.2f} GiB per device; the smallest budget "
            f"that fits is {part.bottleneck / 2**30:.2f} GiB ({part.bottleneck:.0f} bytes), set by stage {worst} "
            f"(layers {self.q.names[a]} .. {self.q.names[b - 1]}, {self.in_flight[worst]} micro-batches in "
            f"flight) with every layer checkpointed, in the partition {list(part.parts)}",
            source="memory_budget", record=f"stage {worst}", field="memory_budget_bytes")

    # ---- the joint optimum ---------------------------------------------------------------------
    def time_matrix(self, stage: int, upper_bound: float = np.inf, lower_bound: float = -np.inf) -> np.ndarray:
        """``T_s[i, j]``: stage time including the least recompute that fits (inf: cannot fit).

        Cells that cannot change the min-max optimum are not solved exactly: above ``upper_bound`` (a
        feasible plan's bottleneck) they are inf; where even full recompute stays within ``lower_bound``
        (a bound the optimum cannot beat) the full-recompute time stands in (it is at most the bound, so
        no partition's value, and hence neither the optimum's value nor its feasibility, changes)."""
        budget = self.config.stage_budget(stage)
        base = self.base_time.copy()
        if budget is None:
            return base
        k = self.in_flight[stage]
        no_recompute = fits(self._static + k * self._act, budget)
        possible = fits(self.min_memory_matrix(stage), budget)
        full_time = base + self._full_recompute
        out = np.where(no_recompute, base, np.where(possible & (full_time <= lower_bound), full_time, np.inf))
        todo = np.argwhere(~no_recompute & possible & (base <= upper_bound) & (full_time > lower_bound))
        self.num_solved += len(todo)
        for i, j in todo:
            choice = self.solver.solve(int(i), int(j), k, budget, with_layers=False, known_feasible=True)
            assert choice is not None
            out[i, j] = base[i, j] + choice.recompute_time
        out[~np.isfinite(base)] = np.inf
        return out

    def plan(self) -> StagePlanSet:
        """The exact joint optimum: min over partitions of the largest stage time with adaptive recompute."""
        self.check_budget()
        upper = np.inf
        seeds = [self.min_memory_partition().parts, even_partition(self.num_layers, self.config.num_stages),
                 min_max_partition_matrices([self.base_time] * self.config.num_stages).parts]
        for parts in seeds:
            cand = self.evaluate(parts, "adaptive")
            if cand is not None:
                upper = min(upper, cand.bottleneck)
        assert np.isfinite(upper), "the min-memory partition fits, so adaptive recompute finds a plan"
        # recompute only adds time, so the optimum is at least the min-max without it
        lower = min_max_partition_matrices([self.base_time] * self.config.num_stages).bottleneck
        self.num_solved = 0
        cache: dict[tuple, np.ndarray] = {}
        mats = []
        for s in range(self.config.num_stages):
            key = (self.in_flight[s], self.config.stage_budget(s))
            if key not in cache:
                cache[key] = self.time_matrix(s, upper * (1 + 1e-9), lower * (1 - 1e-9))
            mats.append(cache[key])
        part = min_max_partition_matrices(mats)
        result = self.evaluate(part.parts, "adaptive")
        assert result is not None
        assert np.isclose(result.bottleneck, part.bottleneck, rtol=1e-9), (result.bottleneck, part.bottleneck)
        return result

    def plan_fixed_recompute(self, recompute: str) -> StagePlanSet:
        """Min-max partition when every stage uses the same recompute policy (``full`` or ``none``): the
        "balanced partition" step of the ablation, before memory is adapted. Memory is not constrained here;
        check ``fits`` on the result."""
        assert recompute in ("full", "none")
        per_layer = self.q.compute_time + (np.where(self.q.saving_bytes > 0, self.q.recompute_time, 0.0)
                                           if recompute == "full" else 0.0)
        mat = interval_cost_matrix(per_layer, self.q.boundary_time)
        part = min_max_partition_matrices([mat] * self.config.num_stages)
        result = self.evaluate(part.parts, recompute)
        assert result is not None
        return result


def plan_joint(q: LayerQuantities, config: StageModelConfig) -> StagePlanSet:
    """Convenience: the exact joint optimum (see :class:`JointPlanner`)."""
    check_num_stages(config.num_stages, q.num_layers)
    return JointPlanner(q, config).plan()
