"""Pad floors: what no packer can beat with derived caps within the samples tolerance (bounds, not predictions).

For each pack count ``P`` of the window a cap is at least the mean pack and the largest sample
(``ceil(V/P)``, ``max(T/P, t_max)``) and the least value that passes the necessary conditions
(``capmodel.feasible``, and for tiles the room the dominant size leaves: ``_room_for_the_rest``), so each pad
is at least ``1 - total / (P cap)``. Both at once (``larger``) and the compute pad (``compute``) also count
the text coupling: a pack's tokens are ``c`` per tile plus its text, so the text-heavy samples' packs hold
fewer tiles, and a tight Q_v whose spare tiles cannot absorb that needs a larger Q_t
(``CapModel.text_loss``); and the other way round, a Q_t at least the tokens the fullest packs hold
(``FullPacks``: where V/P is just over an integer, some packs must hold its ceiling in tiles, with their
samples' text).

**Compute pad** (what a fixed buffer wastes, priced on a cost model): every micro-batch runs ``(Q_v, Q_t)``,
the padding as one extra attention segment, so with ``c = vision_coef + llm_coef`` over ``(one, tiles,
tokens, tokens_sq)`` and ``R`` the cost of the samples themselves, the buffer costs at least ``R + c_1 (P Q_v
- V) + c_2 (P Q_t - T) + c_3 (P Q_t - T)**2 / P`` (the padding segments' squares sum to at least their
mean's), and the compute pad ``1 - R / buffer cost`` is at least that bound's.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from omnibal.data.balance.capmodel import CapModel, feasible, round_up, window
from omnibal.data.balance.common import exact_sum


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
    cannot hold (``CapModel.text_loss``), so a tight Q_v can force Q_t up."""
    num_steps: int
    """The step count where ``larger`` is reached."""
    samples_per_microbatch: float
    """Mean samples per micro-batch at ``num_steps``."""
    compute: float = float("nan")
    """The lowest fixed-buffer compute pad over the window (module docstring), priced on ``cost_name``,
    with the same text coupling; nan when no cost was given."""
    cost_name: str = ""
    """The cost model ``compute`` is priced on."""


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


def least_cap(sorted_asc: np.ndarray, total: float, packs: int, multiple: int, *, tiles: bool) -> int:
    """The smallest cap (a multiple of ``multiple``) that holds the mean pack and the largest sample and
    passes ``feasible`` for ``packs`` packs (feasibility only grows with the cap: bisection); for tiles
    (small integer caps) also ``_room_for_the_rest``, cap by cap upwards (that condition is not monotone
    in the cap)."""
    lo = round_up(max(total / packs, float(sorted_asc[-1])), multiple)
    if tiles:
        cap = lo
        while not (feasible(sorted_asc, cap, packs) and _room_for_the_rest(sorted_asc, cap, packs)):
            cap += 1
        return cap
    if feasible(sorted_asc, lo, packs):
        return lo
    hi = max(lo, round_up(float(sorted_asc[-1]) * 5, multiple))  # 5 x the largest: passes every k <= 4
    while hi - lo > multiple:
        mid = round_up((lo + hi) / 2, multiple)
        mid = mid if mid < hi else hi - multiple
        lo, hi = (lo, mid) if feasible(sorted_asc, mid, packs) else (mid, hi)
    return hi


