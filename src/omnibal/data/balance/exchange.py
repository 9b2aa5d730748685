"""The packer's exchange machinery (phases 2 and 3 of :mod:`omnibal.data.balance.packer`): packs as a padded
slot matrix, and the pairwise swap-or-move search that repairs tile counts and levels LLM costs, all pairs at
once as ``[pairs, K, K]`` array operations."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from omnibal.data.balance.common import exact_sum, sorted_order, tie_break
from omnibal.data.balance.phases import WorkBudget
from omnibal.data.balance.tilematch import match_tiles

_CHUNK_PAIRS = 1 << 14  # bounds the [pairs, K, K] temporaries to a few MiB each
_MAX_COLUMNS = {1: 64, 2: 20}
"""Slots of a pack one exchange weighs (single moves; pairs of slots: 190 pairs): packs are ~5 samples wide,
so this binds only on wide packs, whose pairs would otherwise cost width**2 (width**4 for pairs of slots)."""


class Packs:
    """Packs as a padded ``[P, K]`` slot matrix (``n`` = empty slot, a zero-size sentinel sample)."""

    def __init__(self, slots: np.ndarray, v: np.ndarray, t: np.ndarray, lc: np.ndarray) -> None:
        n = len(v)
        self.n = n
        self.slots = slots
        self.vv, self.tt, self.ll = np.append(v, 0.0), np.append(t, 0.0), np.append(lc, 0.0)
        self.pv = self.vv[slots].sum(1)
        self.pt = self.tt[slots].sum(1)
        self.pl = self.ll[slots].sum(1)

    def best_moves(self, a: np.ndarray, b: np.ndarray, objective, group: int = 1, budget=None):
        """For every pair (a[k], b[k]) the best exchange that lowers ``objective(pv, pt, pl)`` of the
        pair: a single swap/move (``group=1``; moves go through an empty slot) or a swap of up to two
        samples against up to two (``group=2``). Returns (gain [h], slots sent by a [h, g], slots sent by
        b [h, g]); gain <= 0 means no improving exchange. Wide packs are weighed on their first
        ``_MAX_COLUMNS[group] - 1`` slots and a free one (a pair's work is bounded whatever the input);
        ``budget`` (a ``WorkBudget``) refuses the call, with no exchange found, once its candidates are spent."""
        h = len(a)
        empty = np.zeros((h, group), np.int64)
        if h == 0:  # no pair to try (e.g. no active pair in a pass): nothing to reduce over
            return np.zeros(0), empty, empty.copy()
        both = np.zeros(len(self.pv), bool)  # the packs of the pairs (a mask: no sort of the indices)
        both[a] = True
        both[b] = True
        # only the occupied slots plus one free one matter: compact the rows of these packs
        self.slots[both] = np.sort(self.slots[both], axis=1)  # the empty marker n sorts last
        width = min(self.slots.shape[1], int((self.slots[both] < self.n).sum(1).max()) + 1)
        cols = np.arange(width)
        if width > _MAX_COLUMNS[group]:  # the last column is free in every row: moves stay possible
            cols = np.append(cols[: _MAX_COLUMNS[group] - 1], width - 1)
        if group == 1:
            sel = np.arange(len(cols))[:, None]
        else:
            i1, i2 = np.triu_indices(len(cols), 1)
            sel = np.stack([i1, i2], axis=1)  # an empty slot in a pair makes it a single
        k = len(sel)
        if budget is not None and not budget.allows(h * k * k):
            return np.full(h, -np.inf), empty, empty.copy()
        needs_llm = getattr(objective, "needs_llm", True)
        gains = np.full(h, -np.inf)
        best_i = np.zeros((h, sel.shape[1]), np.int64)
        best_j = np.zeros((h, sel.shape[1]), np.int64)
        chunk = max(1, _CHUNK_PAIRS * 64 // (k * k))
        for c0 in range(0, h, chunk):
            ca, cb = a[c0:c0 + chunk], b[c0:c0 + chunk]
            sa, sb = self.slots[ca[:, None], cols], self.slots[cb[:, None], cols]
            ga, gb = sa[:, sel], sb[:, sel]  # [c, k, group] sample ids per candidate subset
            dv = self.vv[ga].sum(2)[:, :, None] - self.vv[gb].sum(2)[:, None, :]  # a sends minus receives
            dt = self.tt[ga].sum(2)[:, :, None] - self.tt[gb].sum(2)[:, None, :]
            before = objective(self.pv[ca], self.pt[ca], self.pl[ca]) + objective(self.pv[cb], self.pt[cb],
                                                                                  self.pl[cb])
            if needs_llm:
                dl = self.ll[ga].sum(2)[:, :, None] - self.ll[gb].sum(2)[:, None, :]
                la, lb = self.pl[ca][:, None, None] - dl, self.pl[cb][:, None, None] + dl
            else:
                la = lb = None
            after = objective(self.pv[ca][:, None, None] - dv, self.pt[ca][:, None, None] - dt, la)
            after += objective(self.pv[cb][:, None, None] + dv, self.pt[cb][:, None, None] + dt, lb)
            # a swap of two empty slots changes nothing: its gain is exactly 0 and never taken
            gain = np.subtract(before[:, None, None], after, out=after)
            flat = gain.reshape(len(ca), k * k)
            best = np.argmax(flat, axis=1)
            g = flat[np.arange(len(ca)), best]
            gains[c0:c0 + chunk] = np.where(g > 1e-12 * np.maximum(before, 1e-300), g, -np.inf)
            best_i[c0:c0 + chunk] = cols[sel[best // k]]
            best_j[c0:c0 + chunk] = cols[sel[best % k]]
        return gains, best_i, best_j

    def apply(self, a: np.ndarray, b: np.ndarray, i: np.ndarray, j: np.ndarray) -> None:
        """Swap slots ``i`` of packs ``a`` with slots ``j`` of packs ``b`` (all packs distinct)."""
        x = self.slots[a[:, None], i]
        y = self.slots[b[:, None], j]
        self.slots[a[:, None], i], self.slots[b[:, None], j] = y, x
        for total, per in ((self.pv, self.vv), (self.pt, self.tt), (self.pl, self.ll)):
            d = per[x].sum(1) - per[y].sum(1)
            total[a] -= d
            total[b] += d

    def exchange(self, a: np.ndarray, b: np.ndarray, objective, group: int = 1, budget=None) -> int:
        """Apply the best improving exchange of every disjoint pair (a[k], b[k]); returns pairs changed."""
        gains, i, j = self.best_moves(a, b, objective, group, budget)
        take = gains > 0
        if take.any():
            self.apply(a[take], b[take], i[take], j[take])
        return int(take.sum())

    def pack_of(self) -> np.ndarray:
        p, width = self.slots.shape
        out = np.empty(self.n, dtype=np.int64)
        used = self.slots < self.n
        out[self.slots[used]] = np.broadcast_to(np.arange(p)[:, None], (p, width))[used]
        return out


def improve(packs: Packs, objective, deviation, rng, max_passes: int, group: int = 1,
            bad_above: float = 0.0, budget=None) -> int:
    """Pairwise exchange passes until no pack is off (objective 0), nothing improves for a while or the
    ``budget`` is spent."""
    p = len(packs.pv)
    if p < 2:
        return 0
    stale = 0
    passes = 0
    g = objective(packs.pv, packs.pt, packs.pl)
    for passes in range(1, max_passes + 1):
        bad = g > bad_above
        # a pass pairs every pack: once only a few are off, the targeted repair serves them for less
        if bad.sum() <= FEW_OFF * p or (budget is not None and budget.exhausted):
            break
        if passes % 2:
            # packs of equal deviation in a random order (distinct keys: the same order on every machine)
            srt = sorted_order(deviation(packs.pv, packs.pt, packs.pl), tie_break(p, rng))
            first, second = srt[: p // 2], srt[::-1][: p // 2]
        else:
            perm = rng.permutation(p)
            first, second = perm[: p // 2], perm[p // 2: 2 * (p // 2)]
        active = bad[first] | bad[second]
        before = exact_sum(np.maximum(g - bad_above, 0))
        packs.exchange(first[active], second[active], objective, group, budget)
        g = objective(packs.pv, packs.pt, packs.pl)
        after = exact_sum(np.maximum(g - bad_above, 0))
        # stop after two passes in a row that gain under 5%: the tail is left to the targeted repair
        stale = stale + 1 if after > 0.95 * before else 0
        if stale >= 2:
            break
    return passes


FEW_OFF = 0.01
"""Share of packs off under which the pairing passes stop (the targeted repair takes the rest)."""


def _smallest(values: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` smallest ``values`` in the order of (value, position): what a stable argsort
    gives first, in O(N + k log k) (a partition finds the k-th value; no order depends on the sort kernel)."""
    if k >= len(values):
        return np.argsort(values, kind="stable")
    kth = np.partition(values, k - 1)[k - 1]
    below = np.flatnonzero(values < kth)
    chosen = np.concatenate([below, np.flatnonzero(values == kth)[: k - len(below)]])
    return chosen[np.argsort(values[chosen], kind="stable")] if len(chosen) else chosen


def _occupied(packs: Packs, rows: np.ndarray) -> int:
    """Occupied slots of the widest of ``rows``, plus two (the free slot a move goes through, and margin)."""
    return int((packs.slots[rows] < packs.n).sum(1).max()) + 2


ROUND_WORK_PER_ROW = 8
"""Candidate exchanges per row one repair round may weigh (between ``2**16`` and ``2**20`` in all)."""


def _pair_budget(width: int, group: int, rows: int) -> int:
    """Pairs of packs one repair round may try: ``ROUND_WORK_PER_ROW`` candidates per row, at least 64k
    and at most ~1M in all, and at least 16 pairs."""
    subsets = min(width, _MAX_COLUMNS[group]) if group == 1 else min(width, _MAX_COLUMNS[group]) ** 2 // 2
    return max(16, min(max(ROUND_WORK_PER_ROW * rows, 1 << 16), 1 << 20) // (subsets * subsets))


def _repair(packs: Packs, objective, deviation, rng, rounds: int, partners: int, group: int,
            bad_above: float = 0.0, budget=None) -> int:
    """For the few packs still off: try ``partners`` packs that are fine, drawn from those with the most
    room (lowest deviation), for each of them; keep the best improving exchange per off pack (each partner
    used once per round). Much stronger than one partner per pass when only a tail is left."""
    for r in range(1, rounds + 1):
        g = objective(packs.pv, packs.pt, packs.pl)
        bad = np.flatnonzero(g > bad_above)
        good = np.flatnonzero(g <= bad_above)
        if len(bad) == 0 or len(good) == 0 or (budget is not None and budget.exhausted):
            return r - 1
        # bounded work per round: many partners for a short tail, fewer when many packs are off
        width = _occupied(packs, bad)
        most = _pair_budget(width, group, packs.n)
        partners_now = max(1, min(partners, most // len(bad)))
        if len(bad) > most:
            bad = bad[rng.permutation(len(bad))[:most]]
        pool_size = min(len(good), max(64, 8 * partners_now * len(bad)))
        dev = deviation(packs.pv[good], packs.pt[good], packs.pl[good])
        sign = np.sign(np.median(deviation(packs.pv[bad], packs.pt[bad], packs.pl[bad])))
        pool = good[_smallest(sign * dev, pool_size)]  # room on the side the off ones need
        # a pair's work is set by the wider of its two packs: partners wider than the off packs (many short
        # samples, as in LLM-only data) would otherwise multiply the round's work by (their width)^2
        pool_width = _occupied(packs, pool)
        if pool_width > width:
            most = _pair_budget(pool_width, group, packs.n)
            partners_now = max(1, min(partners, most // len(bad)))
            bad = bad[:most]
        a = np.repeat(bad, partners_now)
        b = pool[rng.integers(0, len(pool), size=len(a))]
        gains, i, j = packs.best_moves(a, b, objective, group, budget)
        order = np.lexsort((-gains, a))  # per off pack, its best partner first
        first = np.ones(len(order), bool)
        first[1:] = a[order][1:] != a[order][:-1]
        pick = order[first & np.isfinite(gains[order]) & (gains[order] > 0)]
        if len(pick) == 0:
            return r
        pick = pick[np.argsort(-gains[pick], kind="stable")]
        _, once = np.unique(b[pick], return_index=True)  # a partner serves one off pack per round
        pick = pick[np.sort(once)]
        packs.apply(a[pick], b[pick], i[pick], j[pick])
    return rounds


def min_tokens_per_tile(v, t) -> float:
    """The fewest tokens per tile of the multi-tile samples (1st percentile: a few odd rows do not set it);
    inf when there are none. The linear percentile spelt out (the two order statistics and their
    interpolation), so that the value does not depend on a numpy version's formula for it."""
    multi = v >= 2
    if not multi.any():
        return np.inf
    ratio = t[multi] / v[multi]
    pos = (len(ratio) - 1) * 0.01
    k = int(math.floor(pos))
    k1 = min(k + 1, len(ratio) - 1)
    low, high = (float(x) for x in np.partition(ratio, (k, k1))[[k, k1]])
    return max(low + (high - low) * (pos - k), 1.0)


_HARD = 1e9
"""Objective weight of a pack over a cap once every pack is under them: no exchange may bring one over."""

# The LLM levelling's objective is meant to be lexicographic: a pack over the tile cap outweighs a token overflow,
# a token overflow outweighs the balance terms (tiles off the range, LLM cost outside the band), and those only
# order what is left. The weights are spaced by orders of magnitude for the sizes the packer sees (tile offs of a
# few units; token overflows and LLM deviations as fractions of the mean pack). A squared relative overflow can
# be tiny (one token over a 4,000-token pack: 6e-8), so any overflow also pays a flat 1, which outranks the
# balance terms (at most ~1e-2 each); exchanges never trade an overflow for balance.
_W_TILE_CAP = 1e6
_W_TOKEN_OVER = 1e4
_W_ANY_OVER = 1.0
_W_TILE_RANGE = 1e-3
_W_LLM_BAND = 1e-2


@dataclass(frozen=True, kw_only=True)
class Targets:
    """What the exchange phases aim at for ``num_packs`` packs: tiles in ``[tile_lo, tile_hi]``, tokens
    under the token cap, LLM cost within ``llm_tol`` of the mean. ``hard``: every pack is already under
    the caps, and going over one costs more than any balance gain (so none ever does again)."""

    mean_v: float
    mean_t: float
    mean_l: float
    tile_lo: float
    tile_top: float
    tile_hi: float
    max_tokens: float
    llm_tol: float | None
    hard: bool = False
    tokens_per_tile: float = np.inf
    """The fewest LLM tokens a tile brings (inf: tiles and tokens not coupled): a pack whose token room
    holds no more tiles is not under the tile range (its text already fills the buffer)."""

    @classmethod
    def of(cls, v, t, lc, num_packs: int, max_tiles: int, max_tokens: int, llm_tol, hard=False) -> Targets:
        mean_v = float(v.sum()) / num_packs
        return cls(mean_v=mean_v, mean_t=max(float(t.sum()) / num_packs, 1.0),
                   mean_l=max(float(lc.sum()) / num_packs, 1e-300),
                   tile_lo=min(np.floor(mean_v + 1e-9), float(max_tiles)),
                   tile_top=min(np.ceil(mean_v - 1e-9), float(max_tiles)), tile_hi=float(max_tiles),
                   max_tokens=float(max_tokens), llm_tol=llm_tol, hard=hard, tokens_per_tile=min_tokens_per_tile(v, t))

    def tile_off(self, pv, pt):
        # under the range only by as many tiles as the pack's token room still holds (written with in-place
        # operations on fresh arrays: the exchange evaluates it on [pairs, K, K] candidates)
        off = pv - self.tile_top
        np.maximum(off, 0, out=off)
        if np.isfinite(self.tokens_per_tile):
            room = self.max_tokens - pt
            room /= self.tokens_per_tile
            np.floor(room, out=room)
            np.maximum(room, 0, out=room)
            under = self.tile_lo - pv
            np.maximum(under, 0, out=under)
            np.minimum(under, room, out=under)
            off += under
        return off

    def token_over(self, pt):
        over = pt - self.max_tokens
        np.maximum(over, 0, out=over)
        over /= self.mean_t
        return over

    def _hard(self, pv, pt):
        if not self.hard:
            return 0.0
        return _HARD * ((pv > self.tile_hi) | (pt > self.max_tokens))

    def tile_objective(self, pv, pt, pl):
        # a token overflow counts as the tiles it is worth: repairs never fill a text-heavy pack with tiles
        off = self.tile_off(pv, pt)
        if np.isfinite(self.tokens_per_tile):
            over = pt - self.max_tokens
            np.maximum(over, 0, out=over)
            over /= self.tokens_per_tile
            off += over
        off *= off
        if self.hard:
            off += self._hard(pv, pt)
        return off

    def tile_deviation(self, pv, pt, pl):
        # continuous, so a pack over the range meets one at the low end of it (not one just inside)
        return pv - self.mean_v

    def llm_dev(self, pv, pl):
        # every pack aims at the same LLM cost, also those one tile short: they take the text-heavy
        # samples that would push a full-tile pack over the token cap, which fills both buffers
        return (pl - self.mean_l) / self.mean_l

    def llm_objective(self, pv, pt, pl):
        # over the tile cap: forbidden; over the token cap: to be fixed, even by a pack one tile under the
        # range (a text-heavy sample needs the room of a tile); under the range: a mild cost
        over = self.token_over(pt)
        g = pv - self.tile_hi
        np.maximum(g, 0, out=g)
        g *= g
        g *= _W_TILE_CAP
        g += (over > 0) * _W_ANY_OVER
        off = self.tile_off(pv, pt)
        off *= off
        off *= _W_TILE_RANGE
        g += off
        over *= over
        over *= _W_TOKEN_OVER
        g += over
        if self.llm_tol is not None:
            band = pl - self.mean_l
            band /= self.mean_l
            np.abs(band, out=band)
            band -= self.llm_tol
            np.maximum(band, 0, out=band)
            band *= band
            band *= _W_LLM_BAND
            g += band
        if self.hard:
            g += self._hard(pv, pt)
        return g

    def llm_deviation(self, pv, pt, pl):
        return self.llm_dev(pv, pl) + 10.0 * self.token_over(pt)

    # a pack merely one tile under the range is acceptable; only caps (and the band) make a pack "bad"
    ok_level = _W_TILE_RANGE + 1e-9


Targets.tile_objective.needs_llm = False  # reads tiles and tokens only: the exchange skips the LLM deltas


TILE_WORK_PER_ROW = 400
"""Candidate exchanges per row the tile repair may weigh (its ``WorkBudget``)."""
LEVEL_WORK_PER_ROW = 800
"""Candidate exchanges per row the LLM levelling may weigh."""
TILE_REPAIR_ROUNDS = 32
"""Rounds of the targeted tile repair at most (a round that finds no improving exchange ends the repair): a
round serves each off pack once, with one partner each, so hundreds of packs one tile over take tens of
rounds (e.g. a mixture of 1-, 3- and 5-tile samples, whose even-tile packs need an even sample count)."""


def repair_tiles(packs: Packs, targets: Targets, rng, budget=None) -> int:
    """Phase 2: bring every pack's tile count into ``[tile_lo, tile_hi]`` (within ``budget``, a
    ``WorkBudget``; by default ``TILE_WORK_PER_ROW`` candidates per row)."""
    budget = budget or WorkBudget.per_row(packs.n, TILE_WORK_PER_ROW)
    if not np.isfinite(targets.tokens_per_tile):
        # tiles alone (the cap search's trials): exchange types mend most packs at O(P) numpy per type. With
        # the token room in play (the packer) the pairwise exchange below does better: it sees the tokens
        match_tiles(packs, targets.tile_lo, targets.tile_top, rng)
    passes = improve(packs, targets.tile_objective, targets.tile_deviation, rng, 8, budget=budget)
    for group in (1, 2):
        if (targets.tile_objective(packs.pv, packs.pt, packs.pl) > 0).any():
            passes += _repair(packs, targets.tile_objective, targets.tile_deviation, rng, rounds=TILE_REPAIR_ROUNDS,
                              partners=24, group=group, budget=budget)
    return passes


def level_llm(packs: Packs, targets: Targets, rng, max_passes: int, budget=None) -> int:
    """Phase 3: token cap and LLM levelling, tile counts kept in range (within ``budget``; by default
    ``LEVEL_WORK_PER_ROW`` candidates per row)."""
    budget = budget or WorkBudget.per_row(packs.n, LEVEL_WORK_PER_ROW)
    ok = targets.ok_level
    passes = improve(packs, targets.llm_objective, targets.llm_deviation, rng, max_passes, bad_above=ok,
                     budget=budget)
    for group in (1, 2):
        if (targets.llm_objective(packs.pv, packs.pt, packs.pl) > ok).any():
            passes += _repair(packs, targets.llm_objective, targets.llm_deviation, rng, rounds=6, partners=256,
                              group=group, bad_above=ok, budget=budget)
    # group swaps twice more, only while a pack is over the token cap: the text-heavy packs' last overflows
    # need more than one round of 2-for-2 swaps (without them packs stay a few tokens over in some epochs);
    # packs merely outside the LLM band do not pay for them (they would cost several times the CPU time)
    for _ in range(2):
        if not (packs.pt > targets.max_tokens).any():
            break
        passes += _repair(packs, targets.llm_objective, targets.llm_deviation, rng, rounds=6, partners=256,
                          group=2, bad_above=ok, budget=budget)
    return passes

