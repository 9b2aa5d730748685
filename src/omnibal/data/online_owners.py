"""Owner-aware dispatch for online post-balancing: keep samples on the DP rank that drew them.

:func:`omnibal.data.online.balance_phases` deals the LLM phase into ``dp_size`` bins of similar cost and the
vision phase tile by tile. Which LLM bin runs on which rank does not change any load, and neither does
exchanging two samples of identical LLM cost between bins, so both are free to choose; and every tile costs
the encoder the same, so which tiles fill a rank's quota is free too. This module chooses them to minimise
the bytes the step's all-to-alls move (a tile's pixels from the rank that drew its sample to its vision
owner, a sample's token ids and labels to its LLM owner, a tile's visual features from its vision owner to
its sample's LLM owner). Placement changes no vision load and, of the owner-blind LLM bins, no LLM load
(the loads are permuted); an offered alternative changes the LLM loads but never for a worse max/mean.

Steps (all deterministic, so every rank computes the same dispatch):

1. LLM bins to ranks: a maximum-weight matching of bins to ranks, the weight of (bin, rank) being the bytes
   of the bin's samples drawn by that rank (token ids and labels, and the pixels, which mostly follow the
   LLM owner in step 3);
2. samples of equal LLM cost exchange bins where that keeps more of them on the rank that drew them;
3. tiles to vision ranks (:func:`deal_tiles`): each rank's quota is filled first with tiles of its own LLM
   samples (their features then stay), then with tiles it drew (their pixels stay), then with what is left.

The caller may offer other LLM assignments that balance no worse (:func:`omnibal.data.online.balance_phases`
offers one built from the owners outwards); the placement that moves the fewest bytes wins, and the
owner-blind one is kept where none moves fewer bytes without moving more samples. The result therefore never
moves more bytes nor more samples than the owner-blind dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal.errors import InputError


@dataclass(frozen=True, kw_only=True)
class TransferBytes:
    """Bytes one unit of each payload occupies on the wire (what the dispatch weighs moves by)."""

    pixel_tile: float = 3 * 448 * 448 * 2.0
    """One image tile's pixels (channels x side x side x element size)."""
    token: float = 16.0
    """One token's id and label (both int64 in the trainer)."""
    feature_tile: float = 256 * 6144 * 2.0
    """One tile's visual features after the projector (tokens per tile x LLM width x element size)."""

    @classmethod
    def of(cls, *, image_size: int, tokens_per_tile: int, hidden: int, element_bytes: int) -> TransferBytes:
        """A model's payloads: 3-channel ``image_size`` tiles and ``tokens_per_tile`` features of width ``hidden``
        per tile, both as ``element_bytes`` elements; token ids and labels as int64."""
        return cls(pixel_tile=3.0 * image_size**2 * element_bytes,
                   feature_tile=float(tokens_per_tile) * hidden * element_bytes)

    def __post_init__(self) -> None:
        for name in ("pixel_tile", "token", "feature_tile"):
            if not float(getattr(self, name)) >= 0:
                raise InputError(f"{name} must be >= 0 bytes, got {getattr(self, name)!r}",
                                 source="transfer bytes", field=name)


def tile_positions(tiles) -> np.ndarray:
    """Position of every tile of a gathered batch, tiles in position order (position ``p`` owns the next
    ``tiles[p]``)."""
    t = np.asarray(tiles, np.int64)
    return np.repeat(np.arange(len(t)), t)


def moved_bytes(owner, v_tile, l_own, tiles, tokens, transfer: TransferBytes | None = None) -> dict:
    """Bytes and samples one step moves: ``pixels`` (data owner -> vision owner, per tile), ``tokens`` (data
    owner -> LLM owner), ``features`` (vision owner -> LLM owner, one way, per tile), their ``total`` and
    ``samples`` (positions with a tile or the LLM phase off the rank that drew them). ``v_tile``: the vision
    rank of every tile (:func:`tile_positions` order)."""
    tb = transfer or TransferBytes()
    owner, v_tile, l_own = (np.asarray(a, np.int64) for a in (owner, v_tile, l_own))
    pos = tile_positions(tiles)
    k = np.asarray(tokens, np.float64)
    pixel_moved = owner[pos] != v_tile
    feature_moved = v_tile != l_own[pos]
    pix = float(pixel_moved.sum() * tb.pixel_tile)
    tok = float((k * tb.token)[owner != l_own].sum())
    feat = float(feature_moved.sum() * tb.feature_tile)
    off = (owner != l_own) | (np.bincount(pos[pixel_moved], minlength=len(owner)) > 0)
    return {"pixels": pix, "tokens": tok, "features": feat, "total": pix + tok + feat, "samples": int(off.sum())}


