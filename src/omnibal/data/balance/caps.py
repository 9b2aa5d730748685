"""Cap search: choose the number of packs and the (Q_v, Q_t) buffer.

The number of packs is a multiple of ``dp_size * num_microbatches`` (so every rank gets the same number of
steps and micro-batches, with no pack left over). With free caps it is chosen among the counts whose mean
samples per micro-batch is within ``samples_tolerance`` (relative, default 15%: 3.825-5.175 for the default
4.5) of ``target_samples`` -- never outside that window: where the text leaves no count of it room at the mean
pack, the caps of the window's counts rise until it does (a pad traded for pack size is a pad lost twice).

Every count of the window is judged at once (numpy over the counts, ``capmodel``): ``Q_t`` is the mean pack
plus ``token_slack`` (never under the largest sample); the tile cap starts at the least of ``ceil(V/P)``,
``+1``, ``+2`` that passes the necessary conditions (``capmodel.feasible``: a pack of Q_v tiles holds at most
``k`` samples larger than ``Q_v/(k+1)``; ``CapModel.room_ok``: the tiles the text-heavy samples' packs lose
leave the packer room). Each count's score ``tile pad + token pad + 0.05 |ln(samples per pack / target)|``
is then bounded below by its value at that least tile cap, and counts are **measured in the order of their
bound** -- deal a subsample, run the packer's tile repair on it, read the tile cap 99.8% of its packs stay
under -- until the best measured score is no higher than the next bound (branch and bound: usually one or
two trials; at most ``max_trials``). Measuring beats predicting here: with tiles of 1, 3 and 5 (InternVL's
dynamic resolution) a pack of four samples can never reach an odd cap, which no closed formula here
predicts, and only the repaired packs show what the packer reaches. The subsample gets as many packs as keep
the full set's mean tiles per pack (whether a cap is reachable turns on that mean being just under an
integer); the token fill is judged from the mean pack, since the tail rule deals with outlier packs.

Fixed caps (``max_tiles``/``max_tokens``, a memory budget) instead give the smallest pack count whose mean
load leaves the packer ``token_slack`` of room (or, when none does, the smallest that passes the necessary
conditions); the packer adds whole steps of packs for whatever still does not fit.

Work: O(N log N) once, O(log N) numpy work per count of the window, and at most ``max_trials`` trials of a
16k-row subsample (each within its tile repair's work budget).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from omnibal.data.balance.capmodel import CapModel, abs_log, feasible, round_up, window
from omnibal.data.balance.exchange import Packs, Targets, repair_tiles
from omnibal.data.balance.floor import least_cap, least_token_cap_for
from omnibal.data.balance.layers import level_tokens
from omnibal.data.balance.packer import _deal
from omnibal.data.balance.phases import WorkBudget
from omnibal.errors import InputError

TRIAL_ROWS = 16384
"""Rows of the subsample a trial packs."""
OVER_SHARE = 0.002
SLACK_ROWS = 2 * TRIAL_ROWS
"""Over this many rows a tile cap leaves the packer ``tile_slack`` (0.8%) of spare tiles at least: a trial's
subsample fluctuates by more than the spare a cap just over V/P leaves (1.2M real rows at DP 8 chose V/P
17.99 under a cap of 18 that the subsample reached and the full set did not: tile pad 0.057)."""
TRIAL_WORK_PER_ROW = 64
"""Candidate exchanges per row a trial's tile repair may weigh (after the type matching)."""
"""Share of a trial's packs that may stay over its tile cap (the tail rule takes care of those)."""


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
    runners_up: tuple[tuple[int, int, int], ...] = ()
    """(steps, Q_v, Q_t) of the next best counts the search measured, best first: the packer falls back on
    them when the chosen one needs the tail rule (what the subsample did not show)."""
    runners_up_bounds: tuple[float, ...] = ()
    """Per runner-up, the lowest pad score its packing can reach (``least_score``): the packer packs one whose
    bound beats the chosen count's packed score too (the searched Q_t is room for the packer; its token
    squeeze often ends lower)."""


