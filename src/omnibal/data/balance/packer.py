"""omnibal's packer: ``P`` packs whose tile counts are equal (to the integer) and whose LLM costs are equal
(within a small band), all under the (Q_v, Q_t) buffer.

Four vectorised phases, no per-sample Python loop:

1. **Round dealing** (an LPT in rounds): samples sorted by (tiles, LLM cost), largest first, are dealt ``P``
   at a time; in every round the largest sample goes to the pack with the fewest tiles so far (ties: the
   lowest LLM cost). Every pack gets one sample from every size band.
2. **Tile repair**: packs whose tile count is outside ``[floor(V/P), ceil(V/P)]`` (V = total tiles; never
   above the tile cap) are paired with packs on the other side and the single swap or move that brings
   both closest to the range is applied, all pairs at once as ``[pairs, K, K]`` array operations.
3. **LLM levelling**: the same pairwise exchange, restricted to swaps that keep both packs' tile counts in
   range, pulls every pack under the token cap and its LLM cost into ``llm_tol`` (default 1%) of the mean.
   Pairs are heaviest-with-lightest (sorted), alternating with random pairings so that no pair is tried
   twice in a row; only pairs with a pack outside the band are evaluated, so late passes are cheap.
4. **The tail** (``_enforce_caps``): packs still over a cap give up samples -- per pack the smallest one
   whose removal suffices -- to whole new steps of packs; then phases 2-3 run again with the caps hard
   (every pack starts under them and no exchange may bring one over), which spreads the new packs' room
   over all packs. So a fixed buffer always holds, whatever the caps, as long as every sample fits alone and
   there are enough samples for the packs. With derived caps a buffer grown to the few packs a little over
   it is kept instead when that pads less than a step of new packs; outliers far over never set it.

Exactly-once holds by construction: samples only ever change slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal.data.balance.isf import next_fit

_CHUNK_PAIRS = 1 << 14  # bounds the [pairs, K, K] temporaries to a few MiB each


@dataclass(frozen=True, kw_only=True)
class PackResult:
    """Per-sample pack label and the per-pack loads."""

    pack_of: np.ndarray
    """Pack index of every sample (int64)."""
    tiles: np.ndarray
    """Tiles per pack."""
    tokens: np.ndarray
    """Tokens per pack."""
    llm: np.ndarray
    """LLM cost per pack (per-sample part)."""
    passes: tuple[int, int, int]
    """Exchange passes run in the tile repair, the LLM levelling and after the tail's new packs."""


