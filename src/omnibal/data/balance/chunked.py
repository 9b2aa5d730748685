"""The packer on very large inputs: the rows split into chunks that are packed independently, in a pool of
worker processes, with a result that does not depend on how many processes there are.

``pack_balanced`` is sequential numpy work, and its exchange phases grow faster than the rows; over
``2 * chunk_rows`` rows (``BalanceConfig.chunk_rows``) :func:`pack_chunked` packs the rows in
``ceil(rows / chunk_rows)`` chunks instead. Everything the result depends on is fixed before a chunk runs:

- **The partition** (:func:`split_rows`): the rows sorted by size (tiles, then tokens) are dealt in blocks of
  as many rows as there are chunks, each block's rows to the chunks in an order drawn from the epoch's
  generator. So every chunk gets one sample of every size band -- the chunks' tile and token totals differ by
  about one sample -- and the chunks' mean packs are those of the whole input, which the caps were searched
  on (once, on every row).
- **The pack counts** (:func:`split_packs`): the packs split over the chunks in proportion to their rows,
  and the room for more packs (the tail rule adds whole steps of ``pack_step`` packs) split in whole steps:
  the total stays a whole number of steps, and never more packs than rows.
- **The generators**: one per chunk, spawned from a seed drawn once from the epoch's generator, so a chunk
  draws the same numbers whichever process runs it, and in whichever order.

The chunks then run in ``workers`` processes (fork where the platform has it) or, with one worker, one after
the other in this process: the same packs either way. The derived caps are the largest over the chunks; so
that the token cap is not a multiple higher than one packer would reach, :func:`shave_tokens` then brings
the few packs over the next lower multiple under it where single swaps can.
"""

from __future__ import annotations

import multiprocessing

import numpy as np

from omnibal.data.balance.common import stable_order
from omnibal.data.balance.cost import to_grid
from omnibal.data.balance.packer import PackResult, pack_balanced
from omnibal.data.balance.phases import add_phase_seconds, phase, record_phases
from omnibal.processes import start_method

SHAVE_PACKS = 1024
"""Most packs :func:`shave_tokens` tries to bring under the next lower token multiple (a few Python steps
each)."""