def _fixed_cap_steps(model: CapModel, num_steps: int | None) -> np.ndarray:
    """A budget: the fewest steps whose mean pack fits, then the next few counts if they pad less. When
    none leaves the slack, the fewest that pass the necessary conditions (the packer adds packs for what
    still does not fit); an InputError only when not even one sample per pack could fit."""
    mv, mt = model.max_tiles or np.inf, model.max_tokens or np.inf
    lo = max(1, math.ceil(max(model.total_v / mv, model.total_t / mt) / model.slots_per_step))
    counts = np.arange(lo, model.max_steps + 1)
    ok = model.ok(counts) if len(counts) else np.zeros(0, bool)
    if num_steps is not None and lo <= num_steps <= model.max_steps:
        return np.array([num_steps])
    if ok.any():
        first = int(np.argmax(ok))
        return counts[first:first + 4][ok[first:first + 4]]
    passing = model.feasible(counts, *model.caps_for(counts)) if len(counts) else ok
    if not passing.any():
        raise InputError(f"no pack count fits the caps tiles={model.max_tiles} tokens={model.max_tokens} with "
                         f"{model.slots_per_step} micro-batches per step (largest sample: {int(model.v_asc[-1])} "
                         f"tiles, {int(model.t_asc[-1])} tokens)", source="caps", field="max_tokens")
    return counts[int(np.argmax(passing))][None]


def _room_tokens(model: CapModel, steps: np.ndarray, qv: np.ndarray, qt: np.ndarray) -> np.ndarray:
    """Per count, the least token cap >= ``qt`` (a multiple of the token multiple, or ``qt`` itself) at which
    ``room_ok`` holds with ``qv``: raising Q_t lets the text-heavy samples' packs hold more tiles, which can
    pad less than a larger Q_v or another count (bisection on all counts at once: the room grows with Q_t;
    nan where even a Q_t over every sample's text leaves no room)."""
    ok = model.room_ok(steps, qv, qt)
    if ok.all() or not len(model.text_desc):
        return qt.astype(np.float64)
    mult = model.token_multiple
    lo = qt.astype(np.float64)
    hi = round_up(float(model.text_desc[0]) + model.per_tile * qv + mult, mult)
    reachable = model.room_ok(steps, qv, hi)
    hi = np.where(ok, lo, hi)
    while True:
        open_ = (hi - lo > mult) & ~ok
        if not open_.any():
            break
        mid = round_up((lo + hi) / 2, mult)
        mid = np.where(mid < hi, mid, hi - mult)
        good = model.room_ok(steps, qv, mid)
        lo = np.where(open_ & ~good, mid, lo)
        hi = np.where(open_ & good, mid, hi)
    return np.where(ok, qt, np.where(reachable, hi, np.nan))


def _candidates(model: CapModel, steps: np.ndarray, token_slack: float, extra: int = 3):
    """(steps, Q_v, Q_t) to rank: per count, Q_v from ``ceil(V/P)`` to ``+ extra - 1`` that pass
    ``feasible``, each with the mean pack's Q_t, or the least higher Q_t that leaves the text room."""
    p = model.packs(steps)
    qt0 = model.caps_for(steps)[1]
    tight = model.tight_tiles(steps)
    if model.n > SLACK_ROWS:  # a trial sees a small share: it cannot tell a cap the full set just reaches
        tight = np.maximum(tight, np.ceil(model.total_v / p / (1 - model.tile_slack) - 1e-9))
    out_s, out_v, out_t = [], [], []
    for add in range(extra):
        qv = tight + add
        qt = _room_tokens(model, steps, qv, qt0)
        good = ~np.isnan(qt) & feasible(model.v_asc, qv, p)
        qt_ok = np.where(good, qt, qt0)
        good &= feasible(model.t_asc, qt_ok, p) & (model.total_t <= qt_ok * p * (1 - token_slack / 2))
        out_s.append(steps[good])
        out_v.append(qv[good])
        out_t.append(qt_ok[good])
    return np.concatenate(out_s), np.concatenate(out_v), np.concatenate(out_t)


def _least_caps(model: CapModel, steps: np.ndarray, most: int = 64):
    """The fallback when no count passes with its tile cap at most two over ``ceil(V/P)``: per count (at
    most ``most``, evenly spread over the window) the least tile cap that passes ``feasible`` and the room
    for the dominant size (``floor.least_cap``) and leaves ``TEXT_SPARE`` tiles per pack, with the least token
    cap that leaves the text room from there; the search ranks them like the others."""
    pick = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), most)).round().astype(np.int64))
    steps = steps[pick]
    p = model.packs(steps)
    qv = np.array([least_cap(model.v_asc, model.total_v, int(pk), 1, tiles=True) for pk in p.tolist()], np.float64)
    qv = np.maximum(qv, np.ceil((model.total_v + 0.011 * p) / p))
    qt0 = model.caps_for(steps)[1]
    qt0 = np.maximum(qt0, [least_cap(model.t_asc, model.total_t, int(pk), model.token_multiple, tiles=False)
                           for pk in p.tolist()])
    qt = _room_tokens(model, steps, qv, qt0)
    qt = np.where(np.isnan(qt), qt0, qt)
    return steps, qv, qt


