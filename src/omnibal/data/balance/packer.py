"""omnibal's packer: ``P`` packs whose tile counts are equal (to the integer) and whose tokens and LLM costs are
level, all under the (Q_v, Q_t) buffer.

Vectorised phases, no per-sample Python loop:

1. **Round dealing** (an LPT in rounds): samples sorted by (tiles, LLM cost), largest first, are dealt ``P``
   at a time; in every round the largest sample goes to the pack with the fewest tiles so far (ties: the
   lowest LLM cost). Every pack gets one sample from every size band.
2. **Tile repair** (``exchange.repair_tiles``): packs whose tile count is outside ``[floor(V/P), ceil(V/P)]``
   (V = total tiles; never above the tile cap; under it only by as many tiles as the pack's token room
   holds) are paired with packs on the other side and the best swap or move of up to two samples is applied,
   all pairs at once as ``[pairs, K, K]`` array operations.
3. **Token levelling by layers** (``layers.level_tokens``): samples trade places only with samples of their
   own tile count, a layer at a time, largest into the lowest packs: tile counts never move, the largest pack
   and the spread only fall. Ties go by the LLM cost, which levels with the tokens.
4. **LLM levelling** (``exchange.level_llm``): the pairwise exchange again, tile counts kept under the cap,
   until no pack is over the token cap (a text-heavy sample may cost its pack tiles); then the layers again.
5. **The tail** (``tail.enforce_caps``): packs still over a cap give up samples -- per pack the smallest one
   whose removal suffices -- to packs with room, and what is left to whole new steps of packs; then phases
   2-4 run again with the caps hard (every pack starts under them and no exchange may bring one over). So a
   fixed buffer always holds, whatever the caps, as long as every sample fits alone and there are enough
   samples for the packs. With derived caps a buffer grown to the packs over it is kept instead when that
   pads less than the new steps would; outliers far over never set it.

Every exchange phase runs within a ``phases.WorkBudget`` (bounded work on any input). Exactly-once holds by
construction: samples only ever change slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal.data.balance.common import sorted_order, tie_break
from omnibal.data.balance.cost import to_grid
from omnibal.data.balance.exchange import Packs, Targets, level_llm, repair_tiles
from omnibal.data.balance.layers import level_tokens
from omnibal.data.balance.phases import phase
from omnibal.data.balance.squeeze import squeeze_tokens
from omnibal.data.balance.tail import enforce_caps

DEFAULT_LLM_TOL = 0.01
"""Default band (relative to the mean) the LLM levelling pulls every pack's LLM cost into."""


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
    """LLM cost per pack (per-sample part), in the units of the integer grid the packer puts it on."""
    passes: tuple[int, int, int]
    """Exchange passes run in the tile repair, the LLM levelling and after the tail's new packs."""


_DEAL_ROUNDS_PER_PACKFUL = 4
"""Dealing rounds per ``ceil(n / p)`` before every round is forced (see ``_deal``)."""


