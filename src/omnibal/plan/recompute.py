"""Per-stage activation checkpointing: the least recompute time that makes a stage fit its memory budget.

Stage ``s`` holding layers ``[i, j)`` with ``k = min(P - s, M)`` micro-batches in flight needs (see
:func:`omnibal.plan.stages.stage_memory`)

    static + k * sum(act) - k * sum(saving of checkpointed layers) + max(saving of checkpointed layers)

bytes, and checkpointing a layer costs its forward again in the backward pass. Choosing the layers is a
covering knapsack: minimise the recompute time subject to the memory fitting the budget.

It is solved exactly by enumeration over **classes**: layers with identical (recompute time, saving) are
interchangeable (every block of one kind in the analytic model and in per-kind fitted profiles), so only
*how many* of each class to checkpoint matters. All classes but the largest are enumerated; for each
combination the count of the largest class follows in closed form (the smallest count that fits). A VLM
stage has at most a few classes (ViT block, LLM block and the single embed/projector/head layers), so
this is at most a few hundred combinations per stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from omnibal.errors import OmnibalError
from omnibal.plan.stages import LayerQuantities

MEMORY_RTOL = 1e-9
"""Relative slack when comparing memory with a budget (float rounding of byte sums)."""
MAX_COMBINATIONS = 2_000_000
"""Enumeration limit per stage; only reached by tables whose layers all differ (then the error says so)."""


def fits(memory: float | np.ndarray, budget: float | None) -> bool | np.ndarray:
    """Whether ``memory`` bytes fit ``budget`` (None: no limit), with :data:`MEMORY_RTOL` slack."""
    if budget is None:
        return np.ones_like(memory, dtype=bool) if isinstance(memory, np.ndarray) else True
    return memory <= budget * (1.0 + MEMORY_RTOL)


@dataclass(frozen=True)
class StageRecompute:
    """The checkpointing choice of one stage."""

    checkpointed: tuple[int, ...]
    """Global layer indices to checkpoint (ascending)."""
    recompute_time: float
    """Seconds per micro-batch spent recomputing them."""
    memory_bytes: float
    """Peak bytes of the stage with this choice."""


class RecomputeSolver:
    """Exact per-stage checkpoint selection for one :class:`LayerQuantities`.

    Layer classes are found once; :meth:`solve` then answers any stage range and in-flight count.
    """

    def __init__(self, q: LayerQuantities) -> None:
        self.q = q
        saving = q.saving_bytes
        eligible = saving > 0
        keys = np.stack([q.recompute_time, saving], axis=1)
        self.class_of = np.full(q.num_layers, -1, dtype=np.int64)
        if eligible.any():
            uniq, inverse = np.unique(keys[eligible], axis=0, return_inverse=True)
            self.class_of[eligible] = inverse.reshape(-1)
        else:
            uniq = np.zeros((0, 2))
        self.class_time = uniq[:, 0].copy()
        self.class_saving = uniq[:, 1].copy()
        num_classes = len(uniq)
        onehot = np.zeros((q.num_layers, num_classes))
        onehot[np.arange(q.num_layers)[eligible], self.class_of[eligible]] = 1.0
        self.count_prefix = np.concatenate([np.zeros((1, num_classes)), np.cumsum(onehot, axis=0)]).astype(np.int64)
        self.static_prefix = np.concatenate([[0.0], np.cumsum(q.static_bytes)])
        self.act_prefix = np.concatenate([[0.0], np.cumsum(q.act_bytes)])
        self.saving_prefix = np.concatenate([[0.0], np.cumsum(saving)])

    # ---- memory bounds -------------------------------------------------------------------------
    def memory_without_recompute(self, start: int, stop: int, in_flight: int) -> float:
        return float(self.static_prefix[stop] - self.static_prefix[start]
                     + in_flight * (self.act_prefix[stop] - self.act_prefix[start]))

    def min_memory(self, start: int, stop: int, in_flight: int) -> float:
        """Smallest peak the stage can reach: every layer with a saving checkpointed (optimal for k >= 1)."""
        counts = self.count_prefix[stop] - self.count_prefix[start]
        present = counts > 0
        working = float(self.class_saving[present].max()) if present.any() else 0.0
        return (self.memory_without_recompute(start, stop, in_flight)
                - in_flight * float(self.saving_prefix[stop] - self.saving_prefix[start]) + working)

    # ---- the knapsack ---------------------------------------------------------------------------
    def solve(self, start: int, stop: int, in_flight: int, budget: float | None, *,
              with_layers: bool = True, known_feasible: bool = False) -> StageRecompute | None:
        """Least-recompute checkpoint set for layers ``[start, stop)``; None when no choice fits.
        ``with_layers=False`` skips naming the layers (the joint search needs only the time)."""
        base = self.memory_without_recompute(start, stop, in_flight)
        if fits(base, budget):
            return StageRecompute(checkpointed=(), recompute_time=0.0, memory_bytes=base)
        if not known_feasible and not fits(self.min_memory(start, stop, in_flight), budget):
            return None
        counts = self.count_prefix[stop] - self.count_prefix[start]
        present = np.flatnonzero(counts > 0)
        free = present[np.argmax(counts[present])]
        others = present[present != free]
        sizes = counts[others] + 1
        num_combos = int(np.prod(sizes, dtype=np.float64)) if len(others) else 1
        if num_combos > MAX_COMBINATIONS:
            raise OmnibalError(f"stage [{start}, {stop}) has {len(present)} distinct layer classes: exact "
                               f"recompute search would enumerate {num_combos} combinations")
        grid = _count_grid(tuple(int(n) for n in sizes))
        k = float(in_flight)
        sav_o, time_o = self.class_saving[others], self.class_time[others]
        saved_o = grid @ sav_o
        time_sum_o = grid @ time_o
        work_o = np.max(np.where(grid > 0, sav_o[None, :], 0.0), axis=1, initial=0.0)
        deficit = base - budget  # bytes that must be freed (> 0 here)
        # c_f = 0
        mem0 = base - k * saved_o + work_o
        ok0 = fits(mem0, budget)
        # c_f >= 1: the smallest count that frees enough
        sav_f, time_f, n_f = self.class_saving[free], self.class_time[free], counts[free]
        work_f = np.maximum(work_o, sav_f)
        need = (deficit - k * saved_o + work_f) / (k * sav_f)
        c_f = np.maximum(1.0, np.ceil(need))
        lower = np.maximum(1.0, c_f - 1.0)  # guard against rounding up past an exact fit
        mem_lower = base - k * (saved_o + lower * sav_f) + work_f
        c_f = np.where(fits(mem_lower, budget), lower, c_f)
        mem1 = base - k * (saved_o + c_f * sav_f) + work_f
        ok1 = (c_f <= n_f) & fits(mem1, budget)
        cost = np.concatenate([np.where(ok0, time_sum_o, np.inf), np.where(ok1, time_sum_o + c_f * time_f, np.inf)])
        mem = np.concatenate([mem0, mem1])
        order = np.lexsort((mem, cost))
        best = int(order[0])
        assert np.isfinite(cost[best]), "min_memory said a choice fits"
        combo = best % len(grid)
        chosen = np.zeros(len(self.class_time), dtype=np.int64)
        chosen[others] = grid[combo]
        chosen[free] = 0 if best < len(grid) else int(c_f[combo])
        layers = self._first_layers(start, stop, chosen) if with_layers else ()
        return StageRecompute(checkpointed=layers, recompute_time=float(cost[best]), memory_bytes=float(mem[best]))

    def _first_layers(self, start: int, stop: int, chosen: np.ndarray) -> tuple[int, ...]:
        """The first ``chosen[c]`` layers of each class in the stage (interchangeable under the model;
        the first ones, like Megatron's ``block`` recompute granularity)."""
        out: list[int] = []
        cls = self.class_of[start:stop]
        for c in np.flatnonzero(chosen):
            out.extend((start + np.flatnonzero(cls == c)[: chosen[c]]).tolist())
        return tuple(sorted(out))


@functools.lru_cache(maxsize=4096)
def _count_grid(sizes: tuple[int, ...]) -> np.ndarray:
    """Every combination of counts ``0 .. sizes[c] - 1`` as rows of an int array (read-only, cached)."""
    if not sizes:
        grid = np.zeros((1, 0), dtype=np.int64)
    else:
        grid = np.stack(np.meshgrid(*[np.arange(n) for n in sizes], indexing="ij"), axis=-1).reshape(-1, len(sizes))
    grid.setflags(write=False)
    return grid


def full_recompute(q: LayerQuantities, start: int, stop: int) -> tuple[int, ...]:
    """Every layer of the stage that frees memory when checkpointed (Megatron's full/uniform recompute)."""
    return tuple(int(i) for i in np.flatnonzero(q.saving_bytes[start:stop] > 0) + start)
