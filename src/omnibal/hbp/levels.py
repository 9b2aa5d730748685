"""HBP's settings (:class:`HBPConfig`) and its level estimate (:mod:`omnibal.hbp.balance`): what a level of one
pack length and SP degree costs, and the set of levels of least estimated time (``choose_levels``, a dynamic
programme equal to trying every subset: ``exhaustive_levels``). The formulas are in :mod:`omnibal.hbp.balance`'s
docstring; the planner (:mod:`omnibal.hbp.planning`) fills the :class:`LevelCostModel` and lets the simulator
choose among the proposals.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from omnibal.data.balance.api import BalanceConfig
from omnibal.data.balance.cost import DEFAULT_COST, BalanceCost
from omnibal.errors import InputError

HBP_OVERSIZE = ("error", "drop")
LEVEL_MICROBATCHES = ("same", "tokens")
"""How many micro-batches a level's step has (:attr:`HBPConfig.microbatches`)."""
CROWD_DEPTH = 4
"""Pack-count bound: at most k samples over length / (k + 1) share a pack, for k = 1..CROWD_DEPTH."""


@dataclass(frozen=True, kw_only=True)
class LevelCostModel:
    """What a level costs; every time in the units of ``cost`` (seconds with a cost-table BalanceCost)."""

    cost: BalanceCost = field(default_factory=lambda: DEFAULT_COST)
    """Per-sample vision + LLM cost (the balancer's)."""
    sp_degrees: tuple[int, ...] = (1,)
    """SP degrees a level may use, ascending (each must divide dp_size)."""
    a2a_per_token: tuple[float, ...] = (0.0,)
    """Ulysses all-to-all time per rank-local token of a micro-batch (all layers, forward + backward), one
    per ``sp_degrees`` entry (0 for degree 1)."""
    max_tokens_per_rank: int = 1 << 62
    """Most LLM tokens one rank's micro-batch may hold (the memory budget with the level's recompute)."""
    microbatch_overhead: float = 0.0
    """Fixed time per micro-batch (kernel launches, the all-to-all latency)."""
    recompute_tokens: tuple[int, ...] = ()
    """Per-rank token counts (ascending) at which ``recompute_ratio`` is given."""
    recompute_ratio: tuple[float, ...] = ()
    """Extra time share that recompute costs a micro-batch of up to ``recompute_tokens[i]`` tokens per
    rank (the least recompute that fits memory; the last entry holds up to ``max_tokens_per_rank``)."""

    def __post_init__(self) -> None:
        degrees = tuple(int(d) for d in self.sp_degrees)
        if not degrees or any(d < 1 for d in degrees) or list(degrees) != sorted(set(degrees)):
            raise InputError(f"must be distinct positive integers, ascending; got {self.sp_degrees!r}",
                             source="LevelCostModel", field="sp_degrees")
        if len(self.a2a_per_token) != len(degrees) or min(self.a2a_per_token) < 0:
            raise InputError("needs one non-negative time per SP degree", source="LevelCostModel",
                             field="a2a_per_token")
        if self.max_tokens_per_rank < 1:
            raise InputError("must be >= 1", source="LevelCostModel", field="max_tokens_per_rank")
        if len(self.recompute_tokens) != len(self.recompute_ratio) or list(self.recompute_tokens) != sorted(
                self.recompute_tokens) or any(r < 0 for r in self.recompute_ratio):
            raise InputError("recompute_tokens (ascending) and recompute_ratio (>= 0) must pair up",
                             source="LevelCostModel", field="recompute_ratio")

    def recompute(self, tokens_per_rank: float) -> float:
        """Extra time share of recompute at ``tokens_per_rank`` (0 when no table is given)."""
        if not self.recompute_ratio:
            return 0.0
        i = int(np.searchsorted(np.asarray(self.recompute_tokens), tokens_per_rank, side="left"))
        return float(self.recompute_ratio[min(i, len(self.recompute_ratio) - 1)])

    def feasible_sp(self, length: int) -> tuple[int, ...]:
        """SP degrees whose per-rank share of a ``length``-token pack fits memory."""
        return tuple(d for d in self.sp_degrees if math.ceil(length / d) <= self.max_tokens_per_rank)

    def a2a(self, degree: int) -> float:
        return float(self.a2a_per_token[self.sp_degrees.index(degree)])


