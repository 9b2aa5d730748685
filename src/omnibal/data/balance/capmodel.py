"""What the cap search and the pad floors judge a pack count by: the sorted sizes, totals and text of the
samples (O(N log N) once), and closed-form necessary conditions evaluated for every pack count of a window
at once (numpy arrays of counts; elementwise IEEE arithmetic, so the same on every machine).

Necessary conditions of caps ``(Q_v, Q_t)`` for ``P`` packs:

* the mean pack and the largest sample fit;
* ``_feasible``: a pack of cap ``Q`` holds at most ``k`` samples larger than ``Q/(k+1)``;
* ``text_room`` (free caps): a sample's tokens are ``tpt`` per tile plus its text, so a pack holding text
  ``x`` takes at most ``(Q_t - x) / tpt`` tiles; the tiles the text-heavy samples' packs lose must leave
  the packer some spare.
"""

from __future__ import annotations

import math

import numpy as np

from omnibal.data.balance.common import exact_sum
from omnibal.data.balance.exchange import min_tokens_per_tile
from omnibal.errors import InputError

TEXT_SPARE = 0.01
"""Tiles per pack ``text_room`` must leave (free caps). Measured on the synthetic mixture: with 0.003 left
(30,730 rows at DP 8, 775 steps; 20k rows at 4 x 4, 253 steps) the packer leaves packs over the caps in some
epochs and adds a step or grows the buffer; with 0.018 (776 steps; DP 32, 194 steps) it fills them."""

TEXT_LOSS_FACTOR = 1.5
"""How many times ``text_room`` counts the tiles the text-heavy samples' packs lose: once is the bound, and the
packer needs some spare beyond it to move those samples around (measured on a text-heavy 50k mixture at
DP 32: 2 picked 16 tiles at V/P 15.34, pads 0.041 / 0.016; 1.5 picks 16 at 15.54, 0.029 / 0.014; 1 leaves
packs over the caps and costs steps)."""

_LN2 = 0.6931471805599453
"""ln 2, the double nearest it."""


def abs_log(x):
    """``|ln x|`` (x > 0; a float or an array) from IEEE +, -, *, / alone, so the cap search ranks its
    candidates alike on every machine (libm's ``log`` may differ in the last bit between builds, e.g. with
    and without FMA): with ``x = m 2**e`` (``m`` in [0.7, 1.4)), ``ln m = 2 atanh(s)``, ``s = (m - 1) / (m +
    1)``, by its series (``|s| < 0.18``: 24 terms are far below a double's precision)."""
    scalar = np.ndim(x) == 0
    m, e = np.frexp(np.asarray(x, np.float64))
    low = m < 0.7
    m = np.where(low, 2.0 * m, m)
    e = np.where(low, e - 1, e).astype(np.float64)
    s = (m - 1.0) / (m + 1.0)
    s2, term, series = s * s, s, np.zeros_like(s)
    for k in range(24):
        series = series + term / (2 * k + 1)
        term = term * s2
    out = np.abs(2.0 * series + e * _LN2)
    return float(out) if scalar else out


def round_up(x, multiple: int):
    """``x`` rounded up to a multiple of ``multiple`` (a float or an array; an int for a float)."""
    if np.ndim(x) == 0:
        return int(math.ceil(x / multiple - 1e-9) * multiple)
    return np.ceil(np.asarray(x, np.float64) / multiple - 1e-9) * multiple


def feasible(sorted_asc: np.ndarray, cap, num_packs, depth: int = 4):
    """Necessary condition: at most k samples larger than cap/(k+1) fit in one pack, for k = 0..depth
    (``cap`` and ``num_packs`` floats or arrays of the same shape)."""
    cap = np.asarray(cap, np.float64)
    packs = np.asarray(num_packs, np.float64)
    n = len(sorted_asc)
    if n == 0:
        return np.ones(np.shape(cap), bool) if np.ndim(cap) else True
    ok = sorted_asc[-1] <= cap
    for k in range(1, depth + 1):
        bigger = n - np.searchsorted(sorted_asc, cap / (k + 1), side="right")
        ok = ok & (bigger <= k * packs)
    return ok if np.ndim(ok) else bool(ok)