class FullPacks:
    """The tokens the fullest packs hold, at least: a lower bound of Q_t from the tile side. With ``u =
    ceil(V/P)`` and every pack at most ``Q_v`` tiles, at least ``a = ceil((V - P (u - 1)) / (Q_v - u + 1))``
    packs hold ``u`` tiles or more (the others hold at most ``u - 1``). Those ``a`` packs together hold
    between ``a u`` and ``a Q_v`` tiles in at least ``a ceil(u / largest sample)`` samples, so their tokens
    are at least the least tokens of any samples that meet these three counts -- at least the linear
    relaxation's (``z_i`` in [0, 1] per sample), which is at least its Lagrangian dual at any multipliers
    (weak duality; ``_dual``, maximised by nested ternary search: it is concave). One of the packs holds at
    least their mean, so ``Q_t >= that / a``: where V/P is just over an integer and the samples are small,
    the fullest packs need several samples each and hold more text than the mean pack."""

    ITERATIONS = 40
    """Ternary-search steps per multiplier (the bound only needs to be valid, not the dual's exact maximum)."""

    def __init__(self, tiles, tokens) -> None:
        v = np.asarray(tiles, np.int64)
        t = np.asarray(tokens, np.int64)
        self.total_v = float(v.sum())
        self.v_max = int(v.max()) if len(v) else 0
        # samples of equal (tiles, tokens) share a term of the dual: [kinds] arrays with their counts
        pairs, self.count = np.unique(np.stack([v, t], 1), axis=0, return_counts=True)
        self.v, self.t = pairs[:, 0].astype(np.float64), pairs[:, 1].astype(np.float64)
        self.count = self.count.astype(np.float64)
        self.t_max = float(t.max()) if len(t) else 0.0

    def _dual(self, lam: float, mu: float, low: float, high: float, samples: float) -> float:
        """The Lagrangian dual of the least tokens of samples with ``low``-``high`` tiles in at least
        ``samples`` samples, at multipliers ``lam`` (the count, >= 0) and ``mu`` (the tiles: the lower
        bound's when >= 0, the upper's when < 0)."""
        reduced = np.minimum(self.t - lam - mu * self.v, 0.0)
        return float(reduced @ self.count) + lam * samples + (mu * low if mu >= 0 else mu * high)

    def _best_over_lambda(self, mu: float, low: float, high: float, samples: float) -> float:
        lo, hi = 0.0, self.t_max + abs(mu) * self.v_max
        for _ in range(self.ITERATIONS):
            m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            if self._dual(m1, mu, low, high, samples) < self._dual(m2, mu, low, high, samples):
                lo = m1
            else:
                hi = m2
        return max(self._dual(x, mu, low, high, samples) for x in (lo, hi, 0.0))

    def least_tokens(self, p: int, qv: int) -> float:
        """The bound on Q_t for ``p`` packs under a tile cap ``qv`` (class docstring)."""
        u = int(math.ceil(self.total_v / p - 1e-9))
        if u < 1 or qv < u or self.v_max < 1:
            return 0.0
        a = -(-int(round(self.total_v - p * (u - 1))) // (qv - u + 1))
        low, high, samples = float(a * u), float(a * qv), float(a * -(-u // self.v_max))
        lo, hi = -self.t_max, self.t_max
        for _ in range(self.ITERATIONS):
            m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            if self._best_over_lambda(m1, low, high, samples) < self._best_over_lambda(m2, low, high, samples):
                lo = m1
            else:
                hi = m2
        best = max(self._best_over_lambda(x, low, high, samples) for x in (lo, hi, 0.0))
        return max(best, 0.0) / a


def least_token_cap_for(model: CapModel, p: int, qv: int, least_t: int, multiple: int,
                        full: FullPacks | None = None) -> int:
    """The least Q_t >= ``least_t`` (a multiple of ``multiple``) whose ``text_loss`` at ``qv`` fits the
    ``p qv - V`` spare tiles (bisection: the loss only falls as Q_t grows), and that holds the fullest
    packs' tokens (``full``, a ``FullPacks``)."""
    spare = p * qv - model.total_v
    lo = least_t
    if full is not None:
        lo = max(lo, round_up(full.least_tokens(p, qv), multiple))
    if model.text_loss(qv, lo) <= spare:
        return lo
    # at r >= the largest x no sample is over r: the loss is at most 0
    hi = max(lo, round_up(float(model.text_desc[0]) + model.per_tile * qv, multiple))
    while hi - lo > multiple:
        mid = round_up((lo + hi) / 2, multiple)
        mid = mid if mid < hi else hi - multiple
        lo, hi = (lo, mid) if model.text_loss(qv, mid) <= spare else (mid, hi)
    return hi


def _lowest_over_qv(model: CapModel, p: int, least: tuple[int, int], multiple: int, waste,
                    full: FullPacks | None = None) -> float:
    """The lowest ``waste(qv, qt)`` of ``p`` packs over Q_v >= the least tile cap, each Q_v with its least
    Q_t (``least_token_cap_for``); ``waste`` grows with both caps. Q_v stops rising once ``waste`` at the
    least Q_t alone reaches the best found (it does: the tile term grows without bound)."""
    cap_v, cap_t = least
    best = np.inf
    for qv in itertools.count(cap_v):
        if waste(qv, cap_t) >= best:
            break
        best = min(best, waste(qv, least_token_cap_for(model, p, qv, cap_t, multiple, full)))
    return float(best)


class _Floors:
    """Exact least caps per pack count, computed once each (``pad_floor`` asks for few of them)."""

    def __init__(self, model: CapModel, packs: np.ndarray, multiple: int, full: FullPacks) -> None:
        self.model, self.packs, self.multiple, self.full = model, packs, multiple, full
        self.caps: dict[int, tuple[int, int]] = {}

    def least(self, k: int) -> tuple[int, int]:
        if k not in self.caps:
            m, p = self.model, int(self.packs[k])
            cap_v = max(least_cap(m.v_asc, m.total_v, p, 1, tiles=True), 1)
            self.caps[k] = (cap_v, least_cap(m.t_asc, m.total_t, p, self.multiple, tiles=False))
        return self.caps[k]

    def pads(self, k: int) -> tuple[float, float]:
        p, (cap_v, cap_t) = int(self.packs[k]), self.least(k)
        return 1 - self.model.total_v / (p * cap_v), 1 - self.model.total_t / (p * cap_t)

    def larger(self, k: int) -> float:
        m, p = self.model, int(self.packs[k])
        return _lowest_over_qv(m, p, self.least(k), self.multiple,
                               lambda qv, qt: max(1 - m.total_v / (p * qv), 1 - m.total_t / (p * qt)), self.full)

    def compute(self, k: int, coef: np.ndarray, real: float) -> float:
        """The compute-pad bound of the module docstring at the ``k``-th count (``real``: R less the
        per-micro-batch terms, which are added per count)."""
        m, p = self.model, int(self.packs[k])
        r = real + p * coef[0]

        def waste(qv, qt):
            pad_t = p * qt - m.total_t
            return coef[1] * (p * qv - m.total_v) + coef[2] * pad_t + coef[3] * pad_t * pad_t / p

        extra = _lowest_over_qv(m, p, self.least(k), self.multiple, waste, self.full)
        return 1 - r / (r + extra) if r + extra > 0 else 0.0


def _lowest(quick: np.ndarray, value) -> tuple[float, int]:
    """The lowest ``value(k)`` over the counts, computing it in the order of ``quick`` (a lower bound of
    it per count) until no remaining count's bound can beat the best found (each count at most once)."""
    best, at = np.inf, 0
    for k in np.argsort(quick, kind="stable"):
        if quick[k] >= best:
            break
        v = value(int(k))
        best, at = (v, int(k)) if v < best else (best, at)
    return float(best), at


def pad_floor(tiles, tokens, *, slots_per_step: int, target_samples: float = 4.5, samples_tolerance: float = 0.15,
              token_multiple: int = 8, cost=None) -> PadFloor:
    """What no packer can beat within ``samples_tolerance`` of ``target_samples`` (see the module docstring):
    e.g. where the largest sample forces the token cap above every mean pack the window allows, or where
    the room the dominant tile size leaves forces the tile cap up (chartqa: 91% five-tile samples). With
    ``cost`` (a ``BalanceCost``) also the compute pad's floor priced on it."""
    model = CapModel(tiles, tokens, slots_per_step=slots_per_step, max_tiles=None, max_tokens=None,
                     token_slack=0.0, tile_slack=0.0, token_multiple=token_multiple)
    lo_s, hi_s = window(model, target_samples, samples_tolerance)
    steps = np.arange(lo_s, hi_s + 1)
    packs = steps * slots_per_step
    # closed forms (mean pack, largest sample) order the counts; the least caps, which can only be higher,
    # are computed until no remaining count's closed form can beat the best found (each count at most once)
    q_v = np.maximum(np.ceil(model.total_v / packs - 1e-9), model.v_asc[-1])
    q_t = np.ceil(np.maximum(model.total_t / packs, model.t_asc[-1]) / token_multiple - 1e-9) * token_multiple
    quick = np.stack([1 - model.total_v / (packs * np.maximum(q_v, 1)), 1 - model.total_t / (packs * q_t)], 1)
    floors = _Floors(model, packs, token_multiple, FullPacks(tiles, tokens))
    larger, at = _lowest(quick.max(1), floors.larger)
    compute, name = float("nan"), ""
    if cost is not None:
        coef = np.asarray(cost.vision_coef) + np.asarray(cost.llm_coef)
        t = np.asarray(tokens, np.float64)
        real = coef[1] * model.total_v + coef[2] * model.total_t + coef[3] * exact_sum(t * t)
        pad_t = packs * q_t - model.total_t
        quick_c = 1 - (real + packs * coef[0]) / (real + packs * coef[0] + coef[1] * (packs * q_v - model.total_v)
                                                  + coef[2] * pad_t + coef[3] * pad_t * pad_t / packs)
        compute = _lowest(quick_c, lambda k: floors.compute(k, coef, real))[0]
        name = cost.name
    return PadFloor(tiles=_lowest(quick[:, 0], lambda k: floors.pads(k)[0])[0],
                    tokens=_lowest(quick[:, 1], lambda k: floors.pads(k)[1])[0], larger=larger,
                    num_steps=int(steps[at]), samples_per_microbatch=model.n / int(packs[at]), compute=compute,
                    cost_name=name)


def vision_balance_floor(tiles, *, dp_size: int, tile_pad: float = 0.0) -> float:
    """The lowest vision max/mean over ranks (per step, averaged over the steps) that any schedule of
    ``tiles`` on ``dp_size`` ranks with a tile pad of at most ``tile_pad`` reaches, when the vision cost is
    proportional to the tiles (every sample exactly once, every step full). A bound, not a prediction.

    A step whose ``T`` tiles are not a multiple of ``dp_size`` has a rank with ``ceil(T / dp_size)``, so its
    max/mean is at least ``1 + x / T`` with ``x = (-T) mod dp_size``; the ``x`` of all steps sum to at least
    ``r = (-V) mod dp_size`` (``V`` the total tiles), and no step holds more than ``dp_size M Q_v`` tiles, so
    the mean over ``S`` steps is at least ``1 + r / (S dp_size M Q_v) = 1 + r (1 - tile pad) / V``. It does
    not fall with more steps or micro-batches: only a larger buffer (more pad) lowers it."""
    total = int(np.asarray(tiles, np.int64).sum())
    residue = (-total) % int(dp_size)
    return 1.0 + residue * (1.0 - float(tile_pad)) / max(total, 1)