@dataclass(frozen=True, kw_only=True)
class HBPConfig:
    """How to build a multi-level schedule."""

    model: LevelCostModel = field(default_factory=LevelCostModel)
    """Level cost model (memory, SP degrees, communication; filled in by ``omnibal.hbp.planning``)."""
    pack_lengths: tuple[int, ...] | None = None
    """Fixed level lengths (ascending; e.g. a resumed run's); None: chosen by :func:`choose_levels`."""
    level_sp: tuple[int, ...] | None = None
    """Fixed SP degree per ``pack_lengths`` level (e.g. a resharded run's); None: the estimate's best."""
    candidate_lengths: tuple[int, ...] | None = None
    """Lengths the level search may use; None: :func:`default_candidates`."""
    max_levels: int = 4
    """Most levels."""
    fill: float = 0.95
    """Expected fill of a pack (the packer's slack)."""
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    """Balancer settings of every level (``max_tokens`` is set to the level length)."""
    oversize: str = "error"
    """A sample over the longest level at the largest SP degree: ``error`` (InputError naming it) or
    ``drop`` (left out, listed in ``Schedule.dropped``)."""
    microbatches: str = "same"
    """Micro-batches per rank in a level's step: ``same`` (``num_microbatches`` on every level) or ``tokens``
    (:func:`level_microbatch_counts`: a level's step holds about as many tokens per rank as the level of the
    most tokens per rank, whose steps keep ``num_microbatches``; a short level then runs fewer, longer steps,
    each paying the pipeline fill and drain and the gradient sync once)."""
    step_tokens: int | None = None
    """With ``microbatches="tokens"``: LLM tokens per rank every step should hold (e.g. a single-level plan's
    ``num_microbatches x`` its token cap, to compare at the same batch); None: ``num_microbatches`` packs of
    the level of the most tokens per rank."""
    min_microbatches: int = 1
    """With ``microbatches="tokens"``: the fewest micro-batches a level's step may have (a 1F1B pipeline of P
    stages needs P)."""

    def __post_init__(self) -> None:
        if self.microbatches not in LEVEL_MICROBATCHES:
            raise InputError(f"unknown micro-batch rule {self.microbatches!r}; choose one of {LEVEL_MICROBATCHES}",
                             source="microbatches", field="microbatches")
        if self.oversize not in HBP_OVERSIZE:
            raise InputError(f"unknown policy {self.oversize!r}; choose one of {HBP_OVERSIZE}", source="oversize",
                             field="oversize")
        if not isinstance(self.max_levels, int) or self.max_levels < 1:
            raise InputError(f"must be an integer >= 1, got {self.max_levels!r}", source="max_levels",
                             field="max_levels")
        if not isinstance(self.min_microbatches, int) or self.min_microbatches < 1:
            raise InputError(f"must be an integer >= 1, got {self.min_microbatches!r}", source="min_microbatches",
                             field="min_microbatches")
        if self.step_tokens is not None and (not isinstance(self.step_tokens, int) or self.step_tokens < 1):
            raise InputError(f"must be a positive integer or None, got {self.step_tokens!r}", source="step_tokens",
                             field="step_tokens")
        if not 0 < self.fill <= 1:
            raise InputError(f"must be in (0, 1], got {self.fill}", source="fill", field="fill")
        for name in ("pack_lengths", "candidate_lengths"):
            lengths = getattr(self, name)
            if lengths is not None and (not lengths or list(lengths) != sorted(set(lengths)) or min(lengths) < 1):
                raise InputError(f"must be distinct positive lengths, ascending; got {lengths!r}", source=name,
                                 field=name)


@dataclass(frozen=True, kw_only=True)
class LevelChoice:
    """The chosen levels."""

    lengths: tuple[int, ...]
    """Pack length (token cap) of each level, ascending."""
    sp: tuple[int, ...]
    """SP degree of each level."""
    cost: float
    """Estimated epoch time (:func:`levels_cost`)."""


