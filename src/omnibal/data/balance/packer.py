"""omnibal's packer: ``P`` packs whose tile counts are equal (to the integer) and whose LLM costs are equal
(within a small band), all under the (Q_v, Q_t) buffer.

Three vectorised phases, no per-sample Python loop:

1. **Round dealing** (an LPT in rounds): samples sorted by (tiles, LLM cost), largest first, are dealt ``P``
   at a time; in every round the largest sample goes to the pack with the fewest tiles so far (ties: the
   lowest LLM cost). Every pack gets one sample from every size band.
2. **Tile repair**: packs whose tile count is outside ``[floor(V/P), ceil(V/P)]`` (V = total tiles; or
   above a fixed tile cap) are paired with packs on the other side and the single swap or move that brings
   both closest to the range is applied, all pairs at once as ``[pairs, K, K]`` array operations.
3. **LLM levelling**: the same pairwise exchange, restricted to swaps that keep both packs' tile counts in
   range, pulls every pack's LLM cost (and tokens under a fixed token cap) into a band around the mean.
   Pairs are heaviest-with-lightest (sorted), alternating with random pairings so that no pair is tried
   twice in a row; only pairs with a pack outside the band are evaluated, so late passes are cheap.

Exactly-once holds by construction: samples only ever swap slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    passes: tuple[int, int]
    """Exchange passes run in the tile repair and the LLM levelling."""


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

    def exchange(self, a: np.ndarray, b: np.ndarray, objective, group: int = 1) -> int:
        """Apply the best exchange between packs ``a[k]`` and ``b[k]`` (disjoint pairs) when it lowers
        ``objective(pv, pt, pl)`` of the pair: a single swap/move (``group=1``), or any swap of up to two
        samples against up to two (``group=2``, used for the few packs a single swap cannot repair).
        Returns the number of pairs changed."""
        changed = 0
        # only the occupied slots plus one free one matter: compact the rows of this pass's packs
        both = np.concatenate([a, b])
        self.slots[both] = np.sort(self.slots[both], axis=1)  # the empty marker n sorts last
        width = min(self.slots.shape[1], int((self.slots[both] < self.n).sum(1).max()) + 1)
        if group == 1:
            sel = np.arange(width)[:, None]
        else:
            i1, i2 = np.triu_indices(width, 1)
            sel = np.stack([i1, i2], axis=1)  # pairs of slots; an empty slot in a pair makes it a single
        k = len(sel)
        chunk = max(1, _CHUNK_PAIRS * width * width // (k * k))
        for c0 in range(0, len(a), chunk):
            ca, cb = a[c0:c0 + chunk], b[c0:c0 + chunk]
            sa, sb = self.slots[ca, :width], self.slots[cb, :width]
            ga, gb = sa[:, sel], sb[:, sel]  # [h, k, group] sample ids per candidate subset
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
            take = flat[np.arange(len(ca)), best] > 1e-12 * np.maximum(before, 1e-300)
            if not take.any():
                continue
            ca, cb, best = ca[take], cb[take], best[take]
            i, j = sel[best // k], sel[best % k]  # [h, group] slot positions
            x = self.slots[ca[:, None], i]
            y = self.slots[cb[:, None], j]
            self.slots[ca[:, None], i], self.slots[cb[:, None], j] = y, x
            for total, per in ((self.pv, self.vv), (self.pt, self.tt), (self.pl, self.ll)):
                d = per[x].sum(1) - per[y].sum(1)
                total[ca] -= d
                total[cb] += d
            changed += int(take.sum())
        return changed

    def pack_of(self) -> np.ndarray:
        p, width = self.slots.shape
        out = np.empty(self.n, dtype=np.int64)
        used = self.slots < self.n
        out[self.slots[used]] = np.broadcast_to(np.arange(p)[:, None], (p, width))[used]
        return out


def _improve(packs: _Packs, objective, deviation, rng, max_passes: int, group: int = 1) -> int:
    """Pairwise exchange passes until no pack is off (objective 0) or nothing improves for a while."""
    p = len(packs.pv)
    if p < 2:
        return 0
    stale = 0
    passes = 0
    for passes in range(1, max_passes + 1):
        bad = objective(packs.pv, packs.pt, packs.pl) > 0
        if not bad.any():
            break
        if passes % 2:
            srt = np.argsort(deviation(packs.pv, packs.pt, packs.pl) + rng.random(p) * 1e-12, kind="stable")
            first, second = srt[: p // 2], srt[::-1][: p // 2]
        else:
            perm = rng.permutation(p)
            first, second = perm[: p // 2], perm[p // 2: 2 * (p // 2)]
        active = bad[first] | bad[second]
        before = float(objective(packs.pv, packs.pt, packs.pl).sum())
        packs.exchange(first[active], second[active], objective, group)
        after = float(objective(packs.pv, packs.pt, packs.pl).sum())
        # stop after three passes in a row that gain under 1%: what is left needs moves no pair can make
        stale = stale + 1 if after > 0.99 * before else 0
        if stale >= 3:
            break
    return passes


def _deal(v, t, lc, p, max_tiles, max_tokens, rng) -> np.ndarray:
    """LPT in rounds: each round pairs the largest pending samples with the lightest packs (by tiles, then
    LLM cost); a sample that would overflow its pack's buffer waits for the next round. Whatever still
    does not fit when a round places nothing goes to the lightest packs (the repair phases fix those)."""
    n = len(v)
    order = np.lexsort((rng.random(n), -lc, -v))
    width = -(-n // p) + 4
    slots = np.full((p, width), n, dtype=np.int64)
    count = np.zeros(p, dtype=np.int64)
    load_v, load_t, load_l = np.zeros(p), np.zeros(p), np.zeros(p)
    tie = rng.random(p)
    pending = np.zeros(0, dtype=np.int64)
    nxt = 0
    force = False
    while nxt < n or len(pending):
        take = p - len(pending)
        items = np.concatenate([pending, order[nxt:nxt + take]])
        nxt += max(take, 0)
        items = items[np.lexsort((lc[items], v[items]))[::-1]]  # largest first
        packs = np.lexsort((tie, load_l, load_v))[: len(items)]
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
        force = len(packs) == 0 and nxt >= n  # nothing fits anywhere any more: place, repair later
    need = int(count.max()) + 3  # keep free slots so samples can move between packs
    if slots.shape[1] < need:
        slots = np.concatenate([slots, np.full((p, need - slots.shape[1]), n, dtype=np.int64)], axis=1)
    return slots


def pack_balanced(
    tiles: np.ndarray,
    tokens: np.ndarray,
    llm_cost: np.ndarray,
    *,
    num_packs: int,
    max_tiles: int,
    max_tokens: int,
    rng: np.random.Generator,
    llm_tol: float | None = None,
    max_passes: int = 24,
) -> PackResult:
    """Split samples into ``num_packs`` packs under the (``max_tiles``, ``max_tokens``) buffer with tile
    counts in ``[floor(V/P), ceil(V/P)]`` and LLM costs levelled (see the module docstring).

    ``llm_tol``: when set, also level every pack's LLM cost into this relative band around the mean (not
    needed for balance -- the assignment sorts packs into steps -- and slower). Packs the exchange cannot bring under the caps are left
    for the caller to detect (it raises the cap or adds packs).
    """
    n, p = len(tiles), int(num_packs)
    assert 1 <= p <= max(n, 1)
    v = np.asarray(tiles, np.float64)
    t = np.asarray(tokens, np.float64)
    lc = np.asarray(llm_cost, np.float64)
    mean_v = v.sum() / p
    mean_t = max(t.sum() / p, 1.0)
    mean_l = max(lc.sum() / p, 1e-300)
    tile_lo = min(np.floor(mean_v + 1e-9), float(max_tiles))
    tile_hi = float(max_tiles)
    # Every pack aims at the same LLM cost, also those one tile short: they take the text-heavy samples
    # that would push a full-tile pack over the token cap, which is exactly what fills both buffers.
    slope = 0.0

    # -- phase 1: round dealing -------------------------------------------------------------------------
    slots = _deal(v, t, lc, p, max_tiles, max_tokens, rng)
    packs = _Packs(slots, v, t, lc)

    def tile_off(pv):
        return np.maximum(pv - tile_hi, 0) + np.maximum(tile_lo - pv, 0)

    def token_over(pt):
        return np.maximum(pt - max_tokens, 0) / mean_t

    # -- phase 2: tile repair (LLM deviation only as a faint tie-break) ----------------------------------
    def tile_objective(pv, pt, pl):
        off = tile_off(pv)
        return off * off + 1e-6 * ((pl - mean_l) / mean_l) ** 2 * (off > 0)

    def tile_deviation(pv, pt, pl):
        # continuous, so a pack over the range meets one at the low end of it (not one just inside)
        return pv - mean_v

    passes_tiles = _improve(packs, tile_objective, tile_deviation, rng, 8)
    if (tile_off(packs.pv) > 0).any():
        passes_tiles += _improve(packs, tile_objective, tile_deviation, rng, max_passes, group=2)

    # -- phase 3: token cap + LLM levelling, tiles kept in range ---------------------------------------
    def llm_dev(pv, pl):
        return (pl - mean_l - slope * (pv - mean_v)) / mean_l

    def llm_objective(pv, pt, pl):
        over = token_over(pt)
        g = 1e6 * tile_off(pv) ** 2 + over * over
        if llm_tol is not None:
            band = np.maximum(np.abs(llm_dev(pv, pl)) - llm_tol, 0)
            g = g + 0.01 * band * band
        return g

    def llm_deviation(pv, pt, pl):
        return llm_dev(pv, pl) + 10.0 * token_over(pt)

    passes_llm = _improve(packs, llm_objective, llm_deviation, rng, max_passes)
    if (llm_objective(packs.pv, packs.pt, packs.pl) > 0).any():
        passes_llm += _improve(packs, llm_objective, llm_deviation, rng, max_passes, group=2)
    return PackResult(pack_of=packs.pack_of(), tiles=packs.pv, tokens=packs.pt, llm=packs.pl,
                      passes=(passes_tiles, passes_llm))
