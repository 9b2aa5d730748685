"""Owner-aware dispatch for online post-balancing: keep samples on the DP rank that drew them.

:func:`omnibal.data.online.balance_phases` deals each phase into ``dp_size`` bins of similar cost. Which
bin runs on which rank does not change any load, and neither does exchanging two samples of identical cost
between bins, so both are free to choose: this module chooses them to minimise the bytes the step's
all-to-alls move (a sample's pixels from the rank that drew it to its vision owner, its token ids and
labels to its LLM owner, its visual features from the vision owner to the LLM owner). The per-rank loads,
hence every max/mean, are exactly those of the owner-blind dispatch; only the placement changes.

Steps (all deterministic, so every rank computes the same dispatch):

1. LLM bins to ranks: a maximum-weight matching of bins to ranks, the weight of (bin, rank) being the token
   bytes of the bin's samples drawn by that rank;
2. samples of equal LLM cost exchange bins where that keeps more of them on the rank that drew them;
3. vision bins to ranks: the same matching, weighing pixel bytes against the data owner and feature
   bytes against the LLM owner of steps 1-2;
4. the same exchange among samples of equal vision cost.

The owner-blind placement is kept where it moves fewer bytes or fewer samples (the steps optimise the phases
one after the other, and bytes rather than samples, so neither total is guaranteed better by them alone); the
result therefore never moves more bytes nor more samples.
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


def moved_bytes(owner, v_own, l_own, tiles, tokens, transfer: TransferBytes | None = None) -> dict:
    """Bytes and samples one step moves: ``pixels`` (data owner -> vision owner), ``tokens`` (data owner ->
    LLM owner), ``features`` (vision owner -> LLM owner, one way), their ``total`` and ``samples`` (positions
    whose vision or LLM phase runs off the rank that drew them)."""
    tb = transfer or TransferBytes()
    owner, v_own, l_own = (np.asarray(a) for a in (owner, v_own, l_own))
    t = np.asarray(tiles, np.float64)
    k = np.asarray(tokens, np.float64)
    pix = float((t * tb.pixel_tile)[owner != v_own].sum())
    tok = float((k * tb.token)[owner != l_own].sum())
    feat = float((t * tb.feature_tile)[v_own != l_own].sum())
    return {"pixels": pix, "tokens": tok, "features": feat, "total": pix + tok + feat,
            "samples": int(((owner != v_own) | (owner != l_own)).sum())}


def keep_on_owners(v_bin, l_bin, owner, tiles, tokens, vis_cost, llm_cost,
                   transfer: TransferBytes | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(vision rank, LLM rank)`` of every position: the bins ``v_bin``/``l_bin`` (ints in ``[0, D)``)
    placed on ranks and equal-cost samples exchanged so that the fewest bytes move (module docstring).
    ``owner``: the rank that drew each position. Per-rank loads equal the bins' loads, permuted."""
    tb = transfer or TransferBytes()
    v_bin, l_bin, owner = (np.asarray(a, np.int64) for a in (v_bin, l_bin, owner))
    dp = int(max(v_bin.max(initial=0), l_bin.max(initial=0), owner.max(initial=0))) + 1
    t = np.asarray(tiles, np.float64)
    k = np.asarray(tokens, np.float64)
    pix, tok, feat = t * tb.pixel_tile, k * tb.token, t * tb.feature_tile

    l_own = _relabel(l_bin, [(tok, owner)], dp)
    l_own = _exchange_equal_cost(l_own, np.asarray(llm_cost), [(tok, owner)], dp)
    v_own = _relabel(v_bin, [(pix, owner), (feat, l_own)], dp)
    v_own = _exchange_equal_cost(v_own, np.asarray(vis_cost), [(pix, owner), (feat, l_own)], dp)
    mine = moved_bytes(owner, v_own, l_own, t, k, tb)
    blind = moved_bytes(owner, v_bin, l_bin, t, k, tb)
    if mine["total"] <= blind["total"] and mine["samples"] <= blind["samples"]:
        return v_own, l_own
    return v_bin.copy(), l_bin.copy()


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