def num_chunks(rows: int, num_packs: int, chunk_rows: int | None) -> int:
    """Chunks the packer splits ``rows`` rows into: 1 (no split) up to ``2 * chunk_rows`` rows (or with
    ``chunk_rows`` None), else ``ceil(rows / chunk_rows)``; never more than there are packs. A function of
    the input alone, never of the cores."""
    if chunk_rows is None or rows <= 2 * chunk_rows:
        return 1
    return max(1, min(-(-rows // chunk_rows), num_packs))


def size_order(tiles: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys, order): a key per row that sorts by tiles, then tokens (``tiles * (most tokens + 1) + tokens``),
    and the rows in the keys' order (equal keys in row order)."""
    tiles = np.asarray(tiles, np.int64)
    tokens = np.asarray(tokens, np.int64)
    keys = tiles * (int(tokens.max(initial=0)) + 1) + tokens
    return keys, stable_order(keys)


def split_rows(by_size: np.ndarray, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``count`` chunks of row indices (each ascending), sizes within one: the rows in size order
    (``by_size``, :func:`size_order`) go in blocks of ``count`` to the chunks in a random order per block
    (a random, size-stratified split)."""
    n = len(by_size)
    blocks = -(-n // count)
    deal = rng.permuted(np.broadcast_to(np.arange(count), (blocks, count)), axis=1).ravel()[:n]
    chunk_of = np.empty(n, np.int64)
    chunk_of[by_size] = deal
    order = stable_order(chunk_of)
    bounds = np.cumsum(np.bincount(chunk_of, minlength=count))[:-1]
    return np.split(order, bounds)


def split_packs(num_packs: int, max_packs: int, sizes: list[int], pack_step: int) -> list[tuple[int, int]]:
    """Per chunk of ``sizes`` rows, (packs, most packs): the packs in proportion to the rows (largest
    remainders, ties to the first chunk), and the room up to ``max_packs`` in whole ``pack_step`` steps, each
    chunk's within its rows (the first chunks first when the room is short)."""
    sizes_a = np.asarray(sizes, np.int64)
    total = int(sizes_a.sum())
    share = num_packs * sizes_a
    packs = share // total
    short = num_packs - int(packs.sum())
    packs[stable_order(-(share % total) + int((share % total).max(initial=0)))[:short]] += 1
    room = (sizes_a - packs) // pack_step
    spare = max(max_packs - num_packs, 0) // pack_step
    room = np.minimum(room, np.maximum(spare - (np.cumsum(room) - room), 0))
    return [(int(p), int(p + r * pack_step)) for p, r in zip(packs, room)]


def _pack_chunk(task) -> PackResult:
    tiles, tokens, llm, seed, kwargs = task
    return pack_balanced(tiles, tokens, llm, rng=np.random.default_rng(seed), **kwargs)


def _pack_chunk_in_worker(task) -> tuple[PackResult, dict[str, float]]:
    """One chunk's packing and the CPU seconds of its phases (a worker's own, which its parent's phase
    records do not see)."""
    with record_phases() as seconds:
        packed = _pack_chunk(task)
    return packed, seconds


def _run(tasks: list, workers: int) -> list[tuple[PackResult, dict[str, float]]]:
    """Every chunk's packing (and its worker's phase seconds), in the order of ``tasks``."""
    # in this process: one worker, one chunk, or a daemon process (a pool's or a loader's worker), which may
    # not start processes of its own; here the phases record themselves
    if workers <= 1 or len(tasks) < 2 or multiprocessing.current_process().daemon:
        return [(_pack_chunk(task), {}) for task in tasks]
    ctx = multiprocessing.get_context(start_method())
    pool = ctx.Pool(min(workers, len(tasks)))
    try:
        results = pool.map(_pack_chunk_in_worker, tasks, chunksize=1)
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()  # the workers exit and are reaped: their CPU time counts as this process's children's
    return results


def pack_chunked(tiles: np.ndarray, tokens: np.ndarray, llm_cost: np.ndarray, *, num_packs: int, max_tiles: int,
                 max_tokens: int, rng: np.random.Generator, chunks: int, workers: int = 1, pack_step: int = 1,
                 max_packs: int | None = None, token_multiple: int | None = None, **kwargs) -> PackResult:
    """:func:`~omnibal.data.balance.packer.pack_balanced` of ``chunks`` chunks of the rows (see the module
    docstring), in ``workers`` processes; the other keywords go to every chunk's packer. The packs of chunk
    ``k`` follow those of chunk ``k - 1``; ``llm`` per pack is in the units of ``cost.to_grid`` of all of
    ``llm_cost``; ``passes`` the most any chunk ran. ``token_multiple`` (a token cap derived from the packs,
    rounded up to it): :func:`shave_tokens` then tries to bring the packs under the next lower multiple."""
    n = len(tiles)
    max_packs = n if max_packs is None else int(max_packs)
    keys, by_size = size_order(tiles, tokens)
    parts = split_rows(by_size, chunks, rng)
    counts = split_packs(num_packs, max_packs, [len(rows) for rows in parts], pack_step)
    seeds = np.random.SeedSequence(rng.integers(0, 1 << 62, 2).tolist()).spawn(chunks)
    tiles, tokens, llm_cost = np.asarray(tiles), np.asarray(tokens), np.asarray(llm_cost)
    tasks = [(tiles[rows], tokens[rows], llm_cost[rows], seed,
              dict(kwargs, num_packs=p, max_packs=most, max_tiles=max_tiles, max_tokens=max_tokens,
                   pack_step=pack_step))
             for rows, (p, most), seed in zip(parts, counts, seeds)]
    results = _run(tasks, workers)
    pack_of = np.empty(n, np.int64)
    offset = 0
    for rows, (packed, seconds) in zip(parts, results):
        pack_of[rows] = packed.pack_of + offset
        offset += len(packed.tiles)
        add_phase_seconds(seconds)
    packs = [packed for packed, _ in results]
    pack_tokens = np.concatenate([p.tokens for p in packs])
    if token_multiple:
        with phase("shave"):
            shave_tokens(pack_of, pack_tokens, np.asarray(tokens, np.int64), keys, by_size, token_multiple)
    return PackResult(pack_of=pack_of, tiles=np.concatenate([p.tiles for p in packs]), tokens=pack_tokens,
                      llm=np.bincount(pack_of, weights=to_grid(llm_cost), minlength=offset),
                      passes=tuple(int(max(p.passes[i] for p in packs)) for i in range(3)))


def shave_tokens(pack_of: np.ndarray, pack_tokens: np.ndarray, tokens: np.ndarray, keys: np.ndarray,
                 by_size: np.ndarray, multiple: int) -> bool:
    """Bring the few packs (at most ``SHAVE_PACKS``) over the multiple of ``multiple`` under their largest
    one -- those the derived token cap is rounded up for -- under it, each by one swap of a sample with a
    sample of as many tiles and fewer tokens from a pack with the room; all or none (one left over keeps
    the cap). Each chunk levels its own tokens, so the largest pack of all is the largest of several chunks'
    and often a token or two over what one packer reaches. ``keys``/``by_size``: :func:`size_order`. Tile
    counts never change; ``pack_of`` and ``pack_tokens`` are updated in place. Returns whether the cap came
    down."""
    top = int(pack_tokens.max(initial=0))
    target = -(-top // multiple) * multiple - multiple
    over = np.flatnonzero(pack_tokens > target)
    if target <= 0 or len(over) > SHAVE_PACKS:
        return False
    sorted_keys = keys[by_size]
    most_room = target - int(pack_tokens.min())
    # the rows of the packs over (no swap moves a row into one: a partner's pack is under the target)
    rows = np.flatnonzero(np.isin(pack_of, over))
    rows = rows[stable_order(pack_of[rows])]
    starts = np.searchsorted(pack_of[rows], over)
    swaps = []
    for p, start, end in zip(over, starts, [*starts[1:], len(rows)]):  # ascending, each swap the least change
        best = None                                                    # (ties: the row last in size order)
        for a in rows[start:end]:
            d_least = int(pack_tokens[p]) - target
            if best is not None and best[2] <= d_least:
                break
            b = _partner(a, p, d_least, target, most_room, pack_of, pack_tokens, tokens, keys, sorted_keys, by_size)
            if b is not None and (best is None or tokens[a] - tokens[b] < best[2]):
                best = (a, b, int(tokens[a] - tokens[b]))
        if best is None:
            for a, b, d in reversed(swaps):  # undo: the cap stays
                _swap(pack_of, pack_tokens, b, a, -d)
            return False
        _swap(pack_of, pack_tokens, *best)
        swaps.append(best)
    return True


def _partner(a, p, d_least, target, most_room, pack_of, pack_tokens, tokens, keys, sorted_keys, by_size,
             window=256):
    """The row of ``a``'s tile count with the most tokens at least ``d_least`` under ``a``'s, in a pack other
    than ``p`` with room for the difference under ``target`` (no pack has more than ``most_room``); None when
    there is none."""
    band = keys[a] - tokens[a]  # the key of (a's tiles, 0 tokens)
    low = int(np.searchsorted(sorted_keys, band, side="left"))
    hi = int(np.searchsorted(sorted_keys, keys[a] - d_least, side="right"))
    while hi > low:
        cand = by_size[max(low, hi - window):hi][::-1]
        diff = tokens[a] - tokens[cand]
        ok = (diff <= target - pack_tokens[pack_of[cand]]) & (pack_of[cand] != p)
        if ok.any():
            return int(cand[np.argmax(ok)])
        if diff[-1] > most_room:
            return None
        hi -= window
    return None


def _swap(pack_of, pack_tokens, a, b, d) -> None:
    """Swap rows ``a`` and ``b`` between their packs (``d``: ``a``'s tokens less ``b``'s)."""
    pa, pb = pack_of[a], pack_of[b]
    pack_of[a], pack_of[b] = pb, pa
    pack_tokens[pa] -= d
    pack_tokens[pb] += d
