"""Faithful ISF (Iterative Sampling and Filtering, OmniBal paper) as a baseline, vectorised.

1. Shuffle the pool; walk it, appending samples to the current pack until the next one would exceed Q_v
   or Q_t; then start a new pack (next-fit).
2. Keep a pack if it is full enough: tiles == Q_v or tokens >= Q_t - threshold; return the other packs'
   samples to the pool.
3. Repeat ``iterations`` times; the packs of the last walk over what remains are kept as they are.

The walk is sequential by nature, but its pack boundaries are a pointer chain over cumulative sums
(``next(i)`` = first sample that no longer fits after a pack starting at ``i``, by two ``searchsorted``),
and the chain from 0 is unrolled by pointer doubling in O(N log N) -- identical packs to the walk.

The reference's sampler gives each rank a contiguous block of packs in filter order and drops the last
``num_packs % dp`` packs; here (``isf``) the blocks are kept and the remainder runs in one extra last step
(with documented empty micro-batches in that step only), so nothing is lost. ``isf+assign`` keeps ISF's
packs and uses omnibal's per-step assignment instead. Samples over a cap follow the oversize policy
(the reference silently skips them).
"""

from __future__ import annotations

import sys

import numpy as np
from tqdm import tqdm

from omnibal.data.balance.assign import assign_sorted
from omnibal.data.balance.common import epoch_rng, exact_sum, split_oversize
from omnibal.data.balance.schedule import Caps, build_schedule


def next_fit(tiles: np.ndarray, tokens: np.ndarray, max_tiles: int, max_tokens: int) -> np.ndarray:
    """Pack start positions of a next-fit walk over the sequence (every sample must fit alone)."""
    m = len(tiles)
    if m == 0:
        return np.zeros(0, np.int64)
    cv = np.concatenate([[0], np.cumsum(tiles, dtype=np.int64)])
    ct = np.concatenate([[0], np.cumsum(tokens, dtype=np.int64)])
    end_v = np.searchsorted(cv, cv[:-1] + max_tiles, side="right") - 1
    end_t = np.searchsorted(ct, ct[:-1] + max_tokens, side="right") - 1
    nxt = np.minimum(end_v, end_t).astype(np.int64)  # first index of the next pack
    assert (nxt > np.arange(m)).all(), "a sample larger than the caps reached next_fit"
    jump = np.append(nxt, m)  # position m is the absorbing end
    starts = np.zeros(1, np.int64)
    while True:  # doubling: starts holds the first 2^k chain positions, jump the 2^k-th successor
        more = jump[starts]
        starts = np.concatenate([starts, more])
        if more[-1] >= m:
            break
        jump = jump[jump]
    starts = starts[starts < m]
    return np.unique(starts)


