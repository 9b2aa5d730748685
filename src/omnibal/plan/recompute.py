"""Per-stage activation recompute: the least recompute time that makes a stage fit its memory budget.

Stage ``s`` holding layers ``[i, j)`` with ``k = min(P - s, M)`` micro-batches in flight needs (see
:func:`omnibal.plan.stages.stage_memory`)

    static + k * sum(act) - k * sum(saving of recomputed layers) + max(saving of recomputed layers)

bytes. Each layer may run without recompute, with full recompute (it keeps its input; its forward runs again
in the backward) or, for transformer blocks, with selective recompute (it keeps its input and its matrix
products' and attention's outputs; the element-wise ops run again: most of the saving for a few percent of
the time; :mod:`omnibal.train.recompute`). Choosing is a covering knapsack with two options per item:
minimise the recompute time subject to the memory fitting the budget.

It is solved exactly over **classes**: layers with identical (time, saving) for both options are
interchangeable (every block of one kind in the analytic model and in per-kind fitted profiles), so only
*how many* of each class take each option matters. The Pareto front of a class's (selective, full) counts
is small (a count trades against the other only near the class size), and the fronts of a stage's classes
combine into the front of the stage. Ordered by the bytes a choice frees (``k`` times its saving less its
transient), the cheapest choice that frees enough is one binary search; the combined front depends on the
class counts and ``k`` only, so it is built once for all stages of one composition.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal.plan.stages import LayerQuantities

MEMORY_RTOL = 1e-9
"""Relative slack when comparing memory with a budget (float rounding of byte sums)."""


def fits(memory: float | np.ndarray, budget: float | None) -> bool | np.ndarray:
    """Whether ``memory`` bytes fit ``budget`` (None: no limit), with :data:`MEMORY_RTOL` slack."""
    if budget is None:
        return np.ones_like(memory, dtype=bool) if isinstance(memory, np.ndarray) else True
    return memory <= budget * (1.0 + MEMORY_RTOL)


@dataclass(frozen=True)
class StageRecompute:
    """The recompute choice of one stage."""

    checkpointed: tuple[int, ...]
    """Global layer indices recomputed whole (ascending)."""
    recompute_time: float
    """Seconds per micro-batch spent recomputing."""
    memory_bytes: float
    """Peak bytes of the stage with this choice."""
    selective: tuple[int, ...] = ()
    """Global layer indices under selective recompute (ascending)."""


@dataclass(frozen=True)
class _Frontier:
    """Pareto-optimal ways to recompute some layers: per point the transient bytes (what recomputing one layer
    brings back), the bytes freed per in-flight micro-batch, the seconds added, and the counts chosen (per
    class: selective, full). Within one transient value the points have ascending saving and time."""

    trans: np.ndarray
    save: np.ndarray
    time: np.ndarray
    counts: np.ndarray
    """``[P, 2 * num_classes]`` (selective, full) counts per class."""

    @staticmethod
    def nothing(num_classes: int) -> _Frontier:
        return _Frontier(np.zeros(1), np.zeros(1), np.zeros(1), np.zeros((1, 2 * num_classes), np.int64))

    def pruned(self) -> _Frontier:
        """Drop every point another point of the same transient beats (at least its saving, less time)."""
        order = np.lexsort((self.time, -self.save, self.trans))
        trans, time = self.trans[order], self.time[order]
        keep = np.zeros(len(order), bool)
        for t in np.unique(trans):
            idx = np.flatnonzero(trans == t)
            best = np.minimum.accumulate(time[idx])
            keep[idx] = time[idx] < np.concatenate([[np.inf], best[:-1]])
        order = order[keep][np.lexsort((self.save[order[keep]], self.trans[order[keep]]))]
        return _Frontier(self.trans[order], self.save[order], self.time[order], self.counts[order])

    def plus(self, other: _Frontier) -> _Frontier:
        """Every combination of one point of each (transients combine by max), pruned."""
        a = np.repeat(np.arange(len(self.save)), len(other.save))
        b = np.tile(np.arange(len(other.save)), len(self.save))
        return _Frontier(np.maximum(self.trans[a], other.trans[b]), self.save[a] + other.save[b],
                         self.time[a] + other.time[b], self.counts[a] + other.counts[b]).pruned()


class RecomputeSolver:
    """Exact per-stage recompute selection for one :class:`LayerQuantities`: each layer none, full or (with
    ``selective``) selective recompute, the least recompute time that fits.

    Layers with identical (full time, full saving, selective time, selective saving) form a class and are
    interchangeable, so only the counts per class matter. For every class, the Pareto front of its (selective,
    full) counts is built once per count, and the fronts of a composition are combined once
    (:meth:`_choices`)."""

    def __init__(self, q: LayerQuantities, *, selective: bool = False) -> None:
        self.q = q
        saving = q.saving_bytes
        sel_saving = q.sel_saving_bytes if selective else np.zeros_like(saving)
        sel_time = np.where(sel_saving > 0, q.sel_recompute_time, 0.0)
        eligible = saving > 0
        keys = np.stack([q.recompute_time, saving, sel_time, sel_saving], axis=1)
        self.class_of = np.full(q.num_layers, -1, dtype=np.int64)
        if eligible.any():
            uniq, inverse = np.unique(keys[eligible], axis=0, return_inverse=True)
            self.class_of[eligible] = inverse.reshape(-1)
        else:
            uniq = np.zeros((0, 4))
        self.class_time, self.class_saving = uniq[:, 0].copy(), uniq[:, 1].copy()
        self.class_sel_time, self.class_sel_saving = uniq[:, 2].copy(), uniq[:, 3].copy()
        num_classes = len(uniq)
        onehot = np.zeros((q.num_layers, num_classes))
        onehot[np.arange(q.num_layers)[eligible], self.class_of[eligible]] = 1.0
        self.count_prefix = np.concatenate([np.zeros((1, num_classes)), np.cumsum(onehot, axis=0)]).astype(np.int64)
        self.static_prefix = np.concatenate([[0.0], np.cumsum(q.static_bytes)])
        self.act_prefix = np.concatenate([[0.0], np.cumsum(q.act_bytes)])
        self.saving_prefix = np.concatenate([[0.0], np.cumsum(saving)])
        self._fronts: dict[tuple[int, int], _Frontier] = {}
        self._combined: dict[tuple[bytes, int], tuple] = {}

    # ---- memory bounds -------------------------------------------------------------------------
    def memory_without_recompute(self, start: int, stop: int, in_flight: int) -> float:
        return float(self.static_prefix[stop] - self.static_prefix[start]
                     + in_flight * (self.act_prefix[stop] - self.act_prefix[start]))

    def min_memory(self, start: int, stop: int, in_flight: int) -> float:
        """Smallest peak the stage can reach: every layer with a saving recomputed whole (optimal for k >= 1:
        full recompute frees at least what selective does)."""
        counts = self.count_prefix[stop] - self.count_prefix[start]
        present = counts > 0
        working = float(self.class_saving[present].max()) if present.any() else 0.0
        return (self.memory_without_recompute(start, stop, in_flight)
                - in_flight * float(self.saving_prefix[stop] - self.saving_prefix[start]) + working)

    # ---- the knapsack ---------------------------------------------------------------------------
    def class_front(self, c: int, n: int) -> _Frontier:
        """Pareto front of recomputing ``x_s`` layers of class ``c`` selectively and ``x_f`` whole,
        ``x_s + x_f <= n`` (cached)."""
        if (c, n) not in self._fronts:
            xs, xf = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
            ok = (xs + xf <= n) & ((xs == 0) | (self.class_sel_saving[c] > 0))
            xs, xf = xs[ok], xf[ok]
            counts = np.zeros((len(xs), 2 * len(self.class_time)), np.int64)
            counts[:, 2 * c], counts[:, 2 * c + 1] = xs, xf
            trans = np.where(xf > 0, self.class_saving[c], np.where(xs > 0, self.class_sel_saving[c], 0.0))
            self._fronts[(c, n)] = _Frontier(trans, xs * self.class_sel_saving[c] + xf * self.class_saving[c],
                                             xs * self.class_sel_time[c] + xf * self.class_time[c], counts).pruned()
        return self._fronts[(c, n)]

    def solve(self, start: int, stop: int, in_flight: int, budget: float | None, *,
              with_layers: bool = True, known_feasible: bool = False) -> StageRecompute | None:
        """Least-recompute choice for layers ``[start, stop)``; None when no choice fits.
        ``with_layers=False`` skips naming the layers (the joint search needs only the time)."""
        base = self.memory_without_recompute(start, stop, in_flight)
        if fits(base, budget):
            return StageRecompute(checkpointed=(), recompute_time=0.0, memory_bytes=base)
        if not known_feasible and not fits(self.min_memory(start, stop, in_flight), budget):
            return None
        counts = self.count_prefix[stop] - self.count_prefix[start]
        front, v_sorted, order, best_of_suffix = self._choices(counts, in_flight)
        i = int(np.searchsorted(v_sorted, base - budget * (1.0 + MEMORY_RTOL), side="left"))
        assert i < len(v_sorted), "min_memory said a choice fits"
        j = int(order[best_of_suffix[i]])
        cost, mem = float(front.time[j]), float(base - (in_flight * front.save[j] - front.trans[j]))
        chosen = front.counts[j]
        full, sel = (self._first_layers(start, stop, chosen) if with_layers else ((), ()))
        return StageRecompute(checkpointed=full, recompute_time=cost, memory_bytes=mem, selective=sel)

    def _choices(self, counts: np.ndarray, k: int):
        """Every Pareto-optimal choice of a stage with class ``counts`` and ``k`` micro-batches in flight, by
        the bytes it frees (``k * saving - transient``): (the front, those bytes ascending, the front's order
        for them, and per position the cheapest choice freeing at least that much, the one freeing most among
        equally cheap ones). Cached: it depends on the counts and ``k`` only, so stages of one composition
        share it and a stage is one binary search."""
        key = (counts.tobytes(), k)
        if key not in self._combined:
            present = np.flatnonzero(counts > 0)
            front = _Frontier.nothing(len(self.class_time))
            for c in present:
                front = front.plus(self.class_front(int(c), int(counts[c])))
            freed = k * front.save - front.trans
            order = np.argsort(freed, kind="stable")
            rev_time = front.time[order][::-1]
            running = np.minimum.accumulate(rev_time)
            improves = rev_time < np.concatenate([[np.inf], running[:-1]])
            best_rev = np.maximum.accumulate(np.where(improves, np.arange(len(order)), 0))
            # position i (ascending freed) -> reversed position n-1-i -> its best, back in ascending positions
            best_of_suffix = (len(order) - 1 - best_rev)[::-1]
            self._combined[key] = (front, freed[order], order, best_of_suffix)
        return self._combined[key]

    def _first_layers(self, start: int, stop: int, chosen: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(full, selective) layers: of each class, the first ``full`` layers of the stage recompute whole and
        the next ``selective`` ones selectively (interchangeable under the model; the first ones, like
        Megatron's ``block`` recompute granularity)."""
        full: list[int] = []
        sel: list[int] = []
        cls = self.class_of[start:stop]
        for c in range(len(self.class_time)):
            xs, xf = int(chosen[2 * c]), int(chosen[2 * c + 1])
            if xs or xf:
                members = start + np.flatnonzero(cls == c)
                full.extend(members[:xf].tolist())
                sel.extend(members[xf:xf + xs].tolist())
        return tuple(sorted(full)), tuple(sorted(sel))


def full_recompute(q: LayerQuantities, start: int, stop: int) -> tuple[int, ...]:
    """Every layer of the stage that frees memory when checkpointed (Megatron's full/uniform recompute)."""
    return tuple(int(i) for i in np.flatnonzero(q.saving_bytes[start:stop] > 0) + start)
