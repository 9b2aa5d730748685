"""Baselines behind the same interface: random fixed micro-batches, LLaVA's length-grouped sampler.

Both run as a ``B x t_max`` padded batch (``padding="pad_to_longest"``), which is how these samplers are
used in practice, so their cost features count the padding. When the sample count does not fill the last
step, its remaining samples are spread over the step's micro-batches as evenly as possible and the rest
of that step's micro-batches are empty (documented, counted in the metrics) -- nothing is dropped or
repeated.
"""

from __future__ import annotations

import numpy as np

from omnibal.data.balance.common import epoch_rng
from omnibal.data.balance.schedule import Caps, build_schedule
from omnibal.stats.table import INTERNVL_CONVENTION


def _layout(order: np.ndarray, *, dp_size: int, num_microbatches: int, batch_size: int):
    """Cut an ordered sample list into micro-batches of ``batch_size`` (the tail spread over one last step);
    returns (pack_of per position, num_packs, pack_ids) with packs numbered slot by slot."""
    n = len(order)
    per_step = dp_size * num_microbatches
    full_steps = n // (per_step * batch_size)
    head = full_steps * per_step * batch_size
    pack_of = np.empty(n, np.int64)
    pack_of[:head] = np.arange(head) // batch_size
    tail = n - head
    num_steps = full_steps + (1 if tail else 0)
    if tail:
        # the tail's samples, dealt round-robin so micro-batches differ by at most one sample
        pack_of[head:] = full_steps * per_step + np.arange(tail) % per_step
    num_packs = num_steps * per_step
    # slot order (step, micro, rank): consecutive packs of one step go to different ranks
    ids = np.arange(num_packs).reshape(num_steps, num_microbatches, dp_size).transpose(0, 2, 1)
    return pack_of, num_packs, ids


def _caps_padded(stats, pack_of_rows: np.ndarray, num_packs: int) -> Caps:
    tiles = np.bincount(pack_of_rows, weights=stats.tiles, minlength=num_packs)
    size = np.bincount(pack_of_rows, minlength=num_packs)
    t_max = np.zeros(num_packs)
    np.maximum.at(t_max, pack_of_rows, stats.tokens.astype(np.float64))
    return Caps(tiles=int(max(tiles.max(), 1)), tokens=int(max((size * t_max).max(), 1)))


def _finish(stats, order, *, dp_size, num_microbatches, seed, epoch, config, method):
    pack_pos, num_packs, ids = _layout(order, dp_size=dp_size, num_microbatches=num_microbatches,
                                       batch_size=config.batch_size)
    pack_of = np.empty(len(stats), np.int64)
    pack_of[order] = pack_pos
    return build_schedule(
        pack_of=pack_of, num_packs=num_packs, pack_ids=ids, dp_size=dp_size, num_microbatches=num_microbatches,
        caps=_caps_padded(stats, pack_of, num_packs), num_samples=len(stats), padding="pad_to_longest",
        method=method, seed=seed, epoch=epoch, stats_fingerprint=stats.fingerprint(),
        meta={"config": config.to_dict()},
    )


def balance_random(stats, *, dp_size, num_microbatches, seed, epoch, config):
    """Random fixed micro-batches of ``config.batch_size`` (a DistributedSampler without drop/repeat)."""
    order = epoch_rng(seed, epoch, stream=3).permutation(len(stats))
    return _finish(stats, order, dp_size=dp_size, num_microbatches=num_microbatches, seed=seed, epoch=epoch,
                   config=config, method="random")


def length_grouped_order(lengths: np.ndarray, *, group: int, batch_size: int, rng) -> np.ndarray:
    """LLaVA's length-grouped order: a random permutation cut into mega-batches of ``group`` =
    ranks x batch_size samples; each mega-batch sorted by length (longest first) and split into
    ``group // batch_size`` chunks greedily (each sample to the chunk with the least total length that still
    has room); the chunks follow each other. Vectorised across mega-batches; the loop runs over positions
    inside one mega-batch."""
    n = len(lengths)
    perm = rng.permutation(n)
    out = []
    num_full = n // group
    for start, count, size in ((0, num_full, group), (num_full * group, 1 if n % group else 0, n % group)):
        if count == 0:
            continue
        mb = perm[start:start + count * size].reshape(count, size)
        mb = np.take_along_axis(mb, np.argsort(-lengths[mb], axis=1, kind="stable"), axis=1)
        num_chunks = max(1, -(-size // batch_size)) if size < group else group // batch_size
        cap = -(-size // num_chunks)
        load = np.zeros((count, num_chunks))
        fill = np.zeros((count, num_chunks), np.int64)
        slot = np.full((count, num_chunks, cap), -1, np.int64)
        rows = np.arange(count)
        for j in range(size):
            avail = np.where(fill < cap, load, np.inf)
            c = np.argmin(avail, axis=1)
            slot[rows, c, fill[rows, c]] = mb[:, j]
            fill[rows, c] += 1
            load[rows, c] += lengths[mb[:, j]]
        flat = slot.reshape(-1)
        out.append(flat[flat >= 0])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def grouping_lengths(stats) -> np.ndarray:
    """The length InternVL-Chat's ``--group_by_length`` sorts by: a sample's text tokens plus, for a sample
    with an image, ``num_image_token x (max_dynamic_patch + thumbnail)`` -- one constant for every image
    sample, not its own tile count (InternVL's ``LazySupervisedDataset``). The constant here is the tile
    tokens of the table's largest sample (its tile rule's maximum, thumbnail included)."""
    convention = stats.convention or INTERNVL_CONVENTION
    per_tile = convention.tokens_per_tile
    text = stats.tokens.astype(np.float64) - per_tile * stats.tiles.astype(np.float64)
    image_tokens = per_tile * float(stats.tiles.max()) if len(stats) else 0.0
    return np.maximum(text, 0.0) + np.where(stats.tiles > 0, image_tokens, 0.0)


def balance_length_grouped(stats, *, dp_size, num_microbatches, seed, epoch, config):
    """LLaVA's / InternVL-Chat's length-grouped sampler: one mega-batch per optimizer step (both trainers pass
    ``world_size x gradient_accumulation_steps`` as the sampler's world size), sorted by
    :func:`grouping_lengths` and split into the step's micro-batches of balanced total length."""
    order = length_grouped_order(grouping_lengths(stats), group=dp_size * num_microbatches * config.batch_size,
                                 batch_size=config.batch_size, rng=epoch_rng(seed, epoch, stream=4))
    return _finish(stats, order, dp_size=dp_size, num_microbatches=num_microbatches, seed=seed, epoch=epoch,
                   config=config, method="length-grouped")
