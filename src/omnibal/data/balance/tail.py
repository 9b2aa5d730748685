"""The packer's tail rule (phase 4 of :mod:`omnibal.data.balance.packer`): packs still over a cap give up
samples -- per pack the smallest one whose removal suffices -- to whole new steps of packs, and the exchange runs
again with the caps hard, so a fixed buffer always holds whatever the caps, as long as every sample fits alone."""

from __future__ import annotations

import numpy as np

from omnibal.data.balance.common import sorted_order, tie_break
from omnibal.data.balance.exchange import Packs, Targets, level_llm, repair_tiles
from omnibal.data.balance.isf import next_fit
from omnibal.data.balance.layers import level_tokens

GROW_MARGIN = 0.003
"""Derived caps: pad (both buffers together) the new steps must save over growing the buffer, since they
cost a second repair and levelling of every pack."""


def _over(packs: Packs, max_tiles: float, max_tokens: float) -> np.ndarray:
    return (packs.pv > max_tiles) | (packs.pt > max_tokens)


def _evict(packs: Packs, max_tiles: float, max_tokens: float) -> np.ndarray:
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


def _next_fit_largest_first(packs: Packs, items: np.ndarray, max_tiles: float, max_tokens: float,
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


def _add_packs(packs: Packs, order: np.ndarray, starts: np.ndarray, count: int) -> Packs:
    """``count`` new packs after the others, the first ``len(starts)`` holding ``order`` cut at ``starts``
    (a valid packing); the rest start empty (the tile repair fills them)."""
    assert len(starts) <= count, (len(starts), count)
    sizes = np.diff(np.append(starts, len(order)))
    width = max(packs.slots.shape[1], int(sizes.max(initial=0)) + 3)
    new = np.full((count, width), packs.n, np.int64)
    new[np.repeat(np.arange(len(starts)), sizes), np.arange(len(order)) - np.repeat(starts, sizes)] = order
    old = np.concatenate([packs.slots, np.full((len(packs.slots), width - packs.slots.shape[1]), packs.n)], axis=1)
    return Packs(np.concatenate([old, new]), packs.vv[:-1], packs.tt[:-1], packs.ll[:-1])


def _fill_empty(packs: Packs, rng) -> None:
    """Move one sample into every empty pack from the packs with the most samples (a sample alone always
    fits; a pack that loses one stays under the caps), so no micro-batch is empty."""
    while True:
        count = (packs.slots < packs.n).sum(1)
        empty = np.flatnonzero(count == 0)
        if len(empty) == 0:
            return
        # the fullest packs first, equal counts in a random order (lexsort is stable: the same on every machine)
        donors = np.lexsort((rng.permutation(len(count)), -count))[: len(empty)]
        donors = donors[count[donors] >= 2]
        assert len(donors), "more packs than samples reached the packer"
        empty = empty[: len(donors)]
        d_slot = np.argmax(packs.slots[donors] < packs.n, axis=1)
        e_slot = np.zeros(len(empty), np.int64)
        packs.apply(donors, empty, d_slot[:, None], e_slot[:, None])


def _reinsert(packs: Packs, items: np.ndarray, max_tiles: float, max_tokens: float, rng, rounds: int = 4):
    """Put evicted samples into packs that still have room for them under both caps, largest first into the
    roomiest packs, a round at a time (each pack takes at most one sample a round); returns those left."""
    if len(items) == 0:
        return items
    if (packs.slots[:, -1] < packs.n).any():  # a free column for every pack
        packs.slots = np.concatenate([packs.slots, np.full((len(packs.pv), 1), packs.n)], axis=1)
    size = packs.vv[items] / max(max_tiles, 1) + packs.tt[items] / max(max_tokens, 1)
    items = items[sorted_order(size, tie_break(len(items), rng), descending=True)]
    for _ in range(rounds):
        room = np.minimum(max_tiles - packs.pv, (max_tokens - packs.pt) * (max_tiles / max(max_tokens, 1)))
        free = packs.slots[:, -1] >= packs.n
        open_ = np.flatnonzero((room > 0) & free)
        if len(open_) == 0 or len(items) == 0:
            break
        open_ = open_[sorted_order(room[open_], tie_break(len(open_), rng), descending=True)][: len(items)]
        take = items[: len(open_)]
        fits = (packs.pv[open_] + packs.vv[take] <= max_tiles) & (packs.pt[open_] + packs.tt[take] <= max_tokens)
        rows, placed = open_[fits], take[fits]
        col = np.argmax(packs.slots[rows] >= packs.n, axis=1)
        packs.slots[rows, col] = placed
        packs.pv[rows] += packs.vv[placed]
        packs.pt[rows] += packs.tt[placed]
        packs.pl[rows] += packs.ll[placed]
        if not fits.any():
            break
        items = np.concatenate([take[~fits], items[len(open_):]])
    return items


def _grow_cost(packs: Packs, max_tiles, max_tokens) -> float:
    """What growing the buffer to the packs over it adds to the two pads (relative growth of each cap)."""
    return (max(float(packs.pv.max()) / max(max_tiles, 1) - 1, 0)
            + max(float(packs.pt.max()) / max(max_tokens, 1) - 1, 0))


def enforce_caps(packs: Packs, v, t, lc, *, max_tiles, max_tokens, hard_caps, pack_step, max_packs, llm_tol,
                 rng, max_passes) -> tuple[Packs, int]:
    """Phase 4, the rule for the tail: packs the exchange left over a cap give up samples (``_evict``);
    those go to whole new steps of packs (``pack_step`` packs each), and the exchange phases run again
    with the caps hard, which spreads the new packs' room over all. With derived caps (``hard_caps``
    False) the buffer instead grows to the packs over it when that pads less than the new steps would
    (each empties both buffers by its share of the packs). Returns (packs, exchange passes)."""
    if not _over(packs, max_tiles, max_tokens).any():
        return packs, 0
    p_old = len(packs.pv)
    grow = _grow_cost(packs, max_tiles, max_tokens)
    snapshot = packs.slots.copy(), packs.pv.copy(), packs.pt.copy(), packs.pl.copy()
    items = _reinsert(packs, _evict(packs, max_tiles, max_tokens), max_tiles, max_tokens, rng)
    if len(items) == 0:  # the packs with room took every evicted sample: no new pack, nothing to re-level
        level_tokens(packs, rng, passes=1)
        return packs, 0
    order, starts = _next_fit_largest_first(packs, items, max_tiles, max_tokens,
                                            max_items=int(np.ceil(len(v) / p_old)) + 1)
    p_new = p_old + -(-len(starts) // pack_step) * pack_step
    # the new steps must save more than GROW_MARGIN of pad to be worth re-levelling every pack for
    cheaper_to_grow = not hard_caps and grow <= 2 * (p_new - p_old) / p_new + GROW_MARGIN
    if p_new > max_packs or cheaper_to_grow:  # no room for more packs (the caller reports it), or growing pads less
        packs.slots, packs.pv, packs.pt, packs.pl = snapshot
        return packs, 0
    packs = _add_packs(packs, order, starts, p_new - p_old)
    _fill_empty(packs, rng)
    targets = Targets.of(v, t, lc, p_new, max_tiles, max_tokens, llm_tol, hard=True)
    passes = repair_tiles(packs, targets, rng)
    level_tokens(packs, rng)
    passes += level_llm(packs, targets, rng, max_passes)
    level_tokens(packs, rng)
    return packs, passes