class CapModel:
    """The sorted sizes and totals every candidate pack count is judged by (O(N log N) once). Methods
    taking ``steps``/``qv``/``qt`` accept numbers or arrays of one shape."""

    def __init__(self, tiles, tokens, *, slots_per_step, max_tiles, max_tokens, token_slack, tile_slack,
                 token_multiple) -> None:
        self.n = len(tiles)
        self.slots_per_step = slots_per_step
        self.max_tiles, self.max_tokens = max_tiles, max_tokens
        self.fixed = max_tiles is not None or max_tokens is not None
        self.token_slack, self.tile_slack, self.token_multiple = token_slack, tile_slack, token_multiple
        self.total_v, self.total_t = float(np.sum(tiles, dtype=np.int64)), float(np.sum(tokens, dtype=np.int64))
        self.v_asc = np.sort(np.asarray(tiles, np.float64))
        self.t_asc = np.sort(np.asarray(tokens, np.float64))
        self.max_steps = self.n // slots_per_step
        # text of every sample (tokens less the tiles' share), largest first: a pack holding text x takes
        # at most (Q_t - x) / tokens_per_tile tiles, which caps the tiles all packs together can hold
        v, t = np.asarray(tiles, np.float64), np.asarray(tokens, np.float64)
        self.per_tile = min_tokens_per_tile(v, t)
        self.text_desc = np.sort(t - self.per_tile * v)[::-1] if np.isfinite(self.per_tile) else np.zeros(0)
        # prefix sums of the heaviest texts: text_room is O(log N) per candidate count
        self.text_prefix = np.concatenate([[0.0], np.cumsum(self.text_desc)])
        self.text_neg_asc = -self.text_desc  # ascending, for searchsorted
        self.text_negative = exact_sum(np.minimum(self.text_desc, 0))

    def packs(self, steps):
        return np.asarray(steps, np.float64) * self.slots_per_step

    def tight_tiles(self, steps):
        """``max(ceil(V/P), largest sample)``: no tile cap is lower."""
        return np.maximum(np.ceil(self.total_v / self.packs(steps) - 1e-9), self.v_asc[-1])

    def caps_for(self, steps):
        """(Q_v, Q_t) for ``steps``: the fixed caps, or the mean pack plus the slack (never under the
        largest sample); ints for a number of steps, float arrays for an array."""
        p = self.packs(steps)
        qv = (np.full(np.shape(p), float(self.max_tiles)) if self.max_tiles is not None else
              np.maximum(np.ceil(self.total_v / p / (1 - self.tile_slack) - 1e-9), self.v_asc[-1]))
        qt = (np.full(np.shape(p), float(self.max_tokens)) if self.max_tokens is not None else
              np.maximum(round_up(self.total_t / p / (1 - self.token_slack), self.token_multiple), self.t_asc[-1]))
        return (int(qv), int(qt)) if np.ndim(steps) == 0 else (qv, qt)

    def text_room(self, steps, qv, qt):
        """Tiles per pack left over once the text-heavy samples' packs lose the tiles their text takes,
        counting that loss more than once: with ``q = min(Q_v, Q_t / tpt)`` (the most tiles a pack's tokens allow) a
        pack holding text x takes at most ``(Q_t - x) / tpt`` tiles, and these losses add up (a pack holding
        two such samples loses at least the sum), so ``P q - V - loss < 0`` is infeasible. The packer needs
        about as much spare again to move the text-heavy samples around (measured on the synthetic
        mixture: 0.078 tiles per pack lost), hence the loss counted ``TEXT_LOSS_FACTOR`` times; data without
        text-heavy samples (loss 0) is not constrained by it."""
        p = self.packs(steps)
        qt = np.asarray(qt, np.float64)
        q = np.minimum(np.asarray(qv, np.float64), np.floor(qt / self.per_tile + 1e-9))
        # the k samples whose text leaves room for fewer than q tiles each lose q - (Q_t - x) / tpt (> 0)
        k = np.searchsorted(self.text_neg_asc, -(qt - q * self.per_tile), side="left")
        lost = np.maximum(k * q - (k * qt - self.text_prefix[k]) / self.per_tile, 0.0)
        room = (q * p - self.total_v - TEXT_LOSS_FACTOR * lost) / p
        return float(room) if np.ndim(room) == 0 else room

    def text_loss(self, qv: int, qt: float) -> float:
        """Tiles every packing at caps (Q_v, Q_t) leaves empty, at least (a bound, unlike ``text_room``): with
        ``c`` = tokens_per_tile (any c > 0 is valid) and x = tokens - c tiles, a pack holds ``c pv + X <= Q_t``,
        so it is at least ``(X - r) / c`` tiles short of Q_v with ``r = Q_t - c Q_v``; summed over packs that
        is at least the text above ``r`` of every sample, less the negative x, over ``c``."""
        r = qt - self.per_tile * qv
        if r < 0 or not len(self.text_desc):  # no bound beyond the totals (P Q_t >= T)
            return 0.0
        k = int(np.searchsorted(self.text_neg_asc, -r, side="left"))  # samples with x > r
        return max(float(self.text_prefix[k]) - k * r + self.text_negative, 0.0) / self.per_tile

    def room_ok(self, steps, qv, qt):
        """Free caps: the text-heavy samples leave the packer ``TEXT_SPARE`` tiles per pack (``text_room``)."""
        if self.fixed or not len(self.text_desc):
            return np.ones(np.shape(steps), bool) if np.ndim(steps) else True
        return self.text_room(steps, qv, qt) >= TEXT_SPARE

    def feasible(self, steps, qv, qt):
        p = self.packs(steps)
        return feasible(self.v_asc, qv, p) & feasible(self.t_asc, qt, p)

    def ok(self, steps):
        """The mean pack leaves the packer room and the big samples fit (necessary conditions)."""
        p = self.packs(steps)
        qv, qt = self.caps_for(steps)
        return ((self.total_v <= qv * p) & (self.total_t <= qt * p * (1 - self.token_slack / 2))
                & self.feasible(steps, qv, qt) & self.room_ok(steps, qv, qt))

    def score(self, steps, target_samples: float, qv=None, qt=None):
        """Predicted padding of both buffers (plus, with free caps, the distance to the target)."""
        p = self.packs(steps)
        if qv is None:
            qv, qt = self.caps_for(steps)
        qv = np.asarray(qv, np.float64)
        pad_v = np.where(qv > 0, 1 - self.total_v / (np.maximum(qv, 1) * p), 0.0)
        pad_t = 1 - self.total_t / (np.asarray(qt, np.float64) * p)
        off = 0.0 if self.fixed else abs_log(self.n / p / target_samples)
        out = pad_v + pad_t + 0.05 * off
        return float(out) if np.ndim(out) == 0 else out


def window(model: CapModel, target_samples: float, samples_tolerance: float) -> tuple[int, int]:
    """The step counts whose mean samples per micro-batch is within ``samples_tolerance`` of the target."""
    if target_samples <= 0:
        raise InputError(f"must be > 0, got {target_samples}", source="target_samples", field="target_samples")
    n, per_step = model.n, model.slots_per_step
    lo_s = max(1, int(math.ceil(n / (target_samples * (1 + samples_tolerance) * per_step) - 1e-9)))
    hi_s = int(math.floor(n / (max(target_samples * (1 - samples_tolerance), 0.5) * per_step) + 1e-9))
    return lo_s, max(lo_s, min(model.max_steps, hi_s))
