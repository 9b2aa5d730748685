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
- :func:`balance_phases`: OrchMLLM's per-modality dispatch: the vision phase dealt by image tile, and the
  LLM phase balanced by LLM cost (attention's sum of squares included), so each phase is balanced on its
  own; the trainer (:mod:`omnibal.train.online`) moves the visual features between the two with an
  all-to-all. Given the rank that drew each sample (``owner``), it places the work to move the fewest bytes
  at the same loads (:mod:`omnibal.data.online_owners`).

The vision unit is the tile, finer than OrchMLLM's image: the encoders omnibal runs (InternViT, CLIP on
InternVL-style tiles, the reference ViT) attend within a tile and the projector maps each tile on its own,
so the tiles of one image, or of one multi-image sample, may be encoded on different ranks and the features
are exactly those of encoding them together. Every tile costs the encoder the same, so the vision phase
balances to within one tile per rank, whatever the images per sample.

Algorithm: LPT in rounds over the bins, then vectorised passes of best single swaps between the heaviest
and lightest bins. Cost: O(B log B) numpy work; ~10 us per sample on one core for B = 1024.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal.data.balance.cost import DEFAULT_COST, BalanceCost
from omnibal.data.online_owners import TransferBytes, deal_tiles, keep_on_owners, tile_positions
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

    vision_tiles: np.ndarray
    """Vision rank of every tile of the batch, tiles in position order
    (:func:`omnibal.data.online_owners.tile_positions`)."""
    llm: list[list[int]]
    """``llm[r]``: positions whose LLM phase runs on DP rank r, ascending."""
    vision_load: np.ndarray
    """Vision cost per rank (the cost model's units; a sample's cost shared equally by its tiles)."""
    llm_load: np.ndarray
    """LLM cost per rank."""

    @property
    def vision_max_mean(self) -> float:
        return _max_mean(self.vision_load)

    @property
    def llm_max_mean(self) -> float:
        return _max_mean(self.llm_load)

    @property
    def llm_owner(self) -> np.ndarray:
        """LLM rank of every position."""
        out = np.empty(sum(len(r) for r in self.llm), np.int64)
        for r, members in enumerate(self.llm):
            out[members] = r
        return out


def balance_phases(tiles, tokens, *, dp_size: int, cost: BalanceCost | None = None, swap_passes: int = 8,
                   owner=None, transfer: TransferBytes | None = None, num_packs: int = 1) -> PhaseAssignment:
    """OrchMLLM's per-phase balance of a gathered global batch: the tiles dealt to ``dp_size`` vision ranks
    (within one tile of each other), the LLM phase dealt by LLM cost. Every tile has one vision rank, every
    position is in exactly one LLM list; every rank gets at least one LLM sample when there are at least
    ``dp_size`` samples.

    ``owner`` (optional): the DP rank that drew each position. Given it, the work is placed so that the
    fewest bytes move (weighed by ``transfer``; :func:`omnibal.data.online_owners.keep_on_owners`): the
    owner-blind LLM bins matched to ranks, or an assignment built from the owners outwards
    (:func:`_owner_first`) when it balances no worse; the vision loads are unchanged and the LLM max/mean
    is never above the owner-blind one. ``num_packs``: the packs each rank runs its LLM phase in
    (:func:`llm_packs`); the assignment built from the owners must not raise the largest pack either."""
    tiles, tokens = _check_sizes(tiles, tokens, dp_size, 1)
    cost = cost or DEFAULT_COST
    vis, llm = cost.sample_costs(tiles, tokens)
    l_bin = _lpt_swap(llm, dp_size, swap_passes)
    if owner is not None:
        owner = np.asarray(owner)
        if owner.shape != tiles.shape or ((owner < 0) | (owner >= dp_size)).any():
            raise InputError(f"owner must give a rank in [0, {dp_size}) for each of the {len(tiles)} positions",
                             source="global batch", field="owner")
        local = _owner_first(llm, owner, dp_size, swap_passes)
        as_good = (_max_mean(_loads(local, llm, dp_size)) <= _max_mean(_loads(l_bin, llm, dp_size))
                   and _largest_pack(local, llm, dp_size, num_packs) <= _largest_pack(l_bin, llm, dp_size, num_packs))
        if len(tiles) >= dp_size and np.bincount(local, minlength=dp_size).min() == 0:
            as_good = False  # every rank keeps an LLM sample
        v_tile, l_bin = keep_on_owners(l_bin, owner, tiles, tokens, llm, transfer,
                                       alternatives=(local,) if as_good else ())
    else:
        v_tile = deal_tiles(tiles, l_bin, None, dp_size)
    pos = tile_positions(tiles)
    return PhaseAssignment(
        vision_tiles=v_tile,
        llm=[np.flatnonzero(l_bin == r).tolist() for r in range(dp_size)],
        vision_load=np.bincount(v_tile, weights=(vis / np.maximum(tiles, 1))[pos], minlength=dp_size),
        llm_load=_loads(l_bin, llm, dp_size))


