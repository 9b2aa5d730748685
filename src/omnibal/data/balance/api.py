"""`balance()`: one entry point for omnibal's balancer and the baselines, all returning a `Schedule`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np

from omnibal.data.balance.assign import assign_sorted
from omnibal.data.balance.baselines import balance_length_grouped, balance_random
from omnibal.data.balance.capmodel import abs_log
from omnibal.data.balance.caps import choose_caps
from omnibal.data.balance.chunked import num_chunks, pack_chunked
from omnibal.data.balance.common import epoch_rng, split_oversize
from omnibal.data.balance.cost import DEFAULT_COST, BalanceCost
from omnibal.data.balance.isf import balance_isf
from omnibal.data.balance.packer import DEFAULT_LLM_TOL, pack_balanced
from omnibal.data.balance.phases import phase
from omnibal.data.balance.schedule import Caps, Schedule, build_schedule
from omnibal.errors import InputError
from omnibal.layout import BalanceMethod, OversizePolicy, check_choice
from omnibal.processes import available_cores
from omnibal.validate import is_int

FALLBACK_ROWS = 4 * 16384
"""Rows up to which the packer packs the cap search's runners-up too when its choice needed the tail rule."""
FALLBACKS = 2
"""Runners-up packed at most (one after the other, while the best packing so far needed the tail rule, or while
one's least score beats the best packed one by ``FALLBACK_MARGIN``)."""
FALLBACK_MARGIN = 0.007
"""Pad score a runner-up's least score (``caps.least_score``) must beat the best packing's by before it is
packed too, when the best needed no tail rule: packings end some way over their least score (the squeeze
stops a few tokens over it), so a closer runner-up rarely pads less and costs a whole packing
(``benchmarks/bench_balance.py`` measures where the margin pays)."""
CHUNK_ROWS = 1 << 20
"""Default ``BalanceConfig.chunk_rows``: inputs of more than twice as many rows are packed in chunks."""


@dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    """How to balance one epoch (everything but the world layout, seed and epoch). ``omnibal balance`` takes
    the fields a user chooses as flags (:mod:`omnibal.cli.fields`); those marked ``cli: False`` are the
    library's tuning (or, for ``cost`` and ``progress``, set from other flags)."""

    method: BalanceMethod = field(default="omnibal", metadata={"option": "balance_method"})
    """``omnibal`` (cost-aware packs + per-step assignment), ``isf`` (faithful ISF, contiguous rank blocks
    like the reference sampler), ``isf+assign`` (ISF packs, omnibal's assignment), ``random`` (random
    fixed micro-batches of ``batch_size``), ``length-grouped`` (LLaVA's length-grouped sampler)."""
    target_samples: float = 4.5
    """Mean samples per micro-batch the cap search aims at (the paper's setting is 4-5)."""
    samples_tolerance: float = field(default=0.15, metadata={"cli": False})
    """How far (relative) the mean samples per micro-batch may move from ``target_samples`` when the cap
    search looks for a pack count with a low pad (0.15: 3.825-5.175 for 4.5). Wider lets the token buffer
    fill where the largest sample sets it (a tail of long samples); narrower keeps the packs the target's
    size. Ignored with fixed caps."""
    max_tiles: int | None = field(default=None, metadata={"metavar": "N"})
    """Fixed Q_v (tiles per micro-batch); None: chosen by the cap search."""
    max_tokens: int | None = None
    """Fixed Q_t (tokens per micro-batch, e.g. a memory budget); None: chosen by the cap search."""
    num_steps: int | None = field(default=None, metadata={"cli": False})
    """With fixed caps: exactly this many optimizer steps per epoch when they fit (e.g. a run's first
    epoch's count, so every epoch has the same length); None: the fewest that fit."""
    oversize: OversizePolicy = "error"
    """Samples larger than a fixed cap: ``error`` (InputError listing them), ``own_pack`` (each runs alone
    as a micro-batch over the buffer), ``drop`` (left out, listed in ``Schedule.dropped``)."""
    cost: BalanceCost = field(default_factory=lambda: DEFAULT_COST, metadata={"cli": False})
    """Per-sample vision and LLM cost coefficients."""
    token_slack: float = field(default=0.015, metadata={"cli": False})
    """Room left in the derived token cap over the mean pack (the packer needs some to fill both buffers)."""
    token_multiple: int = field(default=8, metadata={"cli": False})
    """Derived Q_t is rounded up to a multiple of this (kernel-friendly shapes)."""
    llm_tol: float | None = field(default=DEFAULT_LLM_TOL, metadata={"cli": False})
    """LLM levelling: the packer pulls every pack's LLM cost into this band around the mean (relative);
    None: only the token cap is enforced."""
    batch_size: int = 4
    """Samples per micro-batch of the ``random`` and ``length-grouped`` baselines."""
    isf_iterations: int = field(default=50, metadata={"cli": False})
    """ISF: sampling-and-filtering iterations T."""
    isf_threshold: int = field(default=128, metadata={"cli": False})
    """ISF: a pack is full when its tokens reach Q_t - isf_threshold (the paper's Q_t')."""
    isf_search: bool = field(default=True, metadata={"cli": False})
    """ISF without fixed caps: run its own argument search over (Q_v, Q_t)."""
    progress: bool = field(default=False, metadata={"cli": False})
    """Show a progress bar (stderr) for long work (the ISF argument search)."""
    chunk_rows: int | None = field(default=CHUNK_ROWS, metadata={"cli": False})
    """Over twice this many rows (those under fixed caps), omnibal packs the rows in ``ceil(rows /
    chunk_rows)`` chunks, each on its own (``chunked``), which ``workers`` processes can share; the caps are
    still searched on every row. None: always in one piece (one core, and time growing faster than the
    rows). Part of what the schedule depends on, unlike ``workers``."""
    workers: int = field(default=1, metadata={"cli_default": 0})
    """Worker processes packing the chunks of a chunked input (see ``chunk_rows``): 1 packs them in this
    process, 0 starts one per core this process may use. The schedule is the same for every count. 1 in the
    library since every rank of a training job balances the epoch itself (a process per core on each of a
    node's ranks would oversubscribe it); ``omnibal balance`` uses every core."""

    def __post_init__(self) -> None:
        check_choice(self.method, BalanceMethod, source="method", field="method")
        check_choice(self.oversize, OversizePolicy, source="oversize", field="oversize")
        for name in ("max_tiles", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
                raise InputError(f"must be a positive integer, got {value!r}", source=name, field=name)
        if not (isinstance(self.target_samples, (int, float)) and math.isfinite(self.target_samples)
                and self.target_samples > 0):
            raise InputError(f"must be a finite number > 0, got {self.target_samples}", source="target_samples",
                             field="target_samples")
        if not (isinstance(self.samples_tolerance, (int, float)) and 0 <= self.samples_tolerance < 1):
            raise InputError(f"must be a number in [0, 1), got {self.samples_tolerance!r}",
                             source="samples_tolerance", field="samples_tolerance")
        if self.batch_size < 1:
            raise InputError(f"must be >= 1, got {self.batch_size}", source="batch_size", field="batch_size")
        if not (is_int(self.workers) and 0 <= self.workers <= 1024):
            raise InputError(f"must be an integer in [0, 1024], got {self.workers!r}", source="workers",
                             field="workers")
        if self.chunk_rows is not None and not (is_int(self.chunk_rows) and self.chunk_rows >= 1024):
            raise InputError(f"must be an integer >= 1024 or None, got {self.chunk_rows!r}", source="chunk_rows",
                             field="chunk_rows")
        if not 0 <= self.token_slack < 0.5:
            raise InputError(f"must be in [0, 0.5), got {self.token_slack}", source="token_slack",
                             field="token_slack")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cost"] = self.cost.to_dict()
        for name in ("progress", "workers"):  # not part of what a schedule depends on
            d.pop(name)
        if self.chunk_rows == CHUNK_ROWS:  # recorded when chosen: a config read back gets the default
            d.pop("chunk_rows")
        return d


def _check_layout(stats, dp_size: int, num_microbatches: int, seed: int, epoch: int) -> None:
    if len(stats) == 0:
        raise InputError("no samples: cannot build a schedule from empty stats", source=stats.source)
    for name, value, low in (("dp_size", dp_size, 1), ("num_microbatches", num_microbatches, 1),
                             ("seed", seed, 0), ("epoch", epoch, 0)):
        if not is_int(value) or value < low:
            raise InputError(f"must be an integer >= {low}, got {value!r}", source=name, field=name)
    if len(stats) < dp_size * num_microbatches:
        raise InputError(f"dp_size x num_microbatches = {dp_size * num_microbatches} micro-batches per step, but "
                         f"only {len(stats)} samples: some ranks would get no data", source="dp_size",
                         field="dp_size")


def balance(stats, *, dp_size: int, num_microbatches: int = 1, seed: int = 0, epoch: int = 0,
            config: BalanceConfig | None = None) -> Schedule:
    """Balance one epoch of ``stats`` for ``dp_size`` ranks x ``num_microbatches`` micro-batches per step.

    Deterministic in (stats, config, dp_size, num_microbatches, seed, epoch); a new epoch reshuffles.
    Every sample is scheduled exactly once (except rows dropped on purpose, listed in ``dropped``).
    """
    config = config or BalanceConfig()
    _check_layout(stats, dp_size, num_microbatches, seed, epoch)
    if config.method == "omnibal":
        return _balance_omnibal(stats, dp_size, num_microbatches, seed, epoch, config)
    method = {"isf": balance_isf, "isf+assign": balance_isf, "random": balance_random,
              "length-grouped": balance_length_grouped}[config.method]
    return method(stats, dp_size=dp_size, num_microbatches=num_microbatches, seed=seed, epoch=epoch, config=config)


def _balance_omnibal(stats, dp_size, num_microbatches, seed, epoch, config: BalanceConfig) -> Schedule:
    regular, alone, dropped = split_oversize(stats, config)
    if len(regular) == 0 and len(alone) == 0:
        raise InputError("every sample was dropped as oversize", source=stats.source)
    per_step = dp_size * num_microbatches
    # never more micro-batches than samples: an empty one would be dealt to a rank that has nothing to train
    max_total = (len(regular) + len(alone)) // per_step * per_step
    if max_total < len(alone) + (1 if len(regular) else 0):
        raise InputError(f"{len(alone)} samples over the caps each run alone (oversize='own_pack') and the "
                         f"{len(regular)} others cannot fill whole steps of dp_size x num_microbatches = {per_step} "
                         f"micro-batches without empty ones; raise the caps, or pass oversize='drop'",
                         source=stats.source, field="oversize")
    rng = epoch_rng(seed, epoch)
    pack_of = np.full(len(stats), -1, np.int64)
    with phase("costs"):
        costs = config.cost.grid_costs(stats.tiles, stats.tokens)  # integers: exact sums on every machine
    if len(regular):
        num_regular_packs, (q_v, q_t), passes, chunks = _pack_regular(
            stats, regular, pack_of, costs[1][regular], per_step=per_step, max_total=max_total,
            num_alone=len(alone), config=config, rng=rng)
    else:
        num_regular_packs, passes, chunks = 0, (0, 0, 0), 1
        q_v, q_t = config.max_tiles or 1, config.max_tokens or 1
    num_total = num_regular_packs + len(alone)
    pack_of[alone] = num_regular_packs + np.arange(len(alone))
    with phase("assign"):
        pack_ids = _assign(stats, pack_of, num_total, costs, dp_size=dp_size, num_microbatches=num_microbatches,
                           config=config, rng=rng)
    with phase("schedule"):
        return build_schedule(
            pack_of=pack_of, num_packs=num_total, pack_ids=pack_ids, dp_size=dp_size,
            num_microbatches=num_microbatches, caps=Caps(tiles=int(q_v), tokens=int(q_t)),
            num_samples=len(stats), padding="varlen", method="omnibal", seed=seed, epoch=epoch,
            stats_fingerprint=stats.fingerprint(), dropped=dropped,
            meta={"config": config.to_dict(), "exchange_passes": list(passes), "own_packs": alone.tolist(),
                  **({"chunks": chunks} if chunks > 1 else {})},
        )


def _pack_regular(stats, regular, pack_of, llm, *, per_step, max_total, num_alone, config, rng):
    """Cap search and packing of the rows under the caps (``llm``: their LLM costs on the integer grid);
    writes their pack labels into ``pack_of``. Returns (number of packs, (Q_v, Q_t), exchange passes, chunks
    packed apart: see ``chunked``).

    With derived caps, when the chosen count needed the tail rule (new steps, or a tile cap grown over the
    searched one: what the search's subsample did not show), the runners-up are packed too, one after the
    other while the best so far needed it (at most ``FALLBACKS``), and the one that pads less is kept; so is a
    runner-up whose least score beats the best packing's by ``FALLBACK_MARGIN`` (its searched Q_t is the
    packer's room, and the squeeze can end far under it) -- up to
    ``FALLBACK_ROWS`` rows (each packing is the whole cost again), where the packer also squeezes the token
    buffer (a few more levellings: on larger inputs their cost outgrows the packing's). The search then
    measures one count more, so that two runners-up are there: the subsample can miss that the first
    runner-up needs it too."""
    tiles, tokens = stats.tiles[regular], stats.tokens[regular]
    fallback = not _caps_fixed(config) and len(tiles) <= FALLBACK_ROWS
    with phase("cap_search"):
        choice = choose_caps(tiles, tokens, slots_per_step=per_step, target_samples=config.target_samples,
                             samples_tolerance=config.samples_tolerance, max_tiles=config.max_tiles,
                             max_tokens=config.max_tokens, token_slack=config.token_slack,
                             token_multiple=config.token_multiple, rng=rng, num_steps=config.num_steps,
                             min_measured=1 + FALLBACKS if fallback else 2)
    args = dict(tiles=tiles, tokens=tokens, llm=llm, per_step=per_step, max_total=max_total, num_alone=num_alone,
                config=config, rng=rng, squeeze=fallback)
    best = _pack_at(choice.num_steps, choice.max_tiles, choice.max_tokens, **args)
    for caps, bound in zip(choice.runners_up[:FALLBACKS], choice.runners_up_bounds) if fallback else ():
        if not best[3] and bound >= best[4] - FALLBACK_MARGIN:  # no tail rule, and this one cannot pad less
            continue
        best = min(best, _pack_at(*caps, **args), key=lambda r: r[4])
    packed, q_v, q_t = best[:3]
    pack_of[regular] = packed.pack_of
    return len(packed.tiles), (q_v, q_t), packed.passes, best[5]


def _pack_at(steps, max_tiles, max_tokens, *, tiles, tokens, llm, per_step, max_total, num_alone, config, rng,
             squeeze=False):
    """Pack at one (steps, Q_v, Q_t): (packs, derived Q_v, derived Q_t, whether the tail rule changed the
    count or the caps, pad score of the derived caps, chunks packed apart); ``squeeze``: the packer's token
    squeeze. Very large inputs are packed in chunks (``chunked``: the same packs for any ``workers``)."""
    # with the own packs, a whole number of steps
    num_packs = min(-(-(steps * per_step + num_alone) // per_step) * per_step, max_total) - num_alone
    chunks = num_chunks(len(tiles), num_packs, config.chunk_rows)
    pack = pack_balanced if chunks == 1 else partial(
        pack_chunked, chunks=chunks, workers=_workers(config),
        token_multiple=config.token_multiple if config.max_tokens is None else None)
    packed = pack(tiles, tokens, llm, num_packs=num_packs, max_tiles=max_tiles, max_tokens=max_tokens, rng=rng,
                  llm_tol=config.llm_tol, pack_step=per_step, max_packs=max_total - num_alone,
                  hard_caps=_caps_fixed(config), squeeze=squeeze)
    over = (packed.tiles > max_tiles) & (config.max_tiles is not None)
    over = int((over | (packed.tokens > max_tokens) & (config.max_tokens is not None)).sum())
    if over:  # the packer adds packs for what does not fit, unless more packs would leave some empty
        raise InputError(f"could not pack under the caps tiles={max_tiles} tokens={max_tokens} "
                         f"({over} packs over) without more micro-batches than samples; raise the caps, or "
                         f"lower dp_size x num_microbatches", source="caps",
                         field="max_tokens" if (packed.tokens > max_tokens).any() else "max_tiles")
    # derived caps: what the packs really need (the searched caps, or a little over them: see the packer)
    q_v, q_t = max_tiles, max_tokens
    if config.max_tiles is None:
        q_v = max(int(packed.tiles.max()), 1)
    if config.max_tokens is None:
        q_t = -(-int(max(packed.tokens.max(), 1)) // config.token_multiple) * config.token_multiple
    p = len(packed.tiles)
    tailed = p != num_packs or q_v > max_tiles  # new steps or a larger tile cap (a token cap grows by little)
    score = (2 - float(tiles.sum()) / (p * max(q_v, 1)) - float(tokens.sum()) / (p * q_t)
             + 0.05 * abs_log(len(tiles) / p / config.target_samples))
    return packed, q_v, q_t, tailed, score, chunks


def _workers(config: BalanceConfig) -> int:
    if config.workers:
        return config.workers
    return available_cores()


def _caps_fixed(config: BalanceConfig) -> bool:
    """A cap is a budget (fixed by the user), not the cap search's choice."""
    return config.max_tiles is not None or config.max_tokens is not None


def _assign(stats, pack_of, num_total, costs, *, dp_size, num_microbatches, config, rng) -> np.ndarray:
    """``pack_ids`` of the packs (own packs included) by their loads (``costs``: every row's vision and LLM
    cost on the integer grid, so the packs' sums are exact)."""
    in_pack = pack_of >= 0
    labels = pack_of[in_pack]
    p_tiles = np.bincount(labels, weights=stats.tiles[in_pack], minlength=num_total)
    p_vis = np.bincount(labels, weights=costs[0][in_pack], minlength=num_total)
    p_llm = np.bincount(labels, weights=costs[1][in_pack], minlength=num_total)
    empty = int((np.bincount(labels, minlength=num_total) == 0).sum())
    if empty:  # the packer keeps every pack non-empty when there are no more packs than samples
        raise InputError(f"{empty} of {num_total} micro-batches came out empty (target_samples "
                         f"{config.target_samples}); raise target_samples", source=stats.source,
                         field="target_samples")
    return assign_sorted(p_tiles, p_vis, p_llm, dp_size=dp_size, num_microbatches=num_microbatches, rng=rng)