# -- level choice ------------------------------------------------------------------------------------
def default_candidates(tokens: np.ndarray) -> tuple[int, ...]:
    """Powers of two and the midpoints 1.5 x 2^k (multiples of 8 from 16 on), from the median sample's
    length up to the first holding the longest sample."""
    median, longest = max(float(np.median(tokens)), 1.0), max(int(tokens.max()), 1)
    grid = sorted({x for k in range(0, 31) for x in (1 << k, 3 << k >> 1) if x >= 1})
    below = [x for x in grid if x < median]
    start = below[-1] if below else grid[0]
    stop = next(x for x in grid if x >= longest)
    return tuple(x for x in grid if start <= x <= stop)


class _LevelCosts:
    """Aggregates of the samples sorted by length, so one level's estimate is O(1) after a prefix sum."""

    def __init__(self, tokens: np.ndarray, costs: np.ndarray, *, groups_of, num_microbatches: int,
                 model: LevelCostModel, fill: float) -> None:
        order = np.argsort(tokens, kind="stable")
        self.tokens = tokens[order].astype(np.float64)
        self.cost_sorted = costs[order]
        self.cum_tokens = np.concatenate([[0.0], np.cumsum(self.tokens)])
        self.cum_cost = np.concatenate([[0.0], np.cumsum(self.cost_sorted)])
        self.groups_of, self.m, self.model, self.fill = groups_of, num_microbatches, model, fill

    def upto(self, length: float) -> int:
        """Samples of at most ``length`` tokens."""
        return int(np.searchsorted(self.tokens, length, side="right"))

    def level(self, lo: int, hi: int, length: int) -> float:
        """Estimated time of the level of length ``length`` holding sorted samples ``[lo, hi)`` (inf: infeasible)."""
        return self.level_sp(lo, hi, length)[0]

    def level_sp(self, lo: int, hi: int, length: int) -> tuple[float, int]:
        """(estimated time, best SP degree) of a level; an empty level costs nothing and never runs."""
        if hi <= lo:
            return 0.0, 1
        # at most k samples over length/(k+1) share a pack
        crowded = max(math.ceil((hi - max(lo, self.upto(length / (k + 1)))) / k) for k in range(1, CROWD_DEPTH + 1))
        packs = max(math.ceil((self.cum_tokens[hi] - self.cum_tokens[lo]) / (self.fill * length)), crowded)
        total = self.cum_cost[hi] - self.cum_cost[lo]
        biggest = float(self.cost_sorted[lo:hi].max())
        best = (math.inf, 0)
        for d in self.model.feasible_sp(length):
            slots = self.groups_of(d) * self.m
            if slots == 0 or hi - lo < slots:
                continue
            steps = max(math.ceil(packs / slots), 1)
            pack = max(total / (steps * slots), biggest) / d * (1 + self.model.recompute(length / d))
            time = steps * self.m * (pack + self.model.a2a(d) * length / d + self.model.microbatch_overhead)
            best = min(best, (time, d))
        return best


def _sample_costs(stats, model: LevelCostModel) -> np.ndarray:
    vision, llm = model.cost.sample_costs(stats.tiles, stats.tokens)
    return vision + llm


def _groups_of(dp_size: int):
    return lambda d: dp_size // d if dp_size % d == 0 else 0


def level_costs(stats, *, dp_size: int, num_microbatches: int, config: HBPConfig) -> _LevelCosts:
    """The estimate's per-level costs of ``stats`` on ``dp_size`` ranks (what every level estimate reads)."""
    return _LevelCosts(np.asarray(stats.tokens), _sample_costs(stats, config.model), groups_of=_groups_of(dp_size),
                       num_microbatches=num_microbatches, model=config.model, fill=config.fill)


def levels_cost(stats, lengths, *, dp_size: int, num_microbatches: int, config: HBPConfig) -> float:
    """Estimated epoch time of the levels ``lengths`` (module docstring); inf when infeasible."""
    lc = level_costs(stats, dp_size=dp_size, num_microbatches=num_microbatches, config=config)
    if lc.upto(max(lengths)) < len(lc.tokens):
        return math.inf
    total, lo = 0.0, 0
    for length in sorted(lengths):
        hi = lc.upto(length)
        total += lc.level(lo, hi, length)
        lo = hi
    return total


