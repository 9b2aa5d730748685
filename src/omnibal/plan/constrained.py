"""The exact plan under an engine's constraints (:mod:`omnibal.plan.engines`).

:class:`ConstrainedPlanner` wraps a :class:`~omnibal.plan.joint.JointPlanner` and answers the same calls
(``config``, ``evaluate``, ``plan``), so the simulator-scored neighbour search (``search.py``) runs unchanged
on constrained candidates.

* **Vision encoder on stage 0.** Stage 0's cost matrix is ``inf`` for every range that stops before the first
  LLM block; the min-max dynamic program then never puts a vision layer, the projector or the LLM embedding on
  another stage.
* **per-layer recompute**: the joint planner's per-stage knapsack, unchanged.
* **count** (Megatron): one policy ``(n_vision, n_llm)`` for the whole job: each stage checkpoints its first
  ``n_vision`` vision blocks and its first ``n_llm`` LLM blocks (``recompute_method="block"``). The planner
  enumerates every pair, builds the per-stage cost matrices of that policy (``inf`` where the stage does not
  fit its budget) and keeps the best min-max partition over all pairs: exact under the stage model.
* **all-or-none** (torchtitan): the same with the two policies "no block" and "every block".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from omnibal.errors import InputError
from omnibal.plan.engines import Constraints
from omnibal.plan.joint import JointPlanner, StagePlan, StagePlanSet
from omnibal.plan.partition import check_parts, min_max_partition_matrices, min_sum_partition_matrices
from omnibal.plan.recompute import fits
from omnibal.plan.search import model_step_time
from omnibal.plan.stages import stage_boundary_time, stage_memory

_CLASSES = ("vision_block", "llm_block")


@dataclass(frozen=True)
class _Class:
    """Prefix arrays of one checkpointable block kind along the chain."""

    pos: np.ndarray
    """``[L + 1]`` blocks of this kind before chain position ``i``."""
    index: np.ndarray
    """``[n]`` chain index of each block."""
    rec_prefix: np.ndarray
    sav_prefix: np.ndarray
    range_max: np.ndarray
    """``[n + 1, n + 1]`` largest saving among blocks ``[a, b)``."""

    @property
    def count(self) -> int:
        return len(self.index)


def _class_arrays(q, kind: str) -> _Class:
    member = np.array([k == kind for k in q.kinds], dtype=bool)
    index = np.flatnonzero(member)
    rec, sav = q.recompute_time[index], q.saving_bytes[index]
    n = len(index)
    range_max = np.zeros((n + 1, n + 1))
    for a in range(n):
        range_max[a, a + 1:] = np.maximum.accumulate(sav[a:])
    return _Class(pos=np.concatenate([[0], np.cumsum(member)]).astype(np.int64), index=index,
                  rec_prefix=np.concatenate([[0.0], np.cumsum(rec)]),
                  sav_prefix=np.concatenate([[0.0], np.cumsum(sav)]), range_max=range_max)


class ConstrainedPlanner:
    """JointPlanner-compatible planner under :class:`~omnibal.plan.engines.Constraints`."""

    def __init__(self, planner: JointPlanner, constraints: Constraints) -> None:
        self.base = planner
        self.q = planner.q
        self.config = planner.config
        self.constraints = constraints
        self.num_layers = planner.num_layers
        self.classes = tuple(_class_arrays(self.q, k) for k in _CLASSES)
        self.policy: tuple[int, int] | None = None
        """``(n_vision, n_llm)`` of the last :meth:`plan` (None for per-layer recompute)."""
        stop = constraints.first_stage_min_stop
        if stop is not None and self.num_layers - stop < self.config.num_stages - 1:
            raise InputError(f"stage 0 must hold the first {stop} layers (vision encoder, projector, LLM "
                             f"embedding), which leaves {self.num_layers - stop} layers for the other "
                             f"{self.config.num_stages - 1} stages; use fewer pipeline stages",
                             source="num_stages", field="pp_size")

    # ---- policies ------------------------------------------------------------------------------------
    def policies(self) -> list[tuple[int, int]]:
        nv, nl = (c.count for c in self.classes)
        if self.constraints.recompute == "all-or-none":
            return [(0, 0), (nv, nl)]
        return [(a, b) for b in range(nl + 1) for a in range(nv + 1)]

    def _allowed(self, parts: Sequence[int]) -> bool:
        stop = self.constraints.first_stage_min_stop
        return stop is None or parts[1] >= stop

    # ---- given cut points ----------------------------------------------------------------------------
    def evaluate(self, parts: Sequence[int], recompute: str = "adaptive") -> StagePlanSet | None:
        """Per-stage plans for ``parts`` under the constraints (None when they are violated or nothing fits).
        ``recompute`` other than ``adaptive`` (``full`` / ``none``) is passed through for per-layer engines."""
        parts = check_parts(parts, self.num_layers)
        if not self._allowed(parts):
            return None
        if self.constraints.recompute == "per-layer" or recompute != "adaptive":
            return self.base.evaluate(parts, recompute)
        grid = self._policy_grid(parts)
        if grid is None:
            return None
        return self.with_policy(parts, grid)

    def _policy_grid(self, parts) -> tuple[int, int] | None:
        """The policy with the smallest bottleneck (then 1F1B step estimate) for fixed cut points."""
        budget = self.config.memory_budget_bytes
        nv, nl = (np.arange(c.count + 1) for c in self.classes)
        nv, nl = nv[:, None], nl[None, :]
        times = []
        for s in range(len(parts) - 1):
            i, j, k = parts[s], parts[s + 1], self.base.in_flight[s]
            rec, sav, work = self._stage_terms(i, j, nv, nl)
            base = float(self.q.compute_time[i:j].sum()) + stage_boundary_time(self.q, i, j)
            mem = float(self.q.static_bytes[i:j].sum()) + k * (float(self.q.act_bytes[i:j].sum()) - sav) + work
            times.append(np.where(fits(mem, budget), base + rec, np.inf))
        t = np.stack(times)  # [P, nv + 1, nl + 1]
        allowed = np.zeros(t.shape[1:], dtype=bool)
        for a, b in self.policies():
            allowed[a, b] = True
        worst = np.where(allowed, t.max(axis=0), np.inf)
        if not np.isfinite(worst).any():
            return None
        step = (self.config.num_microbatches - 1) * worst + t.sum(axis=0)
        order = np.lexsort((step.ravel(), worst.ravel()))
        a, b = np.unravel_index(order[0], worst.shape)
        return int(a), int(b)

    def _stage_terms(self, i, j, nv, nl):
        """Recompute seconds, freed bytes and recompute working set of stages ``[i, j)`` when each checkpoints
        its first ``nv`` vision and ``nl`` LLM blocks (numpy broadcasting over all four arguments)."""
        out_rec, out_sav, out_work = 0.0, 0.0, 0.0
        for cls, n in zip(self.classes, (nv, nl)):
            a, stop = cls.pos[i], cls.pos[j]
            b = np.maximum(np.minimum(stop, a + n), a)
            out_rec = out_rec + cls.rec_prefix[b] - cls.rec_prefix[a]
            out_sav = out_sav + cls.sav_prefix[b] - cls.sav_prefix[a]
            out_work = np.maximum(out_work, cls.range_max[a, b])
        return out_rec, out_sav, out_work

    def with_policy(self, parts: Sequence[int], policy: tuple[int, int]) -> StagePlanSet | None:
        """The stages of ``parts`` when every stage checkpoints its first ``policy`` blocks of each kind."""
        stages = []
        for s in range(len(parts) - 1):
            i, j, k = parts[s], parts[s + 1], self.base.in_flight[s]
            ckpt = []
            for cls, n in zip(self.classes, policy):
                a, b = cls.pos[i], cls.pos[j]
                ckpt.extend(cls.index[a:min(b, a + n)].tolist())
            ckpt.sort()
            mask = np.zeros(j - i, dtype=bool)
            mask[[c - i for c in ckpt]] = True
            mem = stage_memory(self.q, i, j, k, mask)
            if not fits(mem, self.config.memory_budget_bytes):
                return None
            stages.append(StagePlan(stage=s, start=i, stop=j, in_flight=k,
                                    compute_time=float(self.q.compute_time[i:j].sum()),
                                    boundary_time=stage_boundary_time(self.q, i, j),
                                    recompute_time=float(self.q.recompute_time[ckpt].sum()), memory_bytes=mem,
                                    checkpointed=tuple(ckpt)))
        return StagePlanSet(parts=tuple(parts), stages=tuple(stages), recompute="adaptive")

    # ---- the constrained optimum ---------------------------------------------------------------------
    def _mask_first_stage(self, mat: np.ndarray) -> np.ndarray:
        stop = self.constraints.first_stage_min_stop
        if stop is not None:
            mat = mat.copy()
            mat[:, :stop] = np.inf
        return mat

    def plan(self) -> StagePlanSet:
        """The exact min-max plan under the constraints."""
        if self.constraints.recompute == "per-layer":
            return self._plan_per_layer()
        best, best_key = None, None
        for policy in self.policies():
            mats = self._policy_matrices(policy)
            if mats is None:
                continue
            try:
                part = _min_max_then_sum(mats)
            except InputError:
                continue
            sp = self.with_policy(part.parts, policy)
            if sp is None:
                continue
            key = (sp.bottleneck, model_step_time(sp, self.config.num_microbatches))
            if best_key is None or key < best_key:
                best, best_key, self.policy = sp, key, policy
        if best is None:
            raise self._infeasible()
        return best

    def _policy_matrices(self, policy: tuple[int, int]) -> list[np.ndarray] | None:
        n = np.arange(self.num_layers + 1)
        rec, sav, work = self._stage_terms(n[:, None], n[None, :], *policy)
        base = self.base.base_time
        static, act = self.base._static, self.base._act
        budget = self.config.memory_budget_bytes
        cache: dict[int, np.ndarray] = {}
        mats = []
        for s in range(self.config.num_stages):
            k = self.base.in_flight[s]
            if k not in cache:
                cache[k] = np.where(fits(static + k * (act - sav) + work, budget), base + rec, np.inf)
            mats.append(self._mask_first_stage(cache[k]) if s == 0 else cache[k])
        if not np.isfinite(mats[0][0]).any():
            return None
        return mats

    def _plan_per_layer(self) -> StagePlanSet:
        planner = self.base
        planner.check_budget()
        if self.constraints.first_stage_min_stop is None:
            return planner.plan()
        # a feasible constrained plan bounds the optimum from above, the unconstrained min-max without
        # recompute from below (see JointPlanner.time_matrix)
        upper = np.inf
        try:
            seed = min_max_partition_matrices([self._mask_first_stage(planner.base_time)]
                                              + [planner.base_time] * (self.config.num_stages - 1))
            cand = self.evaluate(seed.parts)
            upper = np.inf if cand is None else cand.bottleneck
        except InputError:
            pass
        lower = min_max_partition_matrices([planner.base_time] * self.config.num_stages).bottleneck
        cache: dict[int, np.ndarray] = {}
        mats = []
        for s in range(self.config.num_stages):
            k = planner.in_flight[s]
            if k not in cache:
                cache[k] = planner.time_matrix(s, upper * (1 + 1e-9), lower * (1 - 1e-9))
            mats.append(self._mask_first_stage(cache[k]) if s == 0 else cache[k])
        try:
            part = _min_max_then_sum(mats)
        except InputError:
            raise self._infeasible() from None
        result = self.evaluate(part.parts)
        if result is None:
            raise self._infeasible()
        return result

    def smallest_budget(self) -> float:
        """The smallest per-device budget any plan under the constraints fits (every allowed block
        checkpointed; per-layer recompute may also checkpoint the projector and head)."""
        stages = range(self.config.num_stages)
        if self.constraints.recompute == "per-layer":
            mats = [self.base.min_memory_matrix(s) for s in stages]
        else:
            n = np.arange(self.num_layers + 1)
            full = tuple(c.count for c in self.classes)
            _, sav, work = self._stage_terms(n[:, None], n[None, :], *full)
            mem = {k: self.base._static + k * (self.base._act - sav) + work for k in set(self.base.in_flight)}
            mats = [np.where(np.isfinite(self.base.base_time), mem[self.base.in_flight[s]], np.inf) for s in stages]
        mats[0] = self._mask_first_stage(mats[0])
        return min_max_partition_matrices(mats).bottleneck

    def _infeasible(self) -> InputError:
        budget = self.config.memory_budget_bytes
        what = []
        if self.constraints.first_stage_min_stop is not None:
            what.append(f"stage 0 holding the first {self.constraints.first_stage_min_stop} layers (vision "
                        "encoder, projector, LLM embedding)")
        if self.constraints.recompute != "per-layer":
            what.append({"count": "one recompute count of transformer blocks for all stages",
                         "all-or-none": "recompute of no block or every block"}[self.constraints.recompute])
        need = self.smallest_budget()
        gib = "no limit" if budget is None else f"{budget / 2**30:.2f} GiB"
        return InputError(f"no plan with {' and '.join(what)} fits the memory budget ({gib} per device); the "
                          f"smallest budget that fits is {need / 2**30:.2f} GiB (--memory-budget), or use more "
                          "pipeline stages or a higher ZeRO stage", source="memory_budget", field="memory_budget_bytes")


def _min_max_then_sum(mats):
    """The min-max partition; among its ties (a pinned stage 0 often sets the bottleneck alone, leaving the
    other stages free), the one with the smallest sum of stage times."""
    part = min_max_partition_matrices(mats)
    return min_sum_partition_matrices(mats, part.bottleneck * (1 + 1e-9))