def isf_pack(tiles: np.ndarray, tokens: np.ndarray, *, max_tiles: int, max_tokens: int, threshold: int,
             iterations: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """ISF packs in filter order: (sample order, CSR offsets)."""
    pool = rng.permutation(len(tiles))
    kept_rows: list[np.ndarray] = []
    kept_sizes: list[np.ndarray] = []
    for it in range(iterations + 1):
        if len(pool) == 0:
            break
        if it:
            pool = pool[rng.permutation(len(pool))]
        starts = next_fit(tiles[pool], tokens[pool], max_tiles, max_tokens)
        bounds = np.append(starts, len(pool))
        sizes = np.diff(bounds)
        pv = np.add.reduceat(tiles[pool].astype(np.int64), starts)
        pt = np.add.reduceat(tokens[pool].astype(np.int64), starts)
        full = (pv == max_tiles) | (pt >= max_tokens - threshold)
        if it == iterations:
            full[:] = True  # remainder packs are kept as they are
        member = np.repeat(full, sizes)
        kept_rows.append(pool[member])
        kept_sizes.append(sizes[full])
        pool = pool[~member]
    order = np.concatenate(kept_rows) if kept_rows else np.zeros(0, np.int64)
    sizes = np.concatenate(kept_sizes) if kept_sizes else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return order, offsets


def contiguous_blocks(num_packs: int, dp_size: int, num_microbatches: int) -> np.ndarray:
    """The reference layout: rank r takes a contiguous block of packs in filter order, M per step. The
    reference drops the last ``num_packs % (dp_size * M)`` packs; here they run in one extra last step,
    whose free slots name the empty pack ``num_packs`` (so only that step has empty micro-batches)."""
    per_step = dp_size * num_microbatches
    full_steps = num_packs // per_step
    head = full_steps * per_step
    ids = np.arange(head).reshape(dp_size, full_steps, num_microbatches).transpose(1, 0, 2)
    rest = num_packs - head
    if rest or full_steps == 0:
        last = np.full(per_step, num_packs, dtype=np.int64)
        last[:rest] = head + np.arange(rest)
        ids = np.concatenate([ids, last.reshape(num_microbatches, dp_size).T[None]], axis=0)
    return ids


def _score(tiles, tokens, order, offsets, qv, qt, dp_size) -> float:
    """The reference's argument-search score: pad + vision dist + text dist (filter-order blocks)."""
    pv = np.add.reduceat(tiles[order].astype(np.float64), offsets[:-1])
    pt = np.add.reduceat(tokens[order].astype(np.float64), offsets[:-1])
    pad = 1 - pt.mean() / qt
    usable = len(pv) // dp_size * dp_size
    if usable == 0:
        return pad
    blocks_v = pv[:usable].reshape(dp_size, -1).T
    blocks_t = pt[:usable].reshape(dp_size, -1).T
    # (an exactly rounded mean: which caps win must not turn on how a float sum was added up)
    dist = lambda x: exact_sum(1 - x.mean(1) / np.maximum(x.max(1), 1e-9)) / len(x)  # noqa: E731
    return pad + dist(blocks_v) + dist(blocks_t)


def search_caps(tiles, tokens, *, dp_size, threshold, iterations, rng, target=(4.0, 5.0), progress=False):
    """The reference's argument search: grow (Q_v, Q_t) together; among caps whose mean pack holds
    ``target`` samples, keep the lowest pad + vision dist + text dist. Returns (Q_v, Q_t, candidates tried)."""
    mean_v, mean_t = float(np.mean(tiles)), float(np.mean(tokens))
    per_tile = mean_t / max(mean_v, 1e-9)
    best, tried = None, 0
    qv0 = max(int(np.max(tiles)), int(target[0] * mean_v * 0.8))
    grid = [(qv, grow) for qv in range(qv0, max(qv0, int(target[1] * mean_v * 1.3)) + 1)
            for grow in (1.0, 1.1, 1.2, 1.3)]
    if progress:
        grid = tqdm(grid, desc="ISF argument search", unit="caps", file=sys.stderr)
    for qv, grow in grid:
        qt = max(int(np.max(tokens)), int(round(qv * per_tile * grow / 128)) * 128)
        order, offsets = isf_pack(tiles, tokens, max_tiles=qv, max_tokens=qt, threshold=threshold,
                                  iterations=iterations, rng=np.random.default_rng(rng.integers(1 << 62)))
        tried += 1
        mean_samples = len(order) / max(len(offsets) - 1, 1)
        if not target[0] <= mean_samples <= target[1]:
            continue
        s = _score(tiles, tokens, order, offsets, qv, qt, dp_size)
        if best is None or s < best[0]:
            best = (s, qv, qt)
    if best is None:  # nothing landed in the target: the caps nearest to it
        qv = max(int(np.max(tiles)), int(round(np.mean(target) * mean_v)))
        return qv, max(int(np.max(tokens)), int(round(qv * per_tile / 128 + 1)) * 128), tried
    return best[1], best[2], tried


def balance_isf(stats, *, dp_size, num_microbatches, seed, epoch, config):
    regular, alone, dropped = split_oversize(stats, config)
    rng = epoch_rng(seed, epoch, stream=1)
    tiles, tokens = stats.tiles[regular], stats.tokens[regular]
    tried = 0
    if config.max_tiles is not None and config.max_tokens is not None:
        qv, qt = config.max_tiles, config.max_tokens
    elif config.isf_search:
        # the search is deterministic in seed only: the reference keeps its caps across epochs
        qv, qt, tried = search_caps(tiles, tokens, dp_size=dp_size, threshold=config.isf_threshold,
                                    iterations=config.isf_iterations, rng=epoch_rng(seed, 0, stream=2),
                                    progress=config.progress)
    else:
        qv, qt = config.max_tiles or 9, config.max_tokens or 4096  # the reference's defaults
    qv = max(qv, int(tiles.max()) if len(tiles) else 1)
    qt = max(qt, int(tokens.max()) if len(tokens) else 1)
    order, offsets = isf_pack(tiles, tokens, max_tiles=qv, max_tokens=qt, threshold=config.isf_threshold,
                              iterations=config.isf_iterations, rng=rng)
    order = regular[order]
    if len(alone):
        order = np.concatenate([order, alone])
        offsets = np.concatenate([offsets, offsets[-1] + np.arange(1, len(alone) + 1)])
    num_packs = len(offsets) - 1
    per_step = dp_size * num_microbatches
    pack_of = np.full(len(stats), -1, np.int64)
    pack_of[order] = np.repeat(np.arange(num_packs), np.diff(offsets))
    if config.method == "isf":
        pack_ids = contiguous_blocks(num_packs, dp_size, num_microbatches)
        total = num_packs + 1  # one empty pack fills the reference's dropped remainder
    else:
        total = -(-num_packs // per_step) * per_step
        p_tiles = np.bincount(pack_of[order], weights=stats.tiles[order], minlength=total)
        v_cost, l_cost = config.cost.grid_costs(stats.tiles[order], stats.tokens[order])  # exact pack sums
        p_vis = np.bincount(pack_of[order], weights=v_cost, minlength=total)
        p_llm = np.bincount(pack_of[order], weights=l_cost, minlength=total)
        pack_ids = assign_sorted(p_tiles, p_vis, p_llm, dp_size=dp_size, num_microbatches=num_microbatches,
                                 rng=rng)
    # keep ISF's filter order as the pack numbering (build_schedule orders rows by pack label)
    return build_schedule(
        pack_of=pack_of, num_packs=total, pack_ids=pack_ids, dp_size=dp_size, num_microbatches=num_microbatches,
        caps=Caps(tiles=int(qv), tokens=int(qt)), num_samples=len(stats), padding="varlen",
        method=config.method, seed=seed, epoch=epoch, stats_fingerprint=stats.fingerprint(), dropped=dropped,
        meta={"config": config.to_dict(), "isf_search_candidates": tried,
              "empty_microbatches": int((pack_ids == num_packs).sum()) if config.method == "isf" else None},
    )
