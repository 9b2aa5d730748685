"""Cap search: choose the number of packs and the (Q_v, Q_t) buffer.

The number of packs is a multiple of ``dp_size * num_microbatches`` (so every rank gets the same number of
steps and micro-batches, with no pack left over), chosen among the counts whose mean samples per
micro-batch is within ``samples_tolerance`` (relative, default 15%: 3.825-5.175 for the default 4.5) of
``target_samples`` by the lowest predicted padding:

* tile pad: ``1 - (V/P) / Q_v`` with ``Q_v = ceil(V/P / (1 - tile_slack))``: the packer needs a little room
  (``tile_slack``) to fill tiles and tokens at once, and V/P lands just under an integer for some counts;
* feasibility: a pack of Q_v tiles holds at most ``k`` samples larger than ``Q_v/(k+1)`` tiles, so counts
  whose cap cannot hold the big samples are skipped (the same for tokens).

The few best-predicted counts (with Q_v and Q_v + 1) are then tried by dealing a 16k-sample subsample,
running the packer's tile repair on it, and measuring the tile padding: with odd tile counts (1, 3, 5 tiles) a
pack of 4 samples cannot reach an odd cap, which no closed formula here predicts, and the dealt packs alone
misjudge it (the repair reaches caps the dealing misses). The token padding is judged from the mean pack
against the trial's Q_t (the tail rule deals with outlier packs, so they must not set the score). The
subsample gets as many packs as keep the full set's mean tiles per pack (whether a cap is reachable turns
on that mean being just under an integer).

``pad_floor`` is the proof of what no packer can beat: for each pack count the tolerance allows, a cap is at
least the mean pack and the largest sample (``ceil(V/P)``, ``max(T/P, t_max)``) and the least value that
passes the necessary conditions (the one above, and for tiles the room the dominant size leaves:
``_room_for_the_rest``), so each pad is at least ``1 - total / (P cap)``. Both at once (``larger``) also
counts the text coupling: a pack's tokens are ``c`` per tile plus its text, so the text-heavy samples' packs
hold fewer tiles, and a tight Q_v whose spare tiles cannot absorb that needs a larger Q_t
(``_CapModel.text_loss``; the synthetic default at 128 micro-batches a step: 0.0278, not 0.0075).

Fixed caps (``max_tiles``/``max_tokens``, a memory budget) instead give the smallest pack count whose mean
load leaves the packer ``token_slack`` of room (or, when none does, the smallest that passes the
feasibility check); the packer adds whole steps of packs for whatever still does not fit.
Everything here is O(N log N) once plus O(1) per candidate.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np

from omnibal.data.balance.common import exact_sum
from omnibal.data.balance.exchange import Packs, Targets, min_tokens_per_tile, repair_tiles
from omnibal.data.balance.packer import _deal
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


_TEXT_SPARE = 0.01
"""Tiles per pack ``text_room`` must leave (free caps). Measured on the synthetic mixture: with 0.003 left
(30,730 rows at DP 8, 775 steps; 20k rows at 4 x 4, 253 steps) the packer leaves packs over the caps in some
epochs and adds a step or grows the buffer; with 0.018 (776 steps; DP 32, 194 steps) it fills them."""


def abs_log(x: float) -> float:
    """``|ln x|`` (x > 0) from IEEE +, -, *, / alone, so the cap search ranks its candidates alike on every
    machine (libm's ``log`` may differ in the last bit between builds, e.g. with and without FMA): with
    ``x = m 2**e`` (``m`` in [0.7, 1.4)), ``ln m = 2 atanh(s)``, ``s = (m - 1) / (m + 1)``, by its series
    (``|s| < 0.18``: 24 terms are far below a double's precision)."""
    m, e = math.frexp(x)
    if m < 0.7:
        m, e = 2.0 * m, e - 1
    s = (m - 1.0) / (m + 1.0)
    s2, term, series = s * s, s, 0.0
    for k in range(24):
        series += term / (2 * k + 1)
        term *= s2
    return abs(2.0 * series + e * _LN2)


_LN2 = 0.6931471805599453
"""ln 2, the double nearest it."""


def _round_up(x: float, multiple: int) -> int:
    return int(math.ceil(x / multiple - 1e-9) * multiple)


class _CapModel:
    """The sorted sizes and totals every candidate pack count is judged by (O(N log N) once)."""

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
        # prefix sums of the heaviest texts: text_room is O(log N) per candidate count (thousands are tried)
        self.text_prefix = np.concatenate([[0.0], np.cumsum(self.text_desc)])
        self.text_neg_asc = -self.text_desc  # ascending, for searchsorted
        self.text_negative = exact_sum(np.minimum(self.text_desc, 0))

    def caps_for(self, steps: int) -> tuple[int, int]:
        """(Q_v, Q_t) for ``steps``: the fixed caps, or the mean pack plus the slack (never under the
        largest sample)."""
        p = steps * self.slots_per_step
        qv = self.max_tiles if self.max_tiles is not None else max(
            int(math.ceil(self.total_v / p / (1 - self.tile_slack) - 1e-9)), int(self.v_asc[-1]))
        qt = self.max_tokens if self.max_tokens is not None else max(
            _round_up(self.total_t / p / (1 - self.token_slack), self.token_multiple), int(self.t_asc[-1]))
        return qv, qt

    def text_room(self, steps: int, qv: int, qt: int) -> float:
        """Tiles per pack left over once the text-heavy samples' packs lose the tiles their text takes,
        counting that loss twice: with ``q = min(Q_v, Q_t / tpt)`` (the most tiles a pack's tokens allow) a
        pack holding text x takes at most ``(Q_t - x) / tpt`` tiles, and these losses add up (a pack holding
        two such samples loses at least the sum), so ``P q - V - loss < 0`` is infeasible. The packer needs
        about as much spare again to move the text-heavy samples around (measured on the synthetic
        mixture: 0.078 tiles per pack lost), hence the loss counted twice; data without text-heavy samples
        (loss 0) is not constrained by it."""
        p = steps * self.slots_per_step
        q = min(float(qv), math.floor(qt / self.per_tile + 1e-9))
        # the k samples whose text leaves room for fewer than q tiles each lose q - (Q_t - x) / tpt (> 0)
        k = int(np.searchsorted(self.text_neg_asc, -(qt - q * self.per_tile), side="left"))
        lost = max(k * q - (k * qt - float(self.text_prefix[k])) / self.per_tile, 0.0)
        return (q * p - self.total_v - 2 * lost) / p

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

    def room_ok(self, steps: int, qv: int, qt: int) -> bool:
        """Free caps: the text-heavy samples leave the packer ``_TEXT_SPARE`` tiles per pack (``text_room``)."""
        return self.fixed or not len(self.text_desc) or self.text_room(steps, qv, qt) >= _TEXT_SPARE

    def feasible(self, steps: int, qv: int, qt: int) -> bool:
        p = steps * self.slots_per_step
        return _feasible(self.v_asc, qv, p) and _feasible(self.t_asc, qt, p)

    def ok(self, steps: int) -> bool:
        """The mean pack leaves the packer room and the big samples fit (necessary conditions)."""
        p = steps * self.slots_per_step
        qv, qt = self.caps_for(steps)
        return (self.total_v <= qv * p and self.total_t <= qt * p * (1 - self.token_slack / 2)
                and self.feasible(steps, qv, qt) and self.room_ok(steps, qv, qt))

    def score(self, steps: int, target_samples: float) -> float:
        """Predicted padding of both buffers (plus, with free caps, the distance to the target)."""
        p = steps * self.slots_per_step
        qv, qt = self.caps_for(steps)
        pad_v = 1 - self.total_v / (qv * p) if qv else 0.0
        pad_t = 1 - self.total_t / (qt * p)
        off = 0.0 if self.fixed else abs_log(self.n / p / target_samples)
        return pad_v + pad_t + 0.05 * off


def _fixed_cap_steps(model: _CapModel, num_steps: int | None) -> list[int]:
    """A budget: the fewest steps whose mean pack fits, then the next few counts if they pad less. When
    none leaves the slack, the fewest that pass the necessary conditions (the packer adds packs for what
    still does not fit); an InputError only when not even one sample per pack could fit."""
    mv, mt = model.max_tiles or np.inf, model.max_tokens or np.inf
    lo = max(1, math.ceil(max(model.total_v / mv, model.total_t / mt) / model.slots_per_step))
    steps = next((s for s in range(lo, model.max_steps + 1) if model.ok(s)), None)
    if steps is None:
        steps = next((s for s in range(lo, model.max_steps + 1) if model.feasible(s, *model.caps_for(s))), None)
    if steps is None:
        raise InputError(f"no pack count fits the caps tiles={model.max_tiles} tokens={model.max_tokens} with "
                         f"{model.slots_per_step} micro-batches per step (largest sample: {int(model.v_asc[-1])} "
                         f"tiles, {int(model.t_asc[-1])} tokens)", source="caps", field="max_tokens")
    if num_steps is not None and lo <= num_steps <= model.max_steps:
        return [num_steps]
    return [steps] + [s for s in range(steps + 1, min(model.max_steps, steps + 3) + 1) if model.ok(s)]


def _window(model: _CapModel, target_samples: float, samples_tolerance: float) -> tuple[int, int]:
    """The step counts whose mean samples per micro-batch is within ``samples_tolerance`` of the target."""
    if target_samples <= 0:
        raise InputError(f"must be > 0, got {target_samples}", source="target_samples", field="target_samples")
    n, per_step = model.n, model.slots_per_step
    lo_s = max(1, int(math.ceil(n / (target_samples * (1 + samples_tolerance) * per_step) - 1e-9)))
    hi_s = int(math.floor(n / (max(target_samples * (1 - samples_tolerance), 0.5) * per_step) + 1e-9))
    return lo_s, max(lo_s, min(model.max_steps, hi_s))


def _free_cap_steps(model: _CapModel, target_samples: float, samples_tolerance: float) -> list[int]:
    """Step counts whose mean pack holds target_samples x (1 +- samples_tolerance) samples and that pass
    the necessary conditions; when none does, the feasible counts nearest the target."""
    lo_s, hi_s = _window(model, target_samples, samples_tolerance)
    centre = model.n / (target_samples * model.slots_per_step)
    candidates = [s for s in range(lo_s, hi_s + 1) if model.ok(s)]
    if not candidates:  # widen: any count that is feasible, nearest the target first
        candidates = sorted((s for s in range(1, model.max_steps + 1) if model.ok(s)),
                            key=lambda s: abs(s - centre))[:8]
    return candidates or [max(1, min(model.max_steps, round(centre)))]


@dataclass(frozen=True, kw_only=True)
class PadFloor:
    """The lowest pads any packing can reach with derived caps within the samples tolerance: bounds, not
    predictions. Per pack count ``P`` the caps are at least the least ones that hold the mean pack and the
    largest sample and pass the necessary conditions, so each pad is at least ``1 - total / (P cap)``."""

    tiles: float
    """The lowest tile pad of any pack count in the window."""
    tokens: float
    """The lowest token pad of any pack count in the window (Q_t a multiple of the token multiple)."""
    larger: float
    """The lowest over the window of the larger of the two (both pads cannot be lower at once), with the
    text coupling: at (P, Q_v) the token cap must also leave the text-heavy samples' packs the tiles they
    cannot hold (``_CapModel.text_loss``), so a tight Q_v can force Q_t up."""
    num_steps: int
    """The step count where ``larger`` is reached."""
    samples_per_microbatch: float
    """Mean samples per micro-batch at ``num_steps``."""


def _room_for_the_rest(sorted_asc: np.ndarray, cap: int, num_packs: int) -> bool:
    """Necessary condition on integer sizes dominated by one largest size ``b`` (chartqa: 91% five-tile
    samples): a pack holds at most ``k = cap // b`` of them, leaving room ``r = cap - k b``; samples bigger
    than ``r`` (but under ``b``) only fit in packs with ``d >= 1`` fewer, whose room ``r + d b`` holds at
    most ``(r + d b) // s`` of them (``s`` the smallest such size). The packs' missing ``b``-samples sum to
    ``D = k P - n_b``, so at most ``D max_d ((r + d b) // s) / d`` such samples fit."""
    b = float(sorted_asc[-1])
    if b <= 0:
        return True
    k = int(cap // b)
    n_b = len(sorted_asc) - int(np.searchsorted(sorted_asc, b, side="left"))
    deficit = k * num_packs - n_b
    if deficit < 0:
        return False
    r = cap - k * b
    lo, hi = int(np.searchsorted(sorted_asc, r, side="right")), len(sorted_asc) - n_b
    if hi <= lo:
        return True
    s = float(sorted_asc[lo])
    ratio = max(((r + d * b) // s) / d for d in range(1, k + 1))
    return hi - lo <= deficit * ratio


def _least_cap(sorted_asc: np.ndarray, total: float, packs: int, multiple: int, *, tiles: bool) -> int:
    """The smallest cap (a multiple of ``multiple``) that holds the mean pack and the largest sample and
    passes ``_feasible`` for ``packs`` packs (feasibility only grows with the cap: bisection); for tiles
    (small integer caps) also ``_room_for_the_rest``, cap by cap upwards (that condition is not monotone
    in the cap)."""
    lo = _round_up(max(total / packs, float(sorted_asc[-1])), multiple)
    if tiles:
        cap = lo
        while not (_feasible(sorted_asc, cap, packs) and _room_for_the_rest(sorted_asc, cap, packs)):
            cap += 1
        return cap
    if _feasible(sorted_asc, lo, packs):
        return lo
    hi = max(lo, _round_up(float(sorted_asc[-1]) * 5, multiple))  # 5 x the largest: passes every k <= 4
    while hi - lo > multiple:
        mid = _round_up((lo + hi) / 2, multiple)
        mid = mid if mid < hi else hi - multiple
        lo, hi = (lo, mid) if _feasible(sorted_asc, mid, packs) else (mid, hi)
    return hi


def _joint_pad(model: _CapModel, p: int, least: tuple[int, int], multiple: int) -> float:
    """The lowest larger pad of ``p`` packs over Q_v >= the least tile cap: at each Q_v the least Q_t
    (>= the least token cap) whose ``text_loss`` fits the ``p Q_v - V`` spare tiles (bisection: the loss
    only falls as Q_t grows). Q_v stops rising once its own pad reaches the best found (it does: the tile pad
    rises towards 1 with Q_v, and the first Q_v already gives a best below 1)."""
    cap_v, cap_t = least
    best = np.inf
    for qv in itertools.count(cap_v):
        pad_v = 1 - model.total_v / (p * qv)
        if pad_v >= best:
            break
        spare = p * qv - model.total_v
        lo = cap_t
        if model.text_loss(qv, lo) > spare:
            # at r >= the largest x no sample is over r: the loss is at most 0
            hi = max(lo, _round_up(float(model.text_desc[0]) + model.per_tile * qv, multiple))
            while hi - lo > multiple:
                mid = _round_up((lo + hi) / 2, multiple)
                mid = mid if mid < hi else hi - multiple
                lo, hi = (lo, mid) if model.text_loss(qv, mid) <= spare else (mid, hi)
            lo = hi
        best = min(best, max(pad_v, 1 - model.total_t / (p * lo)))
    return float(best)


def pad_floor(tiles, tokens, *, slots_per_step: int, target_samples: float = 4.5, samples_tolerance: float = 0.15,
              token_multiple: int = 8) -> PadFloor:
    """What no packer can beat within ``samples_tolerance`` of ``target_samples`` (see the module docstring):
    e.g. where the largest sample forces the token cap above every mean pack the window allows, or where
    the room the dominant tile size leaves forces the tile cap up (chartqa: 91% five-tile samples)."""
    model = _CapModel(tiles, tokens, slots_per_step=slots_per_step, max_tiles=None, max_tokens=None,
                      token_slack=0.0, tile_slack=0.0, token_multiple=token_multiple)
    lo_s, hi_s = _window(model, target_samples, samples_tolerance)
    steps = np.arange(lo_s, hi_s + 1)
    packs = steps * slots_per_step
    # closed forms (mean pack, largest sample) order the counts; the least caps, which can only be higher,
    # are computed until no remaining count's closed form can beat the best found (each count at most once)
    q_v = np.maximum(np.ceil(model.total_v / packs - 1e-9), model.v_asc[-1])
    q_t = np.ceil(np.maximum(model.total_t / packs, model.t_asc[-1]) / token_multiple - 1e-9) * token_multiple
    quick = np.stack([1 - model.total_v / (packs * np.maximum(q_v, 1)), 1 - model.total_t / (packs * q_t)], 1)
    exact: dict[int, tuple[float, float]] = {}
    caps: dict[int, tuple[int, int]] = {}

    def pads(k: int) -> tuple[float, float]:
        if k not in exact:
            p = int(packs[k])
            cap_v = max(_least_cap(model.v_asc, model.total_v, p, 1, tiles=True), 1)
            cap_t = _least_cap(model.t_asc, model.total_t, p, token_multiple, tiles=False)
            exact[k] = (1 - model.total_v / (p * cap_v), 1 - model.total_t / (p * cap_t))
            caps[k] = (cap_v, cap_t)
        return exact[k]

    def joint(k: int) -> float:
        pads(k)
        return _joint_pad(model, int(packs[k]), caps[k], token_multiple)

    def lowest(key, value) -> tuple[float, int]:
        best, at = np.inf, 0
        for k in np.argsort(key(quick), kind="stable"):
            if key(quick[k]) >= best:
                break
            v = value(int(k))
            best, at = (v, int(k)) if v < best else (best, at)
        return float(best), at

    larger, at = lowest(lambda x: np.max(x, axis=-1), joint)
    tiles_floor = lowest(lambda x: x[..., 0], lambda k: pads(k)[0])[0]
    return PadFloor(tiles=tiles_floor, tokens=lowest(lambda x: x[..., 1], lambda k: pads(k)[1])[0], larger=larger,
                    num_steps=int(steps[at]), samples_per_microbatch=model.n / int(packs[at]))


def _trials(model: _CapModel, ranked: list[int]) -> list[tuple[int, int, int]]:
    """(steps, Q_v, Q_t) to measure: each ranked count with its Q_v, and (free tile cap) the tight
    ``ceil(V/P)`` and ``Q_v + 1`` beside it."""
    trials = []
    for steps in ranked:
        qv, qt = model.caps_for(steps)
        tight = max(int(math.ceil(model.total_v / (steps * model.slots_per_step) - 1e-9)), int(model.v_asc[-1]))
        options = [qv] if model.max_tiles is not None else sorted({tight, qv, qv + 1})
        trials += [(steps, q, qt) for q in options
                   if _feasible(model.v_asc, q, steps * model.slots_per_step) and model.room_ok(steps, q, qt)]
    return trials


def choose_caps(
    tiles: np.ndarray,
    tokens: np.ndarray,
    *,
    slots_per_step: int,
    target_samples: float = 4.5,
    samples_tolerance: float = 0.15,
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
    model = _CapModel(tiles, tokens, slots_per_step=slots_per_step, max_tiles=max_tiles, max_tokens=max_tokens,
                      token_slack=token_slack, tile_slack=tile_slack, token_multiple=token_multiple)
    candidates = (_fixed_cap_steps(model, num_steps) if model.fixed
                  else _free_cap_steps(model, target_samples, samples_tolerance))
    ranked = sorted(candidates, key=lambda s: model.score(s, target_samples))[:max_trials]
    trials = _trials(model, ranked)
    if not trials:
        steps, (qv, qt) = ranked[0], model.caps_for(ranked[0])
    elif rng is None or len(trials) == 1:
        steps, qv, qt = trials[0]
    else:
        steps, qv, qt = min(trials, key=lambda tr: _trial_pad(tiles, tokens, tr, slots_per_step, rng,
                                                              target_samples, not model.fixed))
    return CapChoice(num_steps=steps, num_packs=steps * slots_per_step, max_tiles=qv, max_tokens=qt)


def _trial_pad(tiles, tokens, trial, slots_per_step, rng, target_samples, use_target, sub_size=16384) -> float:
    """Measured padding of a trial (steps, Q_v, Q_t): deal a subsample into proportionally fewer packs, run
    the packer's tile repair on them and read off the tile fill; the token fill is the mean pack's against
    Q_t. Tile counts are integers, so whether packs can be filled exactly depends on which sizes the data
    has -- cheaper to measure than to predict, and only the repaired packs show what the packer reaches."""
    steps, qv, qt = trial
    n = len(tiles)
    p = steps * slots_per_step
    v_all = np.asarray(tiles, np.float64)
    if n > sub_size:
        rows = np.sort(np.random.default_rng(12345).choice(n, sub_size, replace=False))
        # as many packs as give the subsample the full set's mean tiles per pack (rounded to more packs):
        # whether a cap is reachable turns on that mean being just under an integer
        p_sub = max(1, min(sub_size, int(math.ceil(v_all[rows].sum() * p / max(v_all.sum(), 1) - 1e-9))))
    else:
        rows, p_sub = np.arange(n), p
    v = v_all[rows]
    t = np.asarray(tokens, np.float64)[rows]
    trial_rng = np.random.default_rng(0)
    packs = Packs(_deal(v, t, t, p_sub, qv, qt, trial_rng), v, t, t)
    # tiles alone (the text-heavy packs' loss is the model's text_room check): cheaper, and it reads the fill
    targets = dataclasses.replace(Targets.of(v, t, t, p_sub, qv, qt, None), tokens_per_tile=np.inf)
    repair_tiles(packs, targets, trial_rng)
    # a few stragglers go to the tail rule later; the bulk sets the buffer
    cap_v = max(float(qv) if (packs.pv > qv).mean() < 0.002 else float(packs.pv.max()), 1.0)
    # the mean pack, not the outliers: the tail rule keeps every pack under Q_t (or grows it by a little)
    pad_t = 1 - float(t.sum()) / p_sub / max(float(qt), 1.0)
    off = abs_log(n / p / target_samples) if use_target else 0.0
    return (1 - float(packs.pv.mean()) / cap_v) + pad_t + 0.05 * off