def _deal(v, t, lc, p, max_tiles, max_tokens, rng) -> np.ndarray:
    """LPT in rounds: each round pairs the largest pending samples with the lightest packs (by tiles, then
    LLM cost); a sample that would overflow its pack's buffer waits for the next round. Whatever still
    does not fit when a round places nothing goes to the lightest packs (the repair phases fix those)."""
    n = len(v)
    # one float key per sort (a lexsort of three keys is slower): tiles first, LLM cost as the tie-break
    lc_unit = lc / max(float(lc.max()), 1e-300) * 0.45
    item_key = v + lc_unit
    # text-heavy samples (far more of the token buffer than of the tile buffer) are dealt by their token
    # share: dealt last by tiles, they would find no pack with token room left
    share_v = v / max(max_tiles, 1)
    share_t = t / max(max_tokens, 1)
    heavy = share_t > 2.0 * share_v + 0.1
    item_key = np.where(heavy, share_t * max_tiles + 0.45, item_key)
    # largest first, equal samples in a random order; distinct keys sort alike on every machine
    order = sorted_order(item_key, tie_break(n, rng), descending=True)
    width = -(-n // p) + 4
    slots = np.full((p, width), n, dtype=np.int64)
    count = np.zeros(p, dtype=np.int64)
    load_v, load_t, load_l = np.zeros(p), np.zeros(p), np.zeros(p)
    pack_rank = tie_break(p, rng)  # packs of equal load: a random order, fixed for the deal
    l_scale = 0.45 / max(float(lc.sum()) / p * 1.5, 1e-300)
    pending = np.zeros(0, dtype=np.int64)
    nxt = 0
    force = False
    # Progress: a round places a sample, or reads a new one, or (placing and reading nothing) forces the
    # next round, which places everything it holds. So there are at most 3n rounds; asserted below. Work:
    # each round sorts the packs, so after ``_DEAL_ROUNDS_PER_PACKFUL`` rounds per packful of samples every
    # later round is forced (it places all it holds): O((n + p) log p) whatever the caps.
    max_rounds = 3 * n + 3
    force_after = _DEAL_ROUNDS_PER_PACKFUL * -(-n // p) + 16
    rounds = 0
    while nxt < n or len(pending):
        rounds += 1
        assert rounds <= max_rounds, f"_deal made no progress in {max_rounds} rounds ({n} samples, {p} packs)"
        take = p - len(pending)
        # largest first: ``order`` is, and the pending samples were read from it before the new ones
        items = np.concatenate([pending, order[nxt:nxt + take]])
        nxt += max(take, 0)
        # tiles first, but a pack whose tokens are further along than its tiles counts as that full
        dominant = np.maximum(load_v, load_t / max(max_tokens, 1) * max_tiles)
        pack_key = dominant + np.minimum(load_l * l_scale, 0.45)
        packs = sorted_order(pack_key, pack_rank)[: len(items)]
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
        force = stalled or (nxt >= n and len(packs) <= max(len(items) // 20, 0)) or rounds >= force_after
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
    llm_tol: float | None = DEFAULT_LLM_TOL,
    max_passes: int = 24,
    pack_step: int = 1,
    max_packs: int | None = None,
    hard_caps: bool = True,
    squeeze: bool = False,
) -> PackResult:
    """Split samples into at least ``num_packs`` packs under the (``max_tiles``, ``max_tokens``) buffer with
    tile counts in ``[floor(V/P), max_tiles]`` and LLM costs levelled (see the module docstring).

    ``llm_tol``: the relative band around the mean LLM cost the levelling aims at (None: only the token
    cap). Packs still over a cap after the exchange give up samples to ``pack_step`` more packs at a time
    (at most ``max_packs`` in all); only when that bound stops it are packs left over the caps, for the
    caller to detect. ``hard_caps`` False (caps derived by the cap search, not a budget): packs a little
    over are kept when growing the buffer to them pads less (see ``enforce_caps``). Every sample must
    fit a pack alone. ``squeeze`` (with ``hard_caps`` False): phase 6, which costs up to six more LLM
    levellings. The LLM costs are put on an integer grid (``cost.to_grid``: costs already on one
    are only scaled by a power of two), so that the packs' sums, and every decision on them, are exact.
    """
    n, p = len(tiles), int(num_packs)
    max_packs = n if max_packs is None else int(max_packs)
    assert 1 <= p <= max(n, 1) and pack_step >= 1
    v = np.asarray(tiles, np.float64)
    t = np.asarray(tokens, np.float64)
    lc = to_grid(llm_cost)  # integers: every pack's sum exact, the same on every machine
    with phase("deal"):
        packs = Packs(_deal(v, t, lc, p, max_tiles, max_tokens, rng), v, t, lc)
    targets = Targets.of(v, t, lc, p, max_tiles, max_tokens, llm_tol)
    with phase("tile_repair"):
        passes_tiles = repair_tiles(packs, targets, rng)
    with phase("token_levelling"):
        level_tokens(packs, rng)
    with phase("llm_levelling"):
        passes_llm = level_llm(packs, targets, rng, max_passes)
        level_tokens(packs, rng)
    with phase("tail"):
        packs, passes_rescue = enforce_caps(packs, v, t, lc, max_tiles=max_tiles, max_tokens=max_tokens,
                                            hard_caps=hard_caps, pack_step=pack_step, max_packs=max_packs,
                                            llm_tol=llm_tol, rng=rng, max_passes=max_passes)
    if squeeze and not hard_caps:
        with phase("squeeze"):
            squeeze_tokens(packs, v, t, lc, max_tiles=max_tiles, llm_tol=llm_tol, rng=rng, max_passes=max_passes)
    return PackResult(pack_of=packs.pack_of(), tiles=packs.pv, tokens=packs.pt, llm=packs.pl,
                      passes=(passes_tiles, passes_llm, passes_rescue))
