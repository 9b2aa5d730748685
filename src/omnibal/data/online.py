"""Online post-balancing (the OrchMLLM idea): re-deal an already sampled global batch across DP ranks
so every rank gets the same vision cost and the same LLM cost.

For users who cannot compute statistics offline: each rank draws its local batch as usual, all-gathers
the per-sample sizes (tiles, tokens) -- one small collective the caller makes -- and calls a function here
with the gathered arrays. The functions are pure and deterministic (stable sorts, ties by position), so
every rank computes the same assignment without further communication; the caller then moves samples
(all-to-all).

- :func:`rebalance_global_batch`: one assignment on the sum of the relative vision and LLM costs (one
  combined cost: a sample heavy for the encoder is not heavy for the LLM, so neither phase is balanced
  exactly).
- :func:`balance_phases`: OrchMLLM's per-modality dispatch: one assignment of the vision phase balanced by
  vision cost, and another of the LLM phase balanced by LLM cost (attention's sum of squares included), so
  each phase is balanced on its own; the trainer (:mod:`omnibal.train.online`) moves the visual features
  between the two with an all-to-all. Given the rank that drew each sample (``owner``), it places the
  balanced bins to move the fewest bytes at the same loads (:mod:`omnibal.data.online_owners`).

Algorithm: LPT in rounds over the bins, then vectorised passes of best single swaps between the heaviest
and lightest bins. Cost: O(B log B) numpy work; ~10 us per sample on one core for B = 1024.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal.data.balance.cost import DEFAULT_COST, BalanceCost
from omnibal.data.online_owners import TransferBytes, keep_on_owners
from omnibal.errors import InputError


def rebalance_global_batch(tiles, tokens, *, dp_size: int, num_microbatches: int = 1,
                           cost: BalanceCost | None = None, swap_passes: int = 4) -> list[list[list[int]]]:
    """``assignment[dp_rank][micro]`` = positions (into the gathered global batch) of that micro-batch."""
    tiles, tokens = _check_sizes(tiles, tokens, dp_size, num_microbatches)
    bins = dp_size * num_microbatches
    cost = cost or DEFAULT_COST
    vis, llm = cost.sample_costs(tiles, tokens)
    size = vis / max(vis.sum() / bins, 1e-300) + llm / max(llm.sum() / bins, 1e-300)
    bin_of = _lpt_swap(size, bins, swap_passes)
    out: list[list[list[int]]] = [[[] for _ in range(num_microbatches)] for _ in range(dp_size)]
    for pos in range(bins):  # bins, not samples: rank-major, micro-batches in load order
        members = np.flatnonzero(bin_of == pos)
        out[pos % dp_size][pos // dp_size] = members.tolist()
    return out


@dataclass(frozen=True)
class PhaseAssignment:
    """Per-modality dispatch of one global batch (positions index the gathered batch)."""

    vision: list[list[int]]
    """``vision[r]``: positions whose vision phase (encoder + projector) runs on DP rank r, ascending."""
    llm: list[list[int]]
    """``llm[r]``: positions whose LLM phase runs on DP rank r, ascending."""
    vision_load: np.ndarray
    """Vision cost per rank (the cost model's units)."""
    llm_load: np.ndarray
    """LLM cost per rank."""

    @property
    def vision_max_mean(self) -> float:
        return _max_mean(self.vision_load)

    @property
    def llm_max_mean(self) -> float:
        return _max_mean(self.llm_load)


def balance_phases(tiles, tokens, *, dp_size: int, cost: BalanceCost | None = None, swap_passes: int = 8,
                   owner=None, transfer: TransferBytes | None = None) -> PhaseAssignment:
    """OrchMLLM's per-phase balance of a gathered global batch: the vision phase dealt to ``dp_size`` ranks
    by vision cost, the LLM phase dealt again by LLM cost. Every position is in exactly one vision list and
    one LLM list; every rank gets at least one LLM sample when there are at least ``dp_size`` samples.

    ``owner`` (optional): the DP rank that drew each position. Given it, the balanced bins are placed on
    ranks, and samples of equal cost exchanged, so that the fewest bytes move (weighed by ``transfer``;
    :func:`omnibal.data.online_owners.keep_on_owners`): the per-rank loads are the owner-blind ones,
    permuted, so every max/mean is unchanged."""
    tiles, tokens = _check_sizes(tiles, tokens, dp_size, 1)
    cost = cost or DEFAULT_COST
    vis, llm = cost.sample_costs(tiles, tokens)
    v_bin = _lpt_swap(vis, dp_size, swap_passes)
    l_bin = _lpt_swap(llm, dp_size, swap_passes)
    if owner is not None:
        owner = np.asarray(owner)
        if owner.shape != tiles.shape or ((owner < 0) | (owner >= dp_size)).any():
            raise InputError(f"owner must give a rank in [0, {dp_size}) for each of the {len(tiles)} positions",
                             source="global batch", field="owner")
        v_bin, l_bin = keep_on_owners(v_bin, l_bin, owner, tiles, tokens, vis, llm, transfer)
    return PhaseAssignment(
        vision=[np.flatnonzero(v_bin == r).tolist() for r in range(dp_size)],
        llm=[np.flatnonzero(l_bin == r).tolist() for r in range(dp_size)],
        vision_load=np.bincount(v_bin, weights=vis, minlength=dp_size),
        llm_load=np.bincount(l_bin, weights=llm, minlength=dp_size))


def phase_loads(groups, tiles, tokens, *, cost: BalanceCost | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(vision, LLM) cost per group of positions, e.g. per rank of a local draw (for max/mean reports)."""
    vis, llm = (cost or DEFAULT_COST).sample_costs(np.asarray(tiles), np.asarray(tokens))
    return (np.array([vis[list(g)].sum() for g in groups]), np.array([llm[list(g)].sum() for g in groups]))


def _max_mean(load: np.ndarray) -> float:
    mean = float(np.mean(load)) if len(load) else 0.0
    return float(np.max(load)) / mean if mean > 0 else 1.0


def _check_sizes(tiles, tokens, dp_size: int, num_microbatches: int) -> tuple[np.ndarray, np.ndarray]:
    tiles = np.asarray(tiles)
    tokens = np.asarray(tokens)
    if tiles.shape != tokens.shape or tiles.ndim != 1:
        raise InputError(f"tiles {tiles.shape} and tokens {tokens.shape} must be 1-D of one length",
                         source="global batch", field="tokens")
    if (tiles < 0).any() or (tokens < 1).any():
        raise InputError("tiles must be >= 0 and tokens >= 1", source="global batch", field="tokens")
    if dp_size < 1 or num_microbatches < 1:
        raise InputError("dp_size and num_microbatches must be >= 1", source="dp_size", field="dp_size")
    return tiles, tokens


def _lpt_swap(size: np.ndarray, bins: int, swap_passes: int) -> np.ndarray:
    """Bin of every item: LPT in rounds of ``bins`` items (so counts differ by at most one), then passes of
    the best single swap between the heaviest and the lightest bins, all pairs at once."""
    n = len(size)
    order = np.lexsort((np.arange(n), -size))  # largest first, ties by position: identical on every rank
    bin_of = np.empty(n, np.int64)
    load = np.zeros(bins)
    for start in range(0, n, bins):
        items = order[start:start + bins]
        lightest = np.lexsort((np.arange(bins), load))[: len(items)]
        bin_of[items] = lightest
        load[lightest] += size[items]
    for _ in range(swap_passes):  # heaviest bin swaps one sample with the lightest, etc., all pairs at once
        srt = np.lexsort((np.arange(bins), load))
        half = bins // 2
        light, heavy = srt[:half], srt[::-1][:half]
        gap = (load[heavy] - load[light]) / 2
        improved = False
        for h, lt, g in zip(heavy.tolist(), light.tolist(), gap.tolist()):
            if g <= 0:
                continue
            a = np.flatnonzero(bin_of == h)
            b = np.flatnonzero(bin_of == lt)
            if not len(a) or not len(b):
                continue
            d = size[a][:, None] - size[b][None, :]
            score = np.abs(d - g)
            i, j = np.unravel_index(np.argmin(score), score.shape)
            if 0 < d[i, j] < 2 * g:
                bin_of[a[i]], bin_of[b[j]] = lt, h
                load[h] -= d[i, j]
                load[lt] += d[i, j]
                improved = True
        if not improved:
            break
    return bin_of