def tile_quota(num_tiles: int, dp: int, demand: np.ndarray) -> np.ndarray:
    """Tiles per vision rank: ``num_tiles // dp`` each, one more for the ``num_tiles % dp`` ranks whose LLM
    samples hold the most tiles (ties: the lower rank), so the extra tiles need not travel."""
    quota = np.full(dp, num_tiles // dp, np.int64)
    quota[np.lexsort((np.arange(dp), -np.asarray(demand)))[: num_tiles % dp]] += 1
    return quota


def deal_tiles(tiles, l_own, owner, dp: int) -> np.ndarray:
    """Vision rank of every tile (:func:`tile_positions` order): each rank gets its :func:`tile_quota` of
    tiles (every tile costs the encoder the same), first tiles of its own LLM samples, then tiles of samples
    it drew (``owner``; None: unknown), then the rest in position order. Vectorised: no loop over tiles."""
    pos = tile_positions(tiles)
    l_tile = np.asarray(l_own, np.int64)[pos]
    d_tile = l_tile if owner is None else np.asarray(owner, np.int64)[pos]
    n = len(pos)
    quota = tile_quota(n, dp, np.bincount(l_tile, minlength=dp))
    v_tile = np.full(n, -1, np.int64)
    # 1. stay with the LLM owner, tiles it also drew first
    order = np.lexsort((np.arange(n), d_tile != l_tile, l_tile))
    _fill(v_tile, order, l_tile[order], quota)
    # 2. stay with the rank that drew them
    left = np.flatnonzero(v_tile < 0)
    room = quota - np.bincount(v_tile[v_tile >= 0], minlength=dp)
    order = left[np.lexsort((left, d_tile[left]))]
    _fill(v_tile, order, d_tile[order], room)
    # 3. the rest, in position order, into the ranks with room left, lowest rank first
    left = np.flatnonzero(v_tile < 0)
    room = quota - np.bincount(v_tile[v_tile >= 0], minlength=dp)
    v_tile[left] = np.repeat(np.arange(dp), room)
    return v_tile


def _fill(v_tile: np.ndarray, order: np.ndarray, want: np.ndarray, room: np.ndarray) -> None:
    """Give the tiles ``order`` (grouped by the rank each ``want``s, in preference order) to that rank while
    it has ``room``."""
    if not len(order):
        return
    first = np.r_[0, np.flatnonzero(np.diff(want)) + 1]
    rank_in_group = np.arange(len(order)) - np.repeat(first, np.diff(np.r_[first, len(order)]))
    take = rank_in_group < room[want]
    v_tile[order[take]] = want[take]


def keep_on_owners(l_bin, owner, tiles, tokens, llm_cost, transfer: TransferBytes | None = None,
                   alternatives=()) -> tuple[np.ndarray, np.ndarray]:
    """``(vision rank of every tile, LLM rank of every position)`` that move the fewest bytes (module
    docstring). ``l_bin``: the owner-blind LLM bins (ints in ``[0, D)``); ``owner``: the rank that drew each
    position; ``alternatives``: other LLM assignments the caller found no less balanced than ``l_bin``.
    Candidates are the blind dispatch, ``l_bin`` placed by matching and exchange, and the alternatives (each
    with its tiles dealt by :func:`deal_tiles`); the one moving the fewest bytes among those moving no more
    samples than the blind one wins, the blind one on ties."""
    tb = transfer or TransferBytes()
    l_bin, owner = np.asarray(l_bin, np.int64), np.asarray(owner, np.int64)
    dp = int(max(l_bin.max(initial=0), owner.max(initial=0))) + 1
    t = np.asarray(tiles, np.float64)
    k = np.asarray(tokens, np.float64)
    stays = [(k * tb.token + t * tb.pixel_tile, owner)]
    matched = _exchange_equal_cost(_relabel(l_bin, stays, dp), np.asarray(llm_cost), stays, dp)
    best = (deal_tiles(tiles, l_bin, None, dp), l_bin.copy())
    blind = moved_bytes(owner, *best, tiles, tokens, tb)
    best_total = blind["total"]
    for l_own in (matched, *(np.asarray(a, np.int64) for a in alternatives)):
        v_tile = deal_tiles(tiles, l_own, owner, dp)
        moved = moved_bytes(owner, v_tile, l_own, tiles, tokens, tb)
        if moved["samples"] <= blind["samples"] and moved["total"] < best_total:
            best, best_total = (v_tile, l_own), moved["total"]
    return best


def _relabel(bin_of: np.ndarray, terms, dp: int) -> np.ndarray:
    """Rank of every position: bins matched to ranks maximising the bytes that stay (``terms``: pairs of
    per-position bytes and the rank where they already are)."""
    keep = np.zeros((dp, dp))
    for weight, where in terms:
        np.add.at(keep, (bin_of, where), weight)
    rank_of_bin = _max_weight_matching(keep)
    return rank_of_bin[bin_of]


def _exchange_equal_cost(rank_of: np.ndarray, cost: np.ndarray, terms, dp: int) -> np.ndarray:
    """Within each group of positions of identical cost, deal the group's ranks (a multiset: loads stay
    put) to its members, each first to the rank that keeps most of its bytes where they are."""
    out = rank_of.copy()
    _, group = np.unique(cost, return_inverse=True)
    for g in np.flatnonzero(np.bincount(group) > 1):
        members = np.flatnonzero(group == g)
        slots = np.bincount(rank_of[members], minlength=dp)
        gain = np.zeros((len(members), len(slots)))
        for weight, where in terms:
            np.add.at(gain, (np.arange(len(members)), where[members]), weight[members])
        placed = np.full(len(members), -1)
        # best (member, rank) pairs first; ties by member then rank so every rank agrees
        for flat in np.lexsort((np.arange(gain.size), -gain.reshape(-1))):
            i, r = divmod(int(flat), len(slots))
            if gain[i, r] <= 0:
                break
            if placed[i] < 0 and slots[r] > 0:
                placed[i], slots[r] = r, slots[r] - 1
        for i in np.flatnonzero(placed < 0):  # no gain anywhere: the lowest rank with a slot left
            r = int(np.flatnonzero(slots > 0)[0])
            placed[i], slots[r] = r, slots[r] - 1
        before = sum(float(w[members][where[members] == rank_of[members]].sum()) for w, where in terms)
        after = sum(float(w[members][where[members] == placed].sum()) for w, where in terms)
        if after > before:
            out[members] = placed
    return out


def _max_weight_matching(weight: np.ndarray) -> np.ndarray:
    """``col[row]``: a perfect matching of a square matrix's rows to columns of maximum total weight
    (Hungarian method with potentials, O(n^3))."""
    cost = -np.asarray(weight, np.float64)
    n = cost.shape[0]
    u, v = np.zeros(n + 1), np.zeros(n + 1)
    row_of_col = np.zeros(n + 1, np.int64)  # 1-based row matched to each column; column 0 is a sentinel
    for row in range(1, n + 1):
        row_of_col[0] = row
        col = 0
        best = np.full(n + 1, np.inf)
        prev = np.zeros(n + 1, np.int64)
        done = np.zeros(n + 1, bool)
        while row_of_col[col] != 0:
            done[col] = True
            r = row_of_col[col]
            reduced = cost[r - 1] - u[r] - v[1:]
            open_ = ~done[1:]
            better = open_ & (reduced < best[1:])
            best[1:][better] = reduced[better]
            prev[1:][better] = col
            cand = np.where(open_, best[1:], np.inf)
            nxt = int(np.argmin(cand)) + 1
            delta = cand[nxt - 1]
            u[row_of_col[done]] += delta
            v[done] -= delta
            best[~done] -= delta
            col = nxt
        while col:
            row_of_col[col] = row_of_col[prev[col]]
            col = prev[col]
    out = np.empty(n, np.int64)
    out[row_of_col[1:] - 1] = np.arange(n)
    return out