class _Trials:
    """Trials of a subsample (module docstring): one per pack count, its measured score and tile cap."""

    def __init__(self, model: CapModel, tiles, tokens, target_samples: float, sub_size: int = TRIAL_ROWS) -> None:
        self.model, self.target = model, target_samples
        n = len(tiles)
        self.v_all = np.asarray(tiles, np.float64)
        if n > sub_size:
            self.rows = np.sort(np.random.default_rng(12345).choice(n, sub_size, replace=False))
        else:
            self.rows = np.arange(n)
        self.v = self.v_all[self.rows]
        self.t = np.asarray(tokens, np.float64)[self.rows]
        self.sub = n > sub_size
        self.total_v_all = max(float(self.v_all.sum()), 1.0)

    def packs_sub(self, steps):
        """Subsample packs per count: as many as give it the full set's mean tiles per pack (rounded to
        more packs): whether a cap is reachable turns on that mean being just under an integer."""
        p = self.model.packs(steps)
        if not self.sub:
            return p
        v_sub = float(self.v.sum())
        return np.maximum(1, np.minimum(len(self.rows), np.ceil(v_sub * p / self.total_v_all - 1e-9)))

    def bound(self, steps, q_least, qt):
        """A lower bound of each count's measured score (the measured tile cap is at least ``q_least``)."""
        p_sub = self.packs_sub(steps)
        pad_v = 1 - float(self.v.sum()) / p_sub / np.maximum(q_least, 1.0)
        pad_t = 1 - float(self.t.sum()) / p_sub / np.maximum(qt, 1.0)
        off = 0.0 if self.model.fixed else abs_log(self.model.n / self.model.packs(steps) / self.target)
        return pad_v + pad_t + 0.05 * off

    def measure(self, steps: int, q_least: int, qt: int) -> tuple[float, int, int]:
        """(score, tile cap, token cap) of one count: deal the subsample at (``q_least``, ``qt``), repair its
        tiles and level its tokens (the packer's own phases), read the tile cap ``1 - OVER_SHARE`` of its
        packs stay under (never under ``q_least``). The token cap stays ``qt`` when the tokens over it, in
        tiles, fit the spare tiles (the packer trades tiles for text there: text-heavy samples go to packs
        a few tiles short); when they do not (packs of many small samples, each with its text, and no tiles
        to spare) it is what ``1 - OVER_SHARE`` of the packs stay under."""
        p_sub = int(self.packs_sub(steps))
        rng = np.random.default_rng(0)
        packs = Packs(_deal(self.v, self.t, self.t, p_sub, q_least, qt, rng), self.v, self.t, self.t)
        # tiles alone (the text-heavy packs' loss is the model's text_room check): it reads the tile fill
        targets = dataclasses.replace(Targets.of(self.v, self.t, self.t, p_sub, q_least, qt, None),
                                      tokens_per_tile=np.inf)
        repair_tiles(packs, targets, rng, budget=WorkBudget.per_row(len(self.v), TRIAL_WORK_PER_ROW, 0))
        # a few stragglers go to the tail rule later; the bulk sets the buffer
        at = min(max(int(math.ceil(OVER_SHARE * p_sub)) - 1, 0), p_sub - 1)
        cap_v = max(float(q_least), float(np.sort(packs.pv)[::-1][at]), 1.0)
        while not self.model.room_ok(steps, cap_v, qt) and cap_v < packs.pv.max():
            cap_v += 1
        cap_t = float(qt)
        if self.model.max_tokens is None and np.isfinite(self.model.per_tile):
            level_tokens(packs, rng)
            need = float(np.maximum(packs.pt - qt, 0).sum()) / self.model.per_tile
            if need > p_sub * cap_v - float(self.v.sum()):
                cap_t = max(cap_t, round_up(float(np.sort(packs.pt)[::-1][at]), self.model.token_multiple))
        score = float(self.bound(np.array([steps]), np.array([cap_v]), np.array([cap_t]))[0])
        return score, int(cap_v), int(cap_t)


