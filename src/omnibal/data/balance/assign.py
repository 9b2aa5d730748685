"""Assign packs to (step, dp_rank, micro-batch) so that within every step all ranks carry the same vision
cost and the same LLM cost.

Step time is the max over ranks, so what matters is the spread *inside* a step, not between steps. Packs
are sorted by (tile count, cost) and cut into consecutive groups of ``dp_size * num_microbatches``: every
step gets packs of one tile count (but at the boundary between tile counts) and of nearly equal cost. Inside
a step the packs are dealt to ranks in LPT rounds (the largest of each round to the rank with the least load
so far), which also evens out the per-rank sums when ``num_microbatches > 1``. Finally the step order is
shuffled from (seed, epoch). All vectorised over steps; the only Python loop is over micro-batch rounds.
"""

from __future__ import annotations

import numpy as np

from omnibal.data.balance.common import exact_sum


def assign_sorted(
    pack_tiles: np.ndarray,
    pack_vision: np.ndarray,
    pack_llm: np.ndarray,
    *,
    dp_size: int,
    num_microbatches: int,
    rng: np.random.Generator,
    shuffle_steps: bool = True,
) -> np.ndarray:
    """``pack_ids [num_steps, dp_size, num_microbatches]``; the pack count must be a multiple of
    ``dp_size * num_microbatches``. The pack costs should be sums of integer-grid sample costs
    (``BalanceCost.grid_costs``): exact, so every machine orders the packs alike."""
    num_packs = len(pack_tiles)
    per_step = dp_size * num_microbatches
    assert num_packs % per_step == 0, (num_packs, per_step)
    num_steps = num_packs // per_step
    # exactly rounded means: the sizes (and so the order) must not turn on how a float sum was added up
    mean_v = max(exact_sum(pack_vision) / num_packs, 1e-300) if num_packs else 1.0
    mean_l = max(exact_sum(pack_llm) / num_packs, 1e-300) if num_packs else 1.0
    size = pack_vision / mean_v + pack_llm / mean_l
    order = np.lexsort((rng.random(num_packs), size, pack_tiles))
    return deal_steps(order.reshape(num_steps, per_step), size, dp_size=dp_size,
                      num_microbatches=num_microbatches, rng=rng, shuffle_steps=shuffle_steps)


def deal_steps(
    step_packs: np.ndarray,
    size: np.ndarray,
    *,
    dp_size: int,
    num_microbatches: int,
    rng: np.random.Generator,
    shuffle_steps: bool = True,
) -> np.ndarray:
    """Deal each step's packs (``[num_steps, dp_size * M]``) to ranks in LPT rounds; shuffle step order."""
    num_steps = step_packs.shape[0]
    # largest first inside every step
    inner = np.argsort(-size[step_packs], axis=1, kind="stable")
    step_packs = np.take_along_axis(step_packs, inner, axis=1)
    out = np.empty((num_steps, dp_size, num_microbatches), dtype=np.int64)
    load = np.zeros((num_steps, dp_size))
    rows = np.arange(num_steps)[:, None]
    tie = rng.random((num_steps, dp_size)) * 1e-12
    for m in range(num_microbatches):
        chunk = step_packs[:, m * dp_size:(m + 1) * dp_size]
        ranks = np.argsort(load + tie, axis=1, kind="stable")  # lightest rank gets the largest pack
        out[rows, ranks, m] = chunk
        load[rows, ranks] += size[chunk]
    if shuffle_steps and num_steps > 1:
        out = out[rng.permutation(num_steps)]
        # the order of micro-batches inside a rank carries no meaning; shuffle it too
        if num_microbatches > 1:
            perm = np.argsort(rng.random((num_steps, dp_size, num_microbatches)), axis=2, kind="stable")
            out = np.take_along_axis(out, perm, axis=2)
    return out