def choose_levels(stats, *, dp_size: int, num_microbatches: int, config: HBPConfig) -> LevelChoice:
    """The subset of the candidate lengths (at most ``max_levels``) of least :func:`levels_cost`.

    Dynamic programme: ``best[k][j]`` = least time of ``k`` levels whose longest is candidate ``j``
    covering every sample up to it. Ties go to fewer levels, then to the lexicographically smaller lengths.
    """
    cands = candidate_lengths(np.asarray(stats.tokens), config)
    lc = level_costs(stats, dp_size=dp_size, num_microbatches=num_microbatches, config=config)
    upto = [lc.upto(c) for c in cands]
    top = len(cands) - 1  # candidate_lengths ends at the first length holding every sample
    # best[j] for the current level count: (time, lengths)
    best = [(lc.level(0, upto[j], cands[j]), (cands[j],)) for j in range(len(cands))]
    answer = best[top]
    for _ in range(2, config.max_levels + 1):
        nxt = []
        for j in range(len(cands)):
            options = [(best[i][0] + lc.level(upto[i], upto[j], cands[j]), best[i][1] + (cands[j],))
                       for i in range(j) if math.isfinite(best[i][0])]
            nxt.append(min(options, default=(math.inf, ())))
        best = nxt
        if best[top][0] < answer[0]:
            answer = best[top]
    if not math.isfinite(answer[0]):
        raise InputError(f"no level choice fits: every level needs at least (dp_size / SP degree) x "
                         f"num_microbatches samples and a rank's share of a pack must fit "
                         f"max_tokens_per_rank {config.model.max_tokens_per_rank}", source=stats.source,
                         field="pack_lengths")
    # a level no sample lands in costs nothing and never runs: leave it out
    used, lo = [], 0
    for length in answer[1]:
        hi = lc.upto(length)
        if hi > lo:
            used.append(length)
        lo = hi
    return LevelChoice(lengths=tuple(used), sp=level_degrees(lc, used), cost=answer[0])


def level_degrees(lc: _LevelCosts, lengths) -> tuple[int, ...]:
    """The estimate's best SP degree of each level (samples to the shortest level holding them)."""
    degrees, lo = [], 0
    for length in lengths:
        hi = lc.upto(length)
        degrees.append(lc.level_sp(lo, hi, length)[1])
        lo = hi
    return tuple(degrees)


def candidate_lengths(tokens: np.ndarray, config: HBPConfig) -> tuple[int, ...]:
    """The candidates up to (and including) the first that holds the longest sample."""
    cands = config.candidate_lengths or default_candidates(tokens)
    longest = int(tokens.max())
    fitting = [c for c in cands if c >= longest]
    if not fitting:
        raise InputError(f"the longest sample has {longest} tokens, more than every candidate level length "
                         f"(up to {max(cands)})", field="candidate_lengths", source="candidate_lengths")
    return tuple(c for c in cands if c <= fitting[0])


def exhaustive_levels(stats, *, dp_size: int, num_microbatches: int, config: HBPConfig) -> float:
    """Least :func:`levels_cost` over every subset of candidates (for tests: exponential in candidates)."""
    cands = candidate_lengths(np.asarray(stats.tokens), config)
    best = math.inf
    for k in range(1, config.max_levels + 1):
        for subset in itertools.combinations(cands, k):
            if subset[-1] == cands[-1]:
                best = min(best, levels_cost(stats, subset, dp_size=dp_size, num_microbatches=num_microbatches,
                                             config=config))
    return best


# -- packing -----------------------------------------------------------------------------------------


__all__ = ["CROWD_DEPTH", "HBPConfig", "HBP_OVERSIZE", "LEVEL_MICROBATCHES", "LevelChoice", "LevelCostModel",
           "candidate_lengths", "choose_levels", "default_candidates", "exhaustive_levels", "level_degrees",
           "levels_cost"]
