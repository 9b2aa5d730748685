"""What every balancing method shares: the per-epoch random streams, the split of samples over a fixed cap,
and the sort keys and sums that keep a schedule the same on every machine.

Every rank of a job builds the schedule on its own, so it must not depend on the CPU or the numpy build:
numpy's default (SIMD) sorts order equal keys differently on AVX-512 and AVX2 machines, and a float sum's
last bit depends on the order it is added in. So every ordering here is by keys that are all distinct
(``distinct_keys``) or by a stable sort, every cost that is summed is an integer (``BalanceCost.grid_costs``),
and the few sums of non-integer floats a decision reads are exactly rounded (``exact_sum``).

Lives below ``api`` (which imports every method) so that the methods never import ``api``: the module
graph of ``omnibal.data.balance`` stays acyclic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from omnibal.errors import InputError


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


def distinct_keys(values: np.ndarray, tiebreak: np.ndarray) -> np.ndarray:
    """int64 sort keys in the order of ``values``, equal values in the order of ``tiebreak`` (distinct
    integers under ``2**bits(len - 1)``, e.g. :func:`random_ranks`): the keys are all distinct, so every sort
    algorithm gives the same order. The values go on a grid of their range with as many steps as 62 bits
    leave beside the tie-break (2**41 for 1.2M values), so values closer than a step count as equal too."""
    values = np.asarray(values, np.float64)
    m = len(values)
    if m == 0:
        return np.zeros(0, np.int64)
    rank_bits = max(int(m - 1).bit_length(), 1)
    steps = 2.0 ** min(62 - rank_bits, 52)
    low, high = float(values.min()), float(values.max())
    grid = values - low
    if high > low:
        grid /= high - low
        grid *= steps
        np.floor(grid, out=grid)
        np.minimum(grid, steps - 1, out=grid)
    keys = grid.astype(np.int64)
    keys <<= rank_bits
    keys |= np.asarray(tiebreak, np.int64)
    return keys


@dataclass(frozen=True)
class TieBreak:
    """``m`` distinct integers under ``2**bits`` in a seeded order (:func:`tie_break`), with the inverse of the
    bijection that made them, so a sort of :func:`distinct_keys` built on them gives back positions."""

    ranks: np.ndarray
    """The tie-break of each position (int64)."""
    bits: int
    multipliers: tuple[int, int]
    offset: int

    def positions(self, ranks: np.ndarray) -> np.ndarray:
        """The position each of ``ranks`` (values of :attr:`ranks`) belongs to."""
        mask, shift = np.uint64((1 << self.bits) - 1), np.uint64((self.bits + 1) // 2)
        x = np.asarray(ranks).astype(np.uint64)
        for a in reversed(self.multipliers):  # undo: xor-shift (its own inverse: 2 x shift >= bits), then x*a+b
            x ^= x >> shift
            x -= np.uint64(self.offset)
            x *= np.uint64(pow(a, -1, 1 << self.bits))
            x &= mask
        return x.astype(np.int64)


def tie_break(m: int, rng: np.random.Generator) -> TieBreak:
    """``m`` distinct integers under ``2**bits(m - 1)`` in an order drawn from ``rng``: a tie-break for
    :func:`distinct_keys`. A seeded bijection of the positions (multiply by an odd number, xor-shift, twice,
    modulo ``2**bits``) rather than a permutation: as good for breaking ties, three times cheaper, and
    invertible (:meth:`TieBreak.positions`)."""
    bits = max(int(m - 1).bit_length(), 1)
    mask, shift = np.uint64((1 << bits) - 1), np.uint64((bits + 1) // 2)
    a1, a2, b = (int(x) for x in rng.integers(0, 1 << 62, 3))
    multipliers = (a1 | 1, a2 | 1)
    x = np.arange(m, dtype=np.uint64)
    for a in multipliers:
        x *= np.uint64(a)
        x += np.uint64(b)
        x &= mask
        x ^= x >> shift
    return TieBreak(ranks=x.astype(np.int64), bits=bits, multipliers=multipliers, offset=b)


def random_ranks(m: int, rng: np.random.Generator) -> np.ndarray:
    """:func:`tie_break`'s integers alone."""
    return tie_break(m, rng).ranks


def sorted_order(values: np.ndarray, ties: TieBreak, *, descending: bool = False) -> np.ndarray:
    """``np.argsort(distinct_keys(values, ties.ranks))`` (``descending``: of the keys negated), computed by a
    plain sort of the keys, several times faster than an argsort: the keys are distinct and their low bits
    are the tie-break, which :meth:`TieBreak.positions` maps back to positions."""
    keys = np.sort(distinct_keys(values, ties.ranks))
    if descending:
        keys = keys[::-1]
    keys &= (1 << max(int(len(keys) - 1).bit_length(), 1)) - 1
    return ties.positions(keys)


def stable_order(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` of non-negative integers, by a plain sort of each key with its
    position in the low bits where both fit in 63 bits (several times faster), else the argsort."""
    keys = np.asarray(keys)
    n = len(keys)
    bits = max(int(n - 1).bit_length(), 1)
    top = int(keys.max(initial=0))
    if n == 0 or int(keys.min(initial=0)) < 0 or top.bit_length() + bits > 63:
        return np.argsort(keys, kind="stable")
    packed = keys.astype(np.int64) << bits
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    packed &= (1 << bits) - 1
    return packed


def exact_sum(values: np.ndarray) -> float:
    """The sum of float ``values`` exactly rounded (``math.fsum``): the same whatever order numpy would
    add them in (a decision that compares a sum must not turn on its last bit)."""
    values = np.asarray(values, np.float64).ravel()
    return math.fsum(values[values != 0].tolist())
