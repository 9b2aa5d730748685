"""Cap search: choose the number of packs and the (Q_v, Q_t) buffer.

The number of packs is a multiple of ``dp_size * num_microbatches`` (so every rank gets the same number of
steps and micro-batches, with no pack left over), chosen among the counts that give a mean of
``target_samples`` samples per micro-batch (+-10%) by the lowest predicted padding:

* tile pad: ``1 - (V/P) / Q_v`` with ``Q_v = ceil(V/P / (1 - tile_slack))``: the packer needs a little room
  (``tile_slack``) to fill tiles and tokens at once, and V/P lands just under an integer for some counts;
* feasibility: a pack of Q_v tiles holds at most ``k`` samples larger than ``Q_v/(k+1)`` tiles, so counts
  whose cap cannot hold the big samples are skipped (the same for tokens).

The few best-predicted counts (with Q_v and Q_v + 1) are then tried by dealing a 16k-sample subsample and
measuring the padding: with odd tile counts (1, 3, 5 tiles) a pack of 4 samples cannot reach an odd cap,
which no closed formula here predicts.

Fixed caps (``max_tiles``/``max_tokens``, a memory budget) instead give the smallest pack count whose mean
load leaves the packer ``token_slack`` of room. Everything here is O(N log N) once plus O(1) per candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from omnibal.errors import InputError


@dataclass(frozen=True, kw_only=True)
class CapChoice:
    """The chosen pack count and buffer."""

    num_steps: int
    """Optimizer steps in the epoch."""
    num_packs: int
    """num_steps * dp_size * num_microbatches."""
    max_tiles: int
    """Q_v."""
    max_tokens: int
    """Q_t."""


def _feasible(sorted_asc: np.ndarray, cap: float, num_packs: int, depth: int = 4) -> bool:
    """Necessary condition: at most k samples larger than cap/(k+1) fit in one pack, for k = 0..depth."""
    n = len(sorted_asc)
    if n == 0:
        return True
    if sorted_asc[-1] > cap:
        return False
    for k in range(1, depth + 1):
        bigger = n - int(np.searchsorted(sorted_asc, cap / (k + 1), side="right"))
        if bigger > k * num_packs:
            return False
    return True


def _round_up(x: float, multiple: int) -> int:
    return int(math.ceil(x / multiple - 1e-9) * multiple)


def choose_caps(
    tiles: np.ndarray,
    tokens: np.ndarray,
    *,
    slots_per_step: int,
    target_samples: float = 4.5,
    max_tiles: int | None = None,
    max_tokens: int | None = None,
    token_slack: float = 0.015,
    tile_slack: float = 0.008,
    token_multiple: int = 8,
    rng: np.random.Generator | None = None,
    max_trials: int = 8,
    num_steps: int | None = None,
) -> CapChoice:
    """Pick the pack count and the caps (see the module docstring). ``slots_per_step = dp_size * M``."""
    n = len(tiles)
    if n < slots_per_step:
        raise InputError(f"dp_size x num_microbatches = {slots_per_step} micro-batches per step, but only {n} "
                         f"samples: some ranks would get no data", source="dp_size", field="dp_size")
    total_v, total_t = float(np.sum(tiles, dtype=np.int64)), float(np.sum(tokens, dtype=np.int64))
    v_asc = np.sort(np.asarray(tiles, np.float64))
    t_asc = np.sort(np.asarray(tokens, np.float64))
    max_steps = n // slots_per_step

    def caps_for(steps: int) -> tuple[int, int]:
        p = steps * slots_per_step
        qv = max_tiles if max_tiles is not None else max(int(math.ceil(total_v / p / (1 - tile_slack) - 1e-9)),
                                                         int(v_asc[-1]))
        qt = max_tokens if max_tokens is not None else max(
            _round_up(total_t / p / (1 - token_slack), token_multiple), int(t_asc[-1]))
        return qv, qt

    def ok(steps: int) -> bool:
        p = steps * slots_per_step
        qv, qt = caps_for(steps)
        return (total_v <= qv * p and total_t <= qt * p * (1 - token_slack / 2)
                and _feasible(v_asc, qv, p) and _feasible(t_asc, qt, p))

    if max_tiles is not None or max_tokens is not None:
        # a budget: the fewest packs that fit, then the next few counts if they pad less
        lo = max(1, math.ceil(max(total_v / (max_tiles or np.inf), total_t / (max_tokens or np.inf)) / slots_per_step))
        steps = next((s for s in range(lo, max_steps + 1) if ok(s)), None)
        if steps is None:
            raise InputError(f"no pack count fits the caps tiles={max_tiles} tokens={max_tokens} with "
                             f"{slots_per_step} micro-batches per step (largest sample: {int(v_asc[-1])} tiles, "
                             f"{int(t_asc[-1])} tokens)", source="caps", field="max_tokens")
        candidates = [s for s in range(steps, min(max_steps, steps + 3) + 1) if ok(s)]
        if num_steps is not None and lo <= num_steps <= max_steps:
            candidates = [num_steps]
    else:
        if target_samples <= 0:
            raise InputError(f"must be > 0, got {target_samples}", source="target_samples", field="target_samples")
        centre = n / (target_samples * slots_per_step)
        # step counts whose mean pack holds target_samples +- max(0.5, 10%) samples (4-5 for the default)
        half = max(0.5, 0.1 * target_samples)
        lo_s = max(1, int(math.ceil(n / ((target_samples + half) * slots_per_step))))
        hi_s = max(lo_s, min(max_steps, int(math.floor(n / (max(target_samples - half, 0.5) * slots_per_step)))))
        candidates = [s for s in range(lo_s, hi_s + 1) if ok(s)]
        if not candidates:  # widen: any count that is feasible, nearest the target first
            candidates = sorted((s for s in range(1, max_steps + 1) if ok(s)), key=lambda s: abs(s - centre))[:8]
        if not candidates:
            candidates = [max(1, min(max_steps, round(centre)))]

    def score(steps: int) -> float:
        p = steps * slots_per_step
        qv, qt = caps_for(steps)
        pad_v = 1 - total_v / (qv * p) if qv else 0.0
        pad_t = 1 - total_t / (qt * p)
        off = abs(math.log(n / p / target_samples)) if max_tiles is None and max_tokens is None else 0.0
        return pad_v + pad_t + 0.05 * off

    ranked = sorted(candidates, key=score)[:max_trials]
    trials = []
    for steps in ranked:
        qv, qt = caps_for(steps)
        tight = max(int(math.ceil(total_v / (steps * slots_per_step) - 1e-9)), int(v_asc[-1]))
        options = [qv] if max_tiles is not None else sorted({tight, qv, qv + 1})
        for q in options:
            if not _feasible(v_asc, q, steps * slots_per_step):
                continue
            trials.append((steps, q, qt))
    if not trials:
        steps = ranked[0]
        qv, qt = caps_for(steps)
        return CapChoice(num_steps=steps, num_packs=steps * slots_per_step, max_tiles=qv, max_tokens=qt)
    if rng is None or len(trials) == 1:
        steps, qv, qt = trials[0]
    else:
        steps, qv, qt = min(trials, key=lambda tr: _trial_pad(tiles, tokens, tr, slots_per_step, rng, target_samples,
                                                              max_tiles is None and max_tokens is None))
    return CapChoice(num_steps=steps, num_packs=steps * slots_per_step, max_tiles=qv, max_tokens=qt)


def _trial_pad(tiles, tokens, trial, slots_per_step, rng, target_samples, use_target, sub_size=16384) -> float:
    """Measured padding of a trial (steps, Q_v, Q_t): deal a subsample into proportionally fewer packs
    and read off how full both buffers are (tile counts are integers, so whether packs can be filled
    exactly depends on which sizes the data has -- cheaper to measure than to predict)."""
    from omnibal.data.balance.packer import _deal

    steps, qv, qt = trial
    n = len(tiles)
    p = steps * slots_per_step
    if n > sub_size:
        rows = np.sort(np.random.default_rng(12345).choice(n, sub_size, replace=False))
        p_sub = max(1, int(round(p * sub_size / n)))
    else:
        rows, p_sub = np.arange(n), p
    v = np.asarray(tiles, np.float64)[rows]
    t = np.asarray(tokens, np.float64)[rows]
    slots = _deal(v, t, t, p_sub, qv, qt, np.random.default_rng(0))
    pv = np.append(v, 0.0)[slots].sum(1)
    pt = np.append(t, 0.0)[slots].sum(1)
    # a few stragglers get repaired later; the bulk sets the buffer
    cap_v = max(float(qv) if (pv > qv).mean() < 0.002 else pv.max(), 1.0)
    cap_t = max(float(qt) if (pt > qt).mean() < 0.01 else np.percentile(pt, 99.5), 1.0)
    off = abs(math.log(n / p / target_samples)) if use_target else 0.0
    return (1 - pv.mean() / cap_v) + (1 - pt.mean() / cap_t) + 0.05 * off
