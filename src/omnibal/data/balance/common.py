"""What every balancing method shares: the per-epoch random streams and the split of samples over a fixed cap.

Lives below ``api`` (which imports every method) so that the methods never import ``api``: the module
graph of ``omnibal.data.balance`` stays acyclic.
"""

from __future__ import annotations

import numpy as np

from omnibal.errors import InputError
from omnibal.layout import OversizePolicy

OVERSIZE_POLICIES = tuple(OversizePolicy)


def epoch_rng(seed: int, epoch: int, stream: int = 0) -> np.random.Generator:
    """The generator every shuffle of (seed, epoch) draws from: independent streams per purpose."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), int(stream), 0x0B41]))


def split_oversize(stats, config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(regular rows, own-pack rows, dropped rows) under ``config.oversize`` and the fixed caps
    ``config.max_tiles`` / ``config.max_tokens`` (a :class:`~omnibal.data.balance.api.BalanceConfig`)."""
    over = np.zeros(len(stats), bool)
    if config.max_tiles is not None:
        over |= stats.tiles > config.max_tiles
    if config.max_tokens is not None:
        over |= stats.tokens > config.max_tokens
    rows = np.arange(len(stats), dtype=np.int64)
    if not over.any():
        return rows, rows[:0], rows[:0]
    bad = np.flatnonzero(over)
    if config.oversize == "error":
        listed = ", ".join(f"{int(i)} ({int(stats.tiles[i])} tiles, {int(stats.tokens[i])} tokens)" for i in bad[:10])
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise InputError(f"{len(bad)} samples exceed the caps (tiles {config.max_tiles}, tokens "
                         f"{config.max_tokens}): rows {listed}{more}; raise the caps or pass "
                         f"oversize='own_pack' or 'drop'", source=stats.source, record=int(bad[0]),
                         field="tokens" if config.max_tokens is not None and stats.tokens[bad[0]] > config.max_tokens
                         else "tiles")
    if config.oversize == "own_pack":
        return rows[~over], bad, rows[:0]
    return rows[~over], rows[:0], bad