class _Packs:
    """Packs as a padded ``[P, K]`` slot matrix (``n`` = empty slot, a zero-size sentinel sample)."""

    def __init__(self, slots: np.ndarray, v: np.ndarray, t: np.ndarray, lc: np.ndarray) -> None:
        n = len(v)
        self.n = n
        self.slots = slots
        self.vv, self.tt, self.ll = np.append(v, 0.0), np.append(t, 0.0), np.append(lc, 0.0)
        self.pv = self.vv[slots].sum(1)
        self.pt = self.tt[slots].sum(1)
        self.pl = self.ll[slots].sum(1)

    def best_moves(self, a: np.ndarray, b: np.ndarray, objective, group: int = 1):
        """For every pair (a[k], b[k]) the best exchange that lowers ``objective(pv, pt, pl)`` of the
        pair: a single swap/move (``group=1``; moves go through an empty slot) or a swap of up to two
        samples against up to two (``group=2``). Returns (gain [h], slots sent by a [h, g], slots sent by
        b [h, g]); gain <= 0 means no improving exchange."""
        if len(a) == 0:  # no pair to try (e.g. no active pair in a pass): nothing to reduce over
            empty = np.zeros((0, group), np.int64)
            return np.zeros(0), empty, empty.copy()
        both = np.unique(np.concatenate([a, b]))
        # only the occupied slots plus one free one matter: compact the rows of these packs
        self.slots[both] = np.sort(self.slots[both], axis=1)  # the empty marker n sorts last
        width = min(self.slots.shape[1], int((self.slots[both] < self.n).sum(1).max()) + 1)
        if group == 1:
            sel = np.arange(width)[:, None]
        else:
            i1, i2 = np.triu_indices(width, 1)
            sel = np.stack([i1, i2], axis=1)  # pairs of slots; an empty slot in a pair makes it a single
        k = len(sel)
        h = len(a)
        gains = np.full(h, -np.inf)
        best_i = np.zeros((h, sel.shape[1]), np.int64)
        best_j = np.zeros((h, sel.shape[1]), np.int64)
        chunk = max(1, _CHUNK_PAIRS * 64 // (k * k))
        for c0 in range(0, h, chunk):
            ca, cb = a[c0:c0 + chunk], b[c0:c0 + chunk]
            sa, sb = self.slots[ca, :width], self.slots[cb, :width]
            ga, gb = sa[:, sel], sb[:, sel]  # [c, k, group] sample ids per candidate subset
            dv = self.vv[ga].sum(2)[:, :, None] - self.vv[gb].sum(2)[:, None, :]  # a sends minus receives
            dt = self.tt[ga].sum(2)[:, :, None] - self.tt[gb].sum(2)[:, None, :]
            dl = self.ll[ga].sum(2)[:, :, None] - self.ll[gb].sum(2)[:, None, :]
            before = objective(self.pv[ca], self.pt[ca], self.pl[ca]) + objective(self.pv[cb], self.pt[cb],
                                                                                  self.pl[cb])
            after = objective(self.pv[ca][:, None, None] - dv, self.pt[ca][:, None, None] - dt,
                              self.pl[ca][:, None, None] - dl)
            after += objective(self.pv[cb][:, None, None] + dv, self.pt[cb][:, None, None] + dt,
                               self.pl[cb][:, None, None] + dl)
            gain = before[:, None, None] - after
            gain[(ga == self.n).all(2)[:, :, None] & (gb == self.n).all(2)[:, None, :]] = -np.inf
            flat = gain.reshape(len(ca), k * k)
            best = np.argmax(flat, axis=1)
            g = flat[np.arange(len(ca)), best]
            gains[c0:c0 + chunk] = np.where(g > 1e-12 * np.maximum(before, 1e-300), g, -np.inf)
            best_i[c0:c0 + chunk] = sel[best // k]
            best_j[c0:c0 + chunk] = sel[best % k]
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

    def exchange(self, a: np.ndarray, b: np.ndarray, objective, group: int = 1) -> int:
        """Apply the best improving exchange of every disjoint pair (a[k], b[k]); returns pairs changed."""
        gains, i, j = self.best_moves(a, b, objective, group)
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


def _improve(packs: _Packs, objective, deviation, rng, max_passes: int, group: int = 1,
             bad_above: float = 0.0) -> int:
    """Pairwise exchange passes until no pack is off (objective 0) or nothing improves for a while."""
    p = len(packs.pv)
    if p < 2:
        return 0
    stale = 0
    passes = 0
    g = objective(packs.pv, packs.pt, packs.pl)
    for passes in range(1, max_passes + 1):
        bad = g > bad_above
        if not bad.any():
            break
        if passes % 2:
            # (deterministic for a given input: ties are broken by the random jitter, not by sort order)
            srt = np.argsort(deviation(packs.pv, packs.pt, packs.pl) + rng.random(p) * 1e-12)
            first, second = srt[: p // 2], srt[::-1][: p // 2]
        else:
            perm = rng.permutation(p)
            first, second = perm[: p // 2], perm[p // 2: 2 * (p // 2)]
        active = bad[first] | bad[second]
        before = float(np.maximum(g - bad_above, 0).sum())
        packs.exchange(first[active], second[active], objective, group)
        g = objective(packs.pv, packs.pt, packs.pl)
        after = float(np.maximum(g - bad_above, 0).sum())
        # stop after two passes in a row that gain under 5%: the tail is left to the targeted repair
        stale = stale + 1 if after > 0.95 * before else 0
        if stale >= 2:
            break
    return passes


def _deal(v, t, lc, p, max_tiles, max_tokens, rng) -> np.ndarray:
    """LPT in rounds: each round pairs the largest pending samples with the lightest packs (by tiles, then
    LLM cost); a sample that would overflow its pack's buffer waits for the next round. Whatever still
    does not fit when a round places nothing goes to the lightest packs (the repair phases fix those)."""
    n = len(v)
    # one float key per sort (a lexsort of three keys is ~3x slower): tiles first, LLM cost as the tie-break
    lc_unit = lc / max(float(lc.max()), 1e-300) * 0.45
    item_key = v + lc_unit + rng.random(n) * 1e-9
    # text-heavy samples (far more of the token buffer than of the tile buffer) are dealt by their token
    # share: dealt last by tiles, they would find no pack with token room left
    share_v = v / max(max_tiles, 1)
    share_t = t / max(max_tokens, 1)
    heavy = share_t > 2.0 * share_v + 0.1
    item_key = np.where(heavy, share_t * max_tiles + 0.45, item_key)
    order = np.argsort(-item_key)
    width = -(-n // p) + 4
    slots = np.full((p, width), n, dtype=np.int64)
    count = np.zeros(p, dtype=np.int64)
    load_v, load_t, load_l = np.zeros(p), np.zeros(p), np.zeros(p)
    tie = rng.random(p) * 1e-9
    l_scale = 0.45 / max(float(lc.sum()) / p * 1.5, 1e-300)
    pending = np.zeros(0, dtype=np.int64)
    nxt = 0
    force = False
    # Progress: a round places a sample, or reads a new one, or (placing and reading nothing) forces the
    # next round, which places everything it holds. So there are at most 3n rounds; asserted below.
    max_rounds = 3 * n + 3
    rounds = 0
    while nxt < n or len(pending):
        rounds += 1
        assert rounds <= max_rounds, f"_deal made no progress in {max_rounds} rounds ({n} samples, {p} packs)"
        take = p - len(pending)
        items = np.concatenate([pending, order[nxt:nxt + take]])
        nxt += max(take, 0)
        items = items[np.argsort(-item_key[items])]  # largest first
        # tiles first, but a pack whose tokens are further along than its tiles counts as that full
        dominant = np.maximum(load_v, load_t / max(max_tokens, 1) * max_tiles)
        pack_key = dominant + np.minimum(load_l * l_scale, 0.45) + tie
        packs = np.argsort(pack_key)[: len(items)]
        fits = force | ((load_v[packs] + v[items] <= max_tiles) & (load_t[packs] + t[items] <= max_tokens))
        packs, placed = packs[fits], items[fits]
        if len(packs):
            if count[packs].max() >= slots.shape[1]:
                slots = np.concatenate([slots, np.full((p, 4), n, dtype=np.int64)], axis=1)
            slots[packs, count[packs]] = placed
            count[packs] += 1
            load_v[packs] += v[placed]
            load_t[packs] += t[placed]
            load_l[packs] += lc[placed]
        pending = items[~fits]
        # nothing (or almost nothing) fits any more once the pool is dealt: place the rest, repair later.
        # The same when a round places nothing while the pending samples fill every pack slot: no new
        # sample can enter the next round, so without forcing it would be this round again, forever.
        stalled = len(packs) == 0 and len(pending) >= p
        force = stalled or (nxt >= n and len(packs) <= max(len(items) // 20, 0))
    need = int(count.max()) + 3  # keep free slots so samples can move between packs
    if slots.shape[1] < need:
        slots = np.concatenate([slots, np.full((p, need - slots.shape[1]), n, dtype=np.int64)], axis=1)
    return slots


def _repair(packs: _Packs, objective, deviation, rng, rounds: int, partners: int, group: int,
            bad_above: float = 0.0) -> int:
    """For the few packs still off: try ``partners`` packs that are fine, drawn from those with the most
    room (lowest deviation), for each of them; keep the best improving exchange per off pack (each partner
    used once per round). Much stronger than one partner per pass when only a tail is left."""
    for r in range(1, rounds + 1):
        g = objective(packs.pv, packs.pt, packs.pl)
        bad = np.flatnonzero(g > bad_above)
        good = np.flatnonzero(g <= bad_above)
        if len(bad) == 0 or len(good) == 0:
            return r - 1
        # bounded work per round: many partners for a short tail, fewer when many packs are off
        width = int((packs.slots[bad] < packs.n).sum(1).max()) + 2
        subsets = width if group == 1 else width * (width - 1) // 2
        budget = max(16, (1 << 20) // (subsets * subsets))  # ~1M candidate exchanges per round
        partners_now = max(1, min(partners, budget // len(bad)))
        if len(bad) > budget:
            bad = bad[rng.permutation(len(bad))[:budget]]
        pool_size = min(len(good), max(64, 8 * partners_now * len(bad)))
        dev = deviation(packs.pv[good], packs.pt[good], packs.pl[good])
        sign = np.sign(np.median(deviation(packs.pv[bad], packs.pt[bad], packs.pl[bad])))
        pool = good[np.argsort(sign * dev, kind="stable")[:pool_size]]  # room on the side the off ones need
        a = np.repeat(bad, partners_now)
        b = pool[rng.integers(0, len(pool), size=len(a))]
        gains, i, j = packs.best_moves(a, b, objective, group)
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


_HARD = 1e9
"""Objective weight of a pack over a cap once every pack is under them: no exchange may bring one over."""

DEFAULT_LLM_TOL = 0.01
"""Default band (relative to the mean) the LLM levelling pulls every pack's LLM cost into."""


@dataclass(frozen=True, kw_only=True)
class _Targets:
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

    @classmethod
    def of(cls, v, t, lc, num_packs: int, max_tiles: int, max_tokens: int, llm_tol, hard=False) -> "_Targets":
        mean_v = float(v.sum()) / num_packs
        return cls(mean_v=mean_v, mean_t=max(float(t.sum()) / num_packs, 1.0),
                   mean_l=max(float(lc.sum()) / num_packs, 1e-300),
                   tile_lo=min(np.floor(mean_v + 1e-9), float(max_tiles)),
                   tile_top=min(np.ceil(mean_v - 1e-9), float(max_tiles)), tile_hi=float(max_tiles),
                   max_tokens=float(max_tokens), llm_tol=llm_tol, hard=hard)

    def tile_off(self, pv):
        return np.maximum(pv - self.tile_top, 0) + np.maximum(self.tile_lo - pv, 0)

    def token_over(self, pt):
        return np.maximum(pt - self.max_tokens, 0) / self.mean_t

    def _hard(self, pv, pt):
        if not self.hard:
            return 0.0
        return _HARD * ((pv > self.tile_hi) | (pt > self.max_tokens))

    def tile_objective(self, pv, pt, pl):
        off = self.tile_off(pv)
        return off * off + self._hard(pv, pt)

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
        off = self.tile_off(pv)
        g = 1e6 * np.maximum(pv - self.tile_hi, 0) ** 2 + 1e4 * over * over + 1e-3 * off * off
        g = g + 1.0 * (over > 0)  # any overflow is bad, however small: 1e4 * 2**2 tokens over lost to balance terms
        if self.llm_tol is not None:
            band = np.maximum(np.abs(self.llm_dev(pv, pl)) - self.llm_tol, 0)
            g = g + 0.01 * band * band
        return g + self._hard(pv, pt)

    def llm_deviation(self, pv, pt, pl):
        return self.llm_dev(pv, pl) + 10.0 * self.token_over(pt)

    # a pack merely one tile under the range is acceptable; only caps (and the band) make a pack "bad"
    ok_level = 1e-3 + 1e-9


def _repair_tiles(packs: _Packs, targets: _Targets, rng) -> int:
    """Phase 2: bring every pack's tile count into ``[tile_lo, tile_hi]``."""
    passes = _improve(packs, targets.tile_objective, targets.tile_deviation, rng, 8)
    for group in (1, 2):
        if (targets.tile_objective(packs.pv, packs.pt, packs.pl) > 0).any():
            passes += _repair(packs, targets.tile_objective, targets.tile_deviation, rng, rounds=4, partners=24,
                              group=group)
    return passes


def _level_llm(packs: _Packs, targets: _Targets, rng, max_passes: int) -> int:
    """Phase 3: token cap and LLM levelling, tile counts kept in range."""
    ok = targets.ok_level
    passes = _improve(packs, targets.llm_objective, targets.llm_deviation, rng, max_passes, bad_above=ok)
    for group in (1, 2):
        if (targets.llm_objective(packs.pv, packs.pt, packs.pl) > ok).any():
            passes += _repair(packs, targets.llm_objective, targets.llm_deviation, rng, rounds=6, partners=256,
                              group=group, bad_above=ok)
    return passes


def _over(packs: _Packs, max_tiles: float, max_tokens: float) -> np.ndarray:
    return (packs.pv > max_tiles) | (packs.pt > max_tokens)


def _evict(packs: _Packs, max_tiles: float, max_tokens: float) -> np.ndarray:
    """Take samples out of every pack over a cap until it is under both: per round and pack, the smallest
    sample whose removal suffices, else the one with the largest share of the cap that is exceeded.
    Returns the evicted samples (each fits a pack alone: oversize samples never reach the packer)."""
    evicted = []
    for _ in range(packs.slots.shape[1]):
        over = np.flatnonzero(_over(packs, max_tiles, max_tokens))
        if len(over) == 0:
            break
        s = packs.slots[over]
        used = s < packs.n
        v, t = packs.vv[s], packs.tt[s]
        need_v = (packs.pv[over] - max_tiles)[:, None]
        need_t = (packs.pt[over] - max_tokens)[:, None]
        size = v / max(max_tiles, 1) + t / max(max_tokens, 1)
        suffices = used & (v >= need_v) & (t >= need_t)
        share = np.where(need_t > 0, t / max(max_tokens, 1), 0.0) + np.where(need_v > 0, v / max(max_tiles, 1), 0.0)
        pick = np.where(suffices.any(1), np.argmin(np.where(suffices, size, np.inf), axis=1),
                        np.argmax(np.where(used, share, -np.inf), axis=1))
        out = s[np.arange(len(over)), pick]
        packs.slots[over, pick] = packs.n
        packs.pv[over] -= packs.vv[out]
        packs.pt[over] -= packs.tt[out]
        packs.pl[over] -= packs.ll[out]
        evicted.append(out)
    return np.concatenate(evicted) if evicted else np.zeros(0, np.int64)


def _next_fit_largest_first(packs: _Packs, items: np.ndarray, max_tiles: float, max_tokens: float,
                            max_items: int):
    """A valid packing of ``items`` alone (next-fit, largest first; each item fits a pack alone), with at
    most ``max_items`` per pack (a pack of many small samples would widen every exchange it takes part
    in): (items in pack order, pack start positions)."""
    size = packs.vv[items] / max(max_tiles, 1) + packs.tt[items] / max(max_tokens, 1)
    order = items[np.argsort(-size, kind="stable")]
    starts = next_fit(packs.vv[order], packs.tt[order], max_tiles, max_tokens)
    # cut longer packs into pieces of max_items (parts of a pack under the caps are under them too)
    sizes = np.diff(np.append(starts, len(order)))
    pieces = -(-sizes // max_items)
    first = np.repeat(starts, pieces)
    piece = np.arange(len(first)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    return order, first + piece * max_items


def _add_packs(packs: _Packs, order: np.ndarray, starts: np.ndarray, count: int) -> _Packs:
    """``count`` new packs after the others, the first ``len(starts)`` holding ``order`` cut at ``starts``
    (a valid packing); the rest start empty (the tile repair fills them)."""
    assert len(starts) <= count, (len(starts), count)
    sizes = np.diff(np.append(starts, len(order)))
    width = max(packs.slots.shape[1], int(sizes.max(initial=0)) + 3)
    new = np.full((count, width), packs.n, np.int64)
    new[np.repeat(np.arange(len(starts)), sizes), np.arange(len(order)) - np.repeat(starts, sizes)] = order
    old = np.concatenate([packs.slots, np.full((len(packs.slots), width - packs.slots.shape[1]), packs.n)], axis=1)
    return _Packs(np.concatenate([old, new]), packs.vv[:-1], packs.tt[:-1], packs.ll[:-1])


def _fill_empty(packs: _Packs, rng) -> None:
    """Move one sample into every empty pack from the packs with the most samples (a sample alone always
    fits; a pack that loses one stays under the caps), so no micro-batch is empty."""
    while True:
        count = (packs.slots < packs.n).sum(1)
        empty = np.flatnonzero(count == 0)
        if len(empty) == 0:
            return
        donors = np.argsort(-count + rng.random(len(count)) * 0.5)[: len(empty)]
        donors = donors[count[donors] >= 2]
        assert len(donors), "more packs than samples reached the packer"
        empty = empty[: len(donors)]
        d_slot = np.argmax(packs.slots[donors] < packs.n, axis=1)
        e_slot = np.zeros(len(empty), np.int64)
        packs.apply(donors, empty, d_slot[:, None], e_slot[:, None])


def _growing_is_cheaper(packs: _Packs, max_tiles, max_tokens, pack_step: int) -> bool:
    """Derived caps: would a buffer grown to the packs over it pad less than one more step of packs?"""
    grow = (max(float(packs.pv.max()) / max(max_tiles, 1) - 1, 0)
            + max(float(packs.pt.max()) / max(max_tokens, 1) - 1, 0))
    return grow <= 2 * pack_step / len(packs.pv)  # a step more empties both buffers by pack_step / P


def _enforce_caps(packs: _Packs, v, t, lc, *, max_tiles, max_tokens, hard_caps, pack_step, max_packs, llm_tol,
                  rng, max_passes) -> tuple[_Packs, int]:
    """Phase 4, the rule for the tail: packs the exchange left over a cap give up samples (``_evict``);
    those go to whole new steps of packs (``pack_step`` packs each), and the exchange phases run again
    with the caps hard, which spreads the new packs' room over all. With derived caps (``hard_caps``
    False) the buffer instead grows to the packs over it when that pads less than a step of new packs
    (a few packs a little over); never for outliers far over. Returns (packs, exchange passes)."""
    if not _over(packs, max_tiles, max_tokens).any():
        return packs, 0
    p_old = len(packs.pv)
    if not hard_caps and _growing_is_cheaper(packs, max_tiles, max_tokens, pack_step):
        return packs, 0
    snapshot = packs.slots.copy(), packs.pv.copy(), packs.pt.copy(), packs.pl.copy()
    items = _evict(packs, max_tiles, max_tokens)
    order, starts = _next_fit_largest_first(packs, items, max_tiles, max_tokens,
                                            max_items=int(np.ceil(len(v) / p_old)) + 1)
    p_new = p_old + -(-len(starts) // pack_step) * pack_step
    if p_new > max_packs:  # no room for more packs (fewer samples than slots): the caller reports it
        packs.slots, packs.pv, packs.pt, packs.pl = snapshot
        return packs, 0
    packs = _add_packs(packs, order, starts, p_new - p_old)
    _fill_empty(packs, rng)
    targets = _Targets.of(v, t, lc, p_new, max_tiles, max_tokens, llm_tol, hard=True)
    passes = _repair_tiles(packs, targets, rng) + _level_llm(packs, targets, rng, max_passes)
    return packs, passes


def pack_balanced(
    tiles: np.ndarray,
    tokens: np.ndarray,
    llm_cost: np.ndarray,
    *,
    num_packs: int,
    max_tiles: int,
    max_tokens: int,
    rng: np.random.Generator,
    llm_tol: float | None = DEFAULT_LLM_TOL,
    max_passes: int = 24,
    pack_step: int = 1,
    max_packs: int | None = None,
    hard_caps: bool = True,
) -> PackResult:
    """Split samples into at least ``num_packs`` packs under the (``max_tiles``, ``max_tokens``) buffer with
    tile counts in ``[floor(V/P), max_tiles]`` and LLM costs levelled (see the module docstring).

    ``llm_tol``: the relative band around the mean LLM cost the levelling aims at (None: only the token
    cap). Packs still over a cap after the exchange give up samples to ``pack_step`` more packs at a time
    (at most ``max_packs`` in all); only when that bound stops it are packs left over the caps, for the
    caller to detect. ``hard_caps`` False (caps derived by the cap search, not a budget): packs a little
    over are kept when growing the buffer to them pads less (see ``_enforce_caps``). Every sample must
    fit a pack alone.
    """
    n, p = len(tiles), int(num_packs)
    max_packs = n if max_packs is None else int(max_packs)
    assert 1 <= p <= max(n, 1) and pack_step >= 1
    v = np.asarray(tiles, np.float64)
    t = np.asarray(tokens, np.float64)
    lc = np.asarray(llm_cost, np.float64)
    packs = _Packs(_deal(v, t, lc, p, max_tiles, max_tokens, rng), v, t, lc)
    targets = _Targets.of(v, t, lc, p, max_tiles, max_tokens, llm_tol)
    passes_tiles = _repair_tiles(packs, targets, rng)
    passes_llm = _level_llm(packs, targets, rng, max_passes)
    packs, passes_rescue = _enforce_caps(packs, v, t, lc, max_tiles=max_tiles, max_tokens=max_tokens,
                                         hard_caps=hard_caps, pack_step=pack_step, max_packs=max_packs,
                                         llm_tol=llm_tol, rng=rng,
                                         max_passes=max_passes)
    return PackResult(pack_of=packs.pack_of(), tiles=packs.pv, tokens=packs.pt, llm=packs.pl,
                      passes=(passes_tiles, passes_llm, passes_rescue))