def _loads(bin_of: np.ndarray, cost: np.ndarray, bins: int) -> np.ndarray:
    return np.bincount(bin_of, weights=cost, minlength=bins)


def _largest_pack(bin_of: np.ndarray, cost: np.ndarray, bins: int, num_packs: int) -> float:
    """The costliest of the :func:`llm_packs` every rank would run."""
    if num_packs == 1:
        return float(_loads(bin_of, cost, bins).max(initial=0.0))
    return max((float(cost[p].sum()) for r in range(bins)
                for p in llm_packs(np.flatnonzero(bin_of == r), cost, num_packs)), default=0.0)


def llm_packs(members, cost: np.ndarray, num_packs: int) -> list[np.ndarray]:
    """A rank's LLM samples ``members`` in up to ``num_packs`` non-empty varlen packs of similar ``cost``
    (LPT: largest first into the lightest pack, ties by position), each in ascending position order: how
    the online trainer runs its LLM phase and how the simulator prices it."""
    members = np.asarray(members, np.int64)
    k = max(1, min(num_packs, len(members)))
    load = np.zeros(k)
    out: list[list[int]] = [[] for _ in range(k)]
    for p in sorted(members.tolist(), key=lambda q: (-cost[q], q)):
        j = int(np.argmin(load))
        out[j].append(p)
        load[j] += cost[p]
    return [np.asarray(sorted(g), np.int64) for g in out if g]


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
    """Bin of every item: LPT in rounds of ``bins`` items (so counts differ by at most one), then
    :func:`_swap_passes`."""
    n = len(size)
    order = np.lexsort((np.arange(n), -size))  # largest first, ties by position: identical on every rank
    bin_of = np.empty(n, np.int64)
    load = np.zeros(bins)
    for start in range(0, n, bins):
        items = order[start:start + bins]
        lightest = np.lexsort((np.arange(bins), load))[: len(items)]
        bin_of[items] = lightest
        load[lightest] += size[items]
    return _swap_passes(bin_of, load, size, bins, swap_passes)


def _owner_first(size: np.ndarray, owner: np.ndarray, bins: int, swap_passes: int) -> np.ndarray:
    """Bin of every item, keeping items on their ``owner`` where the balance allows: largest first, an item
    stays with its owner while that keeps the owner at or under the mean load, else goes to the lightest
    bin (ties: the lowest); then :func:`_swap_passes`."""
    n = len(size)
    mean = float(size.sum()) / bins
    bin_of = np.empty(n, np.int64)
    load = np.zeros(bins)
    for i in np.lexsort((np.arange(n), -size)).tolist():
        b = int(owner[i])
        if load[b] + size[i] > mean:
            b = int(np.argmin(load))
        bin_of[i] = b
        load[b] += size[i]
    return _swap_passes(bin_of, load, size, bins, swap_passes)


def _swap_passes(bin_of: np.ndarray, load: np.ndarray, size: np.ndarray, bins: int, swap_passes: int) -> np.ndarray:
    """Passes of the best single swap between the heaviest and the lightest bins, all pairs at once."""
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
