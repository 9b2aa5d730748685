"""Token levelling by layers: samples trade places only with samples of their own tile count, so every pack keeps
its tiles, and each trade is the best one for a whole layer at once.

A *layer* is one slot of one tile count ``s`` in every pack that holds at least ``j`` samples of ``s`` tiles
(its ``j``-th such slot). With every other slot fixed, the pack ``k`` of the layer is at ``r_k`` (its tokens
without the layer's sample), and putting the layer's samples back largest-first into the packs lowest-first
minimises both the largest ``r_k + t`` and the sum of squares of the packs' tokens (the rearrangement
inequality: one sample per pack, opposite orders). Re-dealing layer after layer is therefore a block
coordinate descent that never raises the largest pack nor the spread: O(N log N) per pass, all numpy, the
only Python loop over the layers (a few dozen). The text-heavy samples go to the packs one tile short by
themselves (those packs' tokens are lower by a tile's worth).

Ties (equal tokens) are broken by the LLM cost, in the same opposite orders, and then by a seeded rank
(``common.distinct_keys``): the same order on every machine.
"""

from __future__ import annotations

import numpy as np

from omnibal.data.balance.common import sorted_order, stable_order, tie_break


def _layers(packs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pack, slot, layer bounds) of every occupied slot, sorted by layer; a layer is (tile count, j). Samples
    only trade places inside a layer, so a slot keeps its layer: computed once per levelling."""
    p, width = packs.slots.shape
    used = packs.slots < packs.n
    flat = np.flatnonzero(used.ravel())  # row-major: by pack, then slot
    pack, slot = np.divmod(flat, width)
    tiles = packs.vv[packs.slots.ravel()[flat]].astype(np.int64)
    tiles -= tiles.min(initial=0)
    # one int64 key (tile count, pack, slot): distinct, so any sort gives the same order
    key = (tiles * p + pack) * width + slot
    order = stable_order(key)  # distinct keys: any sort gives this order
    pack, slot, tiles = pack[order], slot[order], tiles[order]
    start = np.ones(len(order), bool)
    start[1:] = (tiles[1:] != tiles[:-1]) | (pack[1:] != pack[:-1])
    run_start = np.maximum.accumulate(np.where(start, np.arange(len(order)), 0))
    j = np.arange(len(order)) - run_start  # the j-th sample of its tile count in its pack
    layer = tiles * (int(j.max(initial=0)) + 1) + j
    by_layer = stable_order(layer)
    layer = layer[by_layer]
    bounds = np.r_[0, np.flatnonzero(np.diff(layer)) + 1, len(layer)]
    return pack[by_layer], slot[by_layer], bounds


def _key(tokens: np.ndarray, llm: np.ndarray, llm_scale: float) -> np.ndarray:
    """Tokens, and the LLM cost as the tie-break inside one token (``llm_scale``: above every LLM cost)."""
    return tokens + 0.5 * (llm / llm_scale)


def level_tokens(packs, rng, passes: int = 3) -> int:
    """Re-deal every layer (module docstring) ``passes`` times, or until a pass moves nothing; returns the
    passes run. Tile counts never change."""
    if len(packs.pv) < 2 or packs.n == 0:
        return 0
    llm_scale = max(float(packs.pl.max()), float(packs.ll.max()), 1e-300) * 2.0
    pack, slot, bounds = _layers(packs)
    spans = [(lo, hi) for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()) if hi - lo >= 2]
    top = float(packs.pt.max())
    for done in range(1, passes + 1):
        moved = 0
        for lo, hi in spans:
            moved += _redeal(packs, pack[lo:hi], slot[lo:hi], llm_scale, rng)
        # a pass that no longer lowers the largest pack by a thousandth ends the levelling
        if moved == 0 or float(packs.pt.max()) > top * 0.999:
            return done
        top = float(packs.pt.max())
    return passes


def _redeal(packs, pack: np.ndarray, slot: np.ndarray, llm_scale: float, rng) -> int:
    """One layer: its samples largest first into its packs lowest first (each pack one slot of the layer)."""
    sample = packs.slots[pack, slot]
    t, lc = packs.tt[sample], packs.ll[sample]
    rest_t, rest_l = packs.pt[pack] - t, packs.pl[pack] - lc
    m = len(pack)
    ties = tie_break(m, rng)
    by_rest = sorted_order(_key(rest_t, rest_l, llm_scale), ties)
    by_size = sorted_order(_key(t, lc, llm_scale), ties, descending=True)
    new = np.empty(m, np.int64)
    new[by_rest] = sample[by_size]
    changed = new != sample
    if not changed.any():
        return 0
    packs.slots[pack, slot] = new
    packs.pt[pack] = rest_t + packs.tt[new]
    packs.pl[pack] = rest_l + packs.ll[new]
    return int(changed.sum())