def _search(model: CapModel, trials: _Trials | None, steps: np.ndarray, q_least: np.ndarray, qt: np.ndarray,
            target_samples: float, max_trials: int, min_measured: int = 2) -> list[tuple[int, int, int]]:
    """Branch and bound over the counts (module docstring): measure in the order of the bound until the best
    measured score is no higher than the next bound, or ``max_trials`` trials ran. Returns the measured
    (steps, Q_v, Q_t), best first. A fixed tile cap is returned as it is (the trials only rank the counts).
    At least ``min_measured`` counts are measured (when there are as many): the packer's fall-backs."""
    if trials is None or len(steps) == 1:
        k = int(np.argmin(model.score(steps, target_samples, q_least, qt)))
        return [(int(steps[k]), int(q_least[k]), int(qt[k]))]
    bound = trials.bound(steps, q_least, qt)
    order = np.lexsort((steps, bound))  # exact keys, ties by the count: the same order on every machine
    measured = []
    for done, k in enumerate(order.tolist()):
        # (min_measured counts are always measured: the packer's fall-backs when the best needs the tail rule)
        if done >= max_trials or (len(measured) >= min_measured and bound[k] >= min(measured)[0]):
            break
        score, cap_v, cap_t = trials.measure(int(steps[k]), int(q_least[k]), int(qt[k]))
        if model.max_tiles is not None:
            cap_v = int(q_least[k])
        measured.append((score, done, int(steps[k]), cap_v, cap_t))
    return [m[2:] for m in sorted(measured)]


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
    min_measured: int = 2,
) -> CapChoice:
    """Pick the pack count and the caps (see the module docstring). ``slots_per_step = dp_size * M``;
    ``rng`` None: no trials (the best closed-form score); ``min_measured``: counts measured at least (the
    best and ``min_measured - 1`` runners-up, for the packer to fall back on)."""
    n = len(tiles)
    if n < slots_per_step:
        raise InputError(f"dp_size x num_microbatches = {slots_per_step} micro-batches per step, but only {n} "
                         f"samples: some ranks would get no data", source="dp_size", field="dp_size")
    model = CapModel(tiles, tokens, slots_per_step=slots_per_step, max_tiles=max_tiles, max_tokens=max_tokens,
                     token_slack=token_slack, tile_slack=tile_slack, token_multiple=token_multiple)
    trials = _Trials(model, tiles, tokens, target_samples) if rng is not None else None
    if model.fixed:
        steps = _fixed_cap_steps(model, num_steps)
        qv, qt = model.caps_for(steps)
        if model.max_tiles is None:
            found = _candidates(model, steps, token_slack)
            if len(found[0]):
                steps, qv, qt = found
        return _choice(_search(model, trials, steps, qv, qt, target_samples, max_trials, min_measured), model,
                       target_samples)
    lo_s, hi_s = window(model, target_samples, samples_tolerance)
    steps, qv, qt = _candidates(model, np.arange(lo_s, hi_s + 1), token_slack)
    if not len(steps):  # no count of the window leaves room with 2 more tiles: the least caps that do
        steps, qv, qt = _least_caps(model, np.arange(lo_s, hi_s + 1))
    return _choice(_search(model, trials, steps, qv, qt, target_samples, max_trials, min_measured), model,
                   target_samples)


def least_score(model: CapModel, steps: int, max_tiles: int, target_samples: float) -> float:
    """The lowest pad score (tile pad + token pad + 0.05 |ln(samples per pack / target)|, the packer's) any
    packing of ``steps`` steps under a tile cap ``max_tiles`` reaches: the token cap at least the mean pack,
    the largest sample and what the text coupling needs (``floor.least_token_cap_for``)."""
    p = int(model.packs(steps))
    mult = model.token_multiple
    least_t = round_up(max(model.total_t / p, float(model.t_asc[-1])), mult)
    qt = least_token_cap_for(model, p, int(max_tiles), least_t, mult) if len(model.text_desc) else least_t
    return (2 - model.total_v / (p * max(max_tiles, 1)) - model.total_t / (p * qt)
            + 0.05 * abs_log(model.n / p / target_samples))


def _choice(ranked: list[tuple[int, int, int]], model: CapModel, target_samples: float) -> CapChoice:
    (s, q, t), others = ranked[0], tuple(ranked[1:])
    bounds = tuple(least_score(model, o[0], o[1], target_samples) for o in others)
    return CapChoice(num_steps=s, num_packs=s * model.slots_per_step, max_tiles=q, max_tokens=t, runners_up=others,
                     runners_up_bounds=bounds)
