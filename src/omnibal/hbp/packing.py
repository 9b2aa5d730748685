"""One HBP level packed under its length by the existing balancer (:mod:`omnibal.hbp.balance`).

A level fixes the token cap (its length) and the pack count. Left free, the balancer's tile cap is the mean
tiles per pack plus under 1%, so its packer must hit the tile count and stay under the token cap at once,
and with a few samples per pack it leaves packs over the length (the balancer then refuses). A level
therefore also fixes the tile cap with room (``TILE_ROOM`` over the mean; vision balance across ranks is
the step assignment's job, which sorts packs by vision and LLM cost), and only when that still fails gets
a few more steps.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from omnibal.data.balance.api import balance
from omnibal.data.balance.schedule import Schedule
from omnibal.errors import InputError

TILE_ROOM = (1.25, 1.5)
"""Tile caps tried, as multiples of the mean tiles per pack (at least the largest sample's tiles)."""
STEP_TRIES = (0, 1, 2, 0.1, 0.2, 0.3, 0.45, 0.6)
"""More steps to try when a level cannot be packed: whole steps (integers) or a share of the steps (floats)."""


def balance_level(level_stats, length: int, num_steps: int, *, dp_size: int, num_microbatches: int, seed: int,
                  epoch: int, balance_config) -> Schedule:
    """The level's rows balanced for ``dp_size`` SP groups into packs of at most ``length`` tokens, in
    ``num_steps`` steps or, when they cannot be packed so, a few more. With ``balance_config.method`` ``isf``
    the level is packed naively instead (HBP's "+ hierarchical" ablation row): ISF packs, no tile cap."""
    if balance_config.method == "isf":  # naive packing: ISF at the level length, as many steps as it makes
        bconfig = replace(balance_config, max_tokens=int(length), oversize="error", num_steps=None,
                          max_tiles=int(np.sum(level_stats.tiles, dtype=np.int64)) + 1)
        return balance(level_stats, dp_size=dp_size, num_microbatches=num_microbatches, seed=seed, epoch=epoch,
                       config=bconfig)
    slots = dp_size * num_microbatches
    most = len(level_stats) // slots
    tries = sorted({num_steps + (t if isinstance(t, int) else math.ceil(num_steps * t)) for t in STEP_TRIES})
    total_tiles, largest = int(np.sum(level_stats.tiles, dtype=np.int64)), int(np.max(level_stats.tiles))
    error = None
    for steps in [t for t in tries if t <= most] or [num_steps]:
        for room in TILE_ROOM:
            max_tiles = max(math.ceil(total_tiles / (steps * slots) * room), largest, 1)
            bconfig = replace(balance_config, method="omnibal", max_tokens=int(length), max_tiles=max_tiles,
                              oversize="error", num_steps=steps)
            try:
                return balance(level_stats, dp_size=dp_size, num_microbatches=num_microbatches, seed=seed,
                               epoch=epoch, config=bconfig)
            except InputError as exc:
                error = exc
    raise InputError(f"level of length {length} ({len(level_stats)} samples) could not be packed under its length "
                     f"with {num_steps} or a few more steps: {error}", source=level_stats.source, field="pack_lengths")
