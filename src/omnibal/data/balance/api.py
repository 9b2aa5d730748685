"""`balance()`: one entry point for omnibal's balancer and the baselines, all returning a `Schedule`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from omnibal.data.balance.assign import assign_sorted
from omnibal.data.balance.caps import choose_caps
from omnibal.data.balance.cost import DEFAULT_COST, BalanceCost
from omnibal.data.balance.packer import pack_balanced
from omnibal.data.balance.schedule import Caps, Schedule, build_schedule
from omnibal.errors import InputError
from omnibal.layout import BalanceMethod, OversizePolicy

METHODS = tuple(BalanceMethod)
OVERSIZE_POLICIES = tuple(OversizePolicy)


@dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    """How to balance one epoch (everything but the world layout, seed and epoch)."""

    method: str = "omnibal"
    """``omnibal`` (cost-aware packs + per-step assignment), ``isf`` (faithful ISF, contiguous rank blocks
    like the reference sampler), ``isf+assign`` (ISF packs, omnibal's assignment), ``random`` (random
    fixed micro-batches of ``batch_size``), ``length-grouped`` (LLaVA's length-grouped sampler)."""
    target_samples: float = 4.5
    """Mean samples per micro-batch the cap search aims at (the paper's setting is 4-5)."""
    max_tiles: int | None = None
    """Fixed Q_v (tiles per micro-batch); None: chosen by the cap search."""
    max_tokens: int | None = None
    """Fixed Q_t (tokens per micro-batch, e.g. a memory budget); None: chosen by the cap search."""
    num_steps: int | None = None
    """With fixed caps: exactly this many optimizer steps per epoch when they fit (e.g. a run's first
    epoch's count, so every epoch has the same length); None: the fewest that fit."""
    oversize: str = "error"
    """Samples larger than a fixed cap: ``error`` (InputError listing them), ``own_pack`` (each runs alone
    as a micro-batch over the buffer), ``drop`` (left out, listed in ``Schedule.dropped``)."""
    cost: BalanceCost = field(default_factory=lambda: DEFAULT_COST)
    """Per-sample vision and LLM cost coefficients."""
    token_slack: float = 0.015
    """Room left in the derived token cap over the mean pack (the packer needs some to fill both buffers)."""
    token_multiple: int = 8
    """Derived Q_t is rounded up to a multiple of this (kernel-friendly shapes)."""
    batch_size: int = 4
    """Samples per micro-batch of the ``random`` and ``length-grouped`` baselines."""
    isf_iterations: int = 50
    """ISF: sampling-and-filtering iterations T."""
    isf_threshold: int = 128
    """ISF: a pack is full when its tokens reach Q_t - isf_threshold (the paper's Q_t')."""
    isf_search: bool = True
    """ISF without fixed caps: run its own argument search over (Q_v, Q_t)."""
    progress: bool = False
    """Show a progress bar (stderr) for long work (the ISF argument search)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r}; choose one of {METHODS}", source="method",
                             field="method")
        if self.oversize not in OVERSIZE_POLICIES:
            raise InputError(f"unknown policy {self.oversize!r}; choose one of {OVERSIZE_POLICIES}",
                             source="oversize", field="oversize")
        for name in ("max_tiles", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
                raise InputError(f"must be a positive integer, got {value!r}", source=name, field=name)
        if not (isinstance(self.target_samples, (int, float)) and math.isfinite(self.target_samples)
                and self.target_samples > 0):
            raise InputError(f"must be a finite number > 0, got {self.target_samples}", source="target_samples",
                             field="target_samples")
        if self.batch_size < 1:
            raise InputError(f"must be >= 1, got {self.batch_size}", source="batch_size", field="batch_size")
        if not 0 <= self.token_slack < 0.5:
            raise InputError(f"must be in [0, 0.5), got {self.token_slack}", source="token_slack",
                             field="token_slack")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cost"] = self.cost.to_dict()
        d.pop("progress")  # display only: not part of what a schedule depends on
        return d


def _check_layout(stats, dp_size: int, num_microbatches: int, seed: int, epoch: int) -> None:
    if len(stats) == 0:
        raise InputError("no samples: cannot build a schedule from empty stats", source=stats.source)
    for name, value, low in (("dp_size", dp_size, 1), ("num_microbatches", num_microbatches, 1),
                             ("seed", seed, 0), ("epoch", epoch, 0)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
            raise InputError(f"must be an integer >= {low}, got {value!r}", source=name, field=name)
    if len(stats) < dp_size * num_microbatches:
        raise InputError(f"dp_size x num_microbatches = {dp_size * num_microbatches} micro-batches per step, but "
                         f"only {len(stats)} samples: some ranks would get no data", source="dp_size",
                         field="dp_size")


def epoch_rng(seed: int, epoch: int, stream: int = 0) -> np.random.Generator:
    """The generator every shuffle of (seed, epoch) draws from: independent streams per purpose."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), int(stream), 0x0B41]))


def split_oversize(stats, config: BalanceConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(regular rows, own-pack rows, dropped rows) under the oversize policy and the fixed caps."""
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


def balance(stats, *, dp_size: int, num_microbatches: int = 1, seed: int = 0, epoch: int = 0,
            config: BalanceConfig | None = None) -> Schedule:
    """Balance one epoch of ``stats`` for ``dp_size`` ranks x ``num_microbatches`` micro-batches per step.

    Deterministic in (stats, config, dp_size, num_microbatches, seed, epoch); a new epoch reshuffles.
    Every sample is scheduled exactly once (except rows dropped on purpose, listed in ``dropped``).
    """
    config = config or BalanceConfig()
    _check_layout(stats, dp_size, num_microbatches, seed, epoch)
    if config.method == "omnibal":
        sched = _balance_omnibal(stats, dp_size, num_microbatches, seed, epoch, config)
    else:
        from omnibal.data.balance import baselines, isf

        if config.method in ("isf", "isf+assign"):
            sched = isf.balance_isf(stats, dp_size=dp_size, num_microbatches=num_microbatches, seed=seed,
                                    epoch=epoch, config=config)
        elif config.method == "random":
            sched = baselines.balance_random(stats, dp_size=dp_size, num_microbatches=num_microbatches,
                                             seed=seed, epoch=epoch, config=config)
        else:
            sched = baselines.balance_length_grouped(stats, dp_size=dp_size, num_microbatches=num_microbatches,
                                                     seed=seed, epoch=epoch, config=config)
    return sched


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
    tiles, tokens = stats.tiles[regular], stats.tokens[regular]
    vision, llm = config.cost.sample_costs(tiles, tokens)
    if len(regular):
        choice = choose_caps(tiles, tokens, slots_per_step=per_step, target_samples=config.target_samples,
                             max_tiles=config.max_tiles, max_tokens=config.max_tokens,
                             token_slack=config.token_slack, token_multiple=config.token_multiple, rng=rng,
                             num_steps=config.num_steps)
        fixed = config.max_tiles is not None or config.max_tokens is not None
        extra_steps = 0
        while True:
            num_regular_packs = choice.num_packs + extra_steps * per_step
            # room for own packs: more steps, the regular samples spread over what is left
            num_total = min(-(-(num_regular_packs + len(alone)) // per_step) * per_step, max_total)
            num_regular_packs = num_total - len(alone)
            packed = pack_balanced(tiles, tokens, llm, num_packs=num_regular_packs, max_tiles=choice.max_tiles,
                                   max_tokens=choice.max_tokens, rng=rng)
            over = (packed.tiles > choice.max_tiles).any() or (packed.tokens > choice.max_tokens).any()
            # a fixed buffer is a promise: when a few packs stay over it, one more step gives the room
            if not (fixed and over) or extra_steps >= 3 or num_regular_packs >= len(regular):
                break
            extra_steps += 1
        pack_of = np.full(len(stats), -1, np.int64)
        pack_of[regular] = packed.pack_of
        q_v, q_t = choice.max_tiles, choice.max_tokens
        if config.max_tiles is None:  # derived buffer: what the packs really need
            q_v = max(int(packed.tiles.max()), 1)
        if config.max_tokens is None:
            q_t = int(max(packed.tokens.max(), 1))
            q_t = -(-q_t // config.token_multiple) * config.token_multiple
        passes = packed.passes
    else:
        num_total = max_total  # == len(alone): checked above
        num_regular_packs, pack_of, passes = 0, np.full(len(stats), -1, np.int64), (0, 0)
        q_v, q_t = config.max_tiles or 1, config.max_tokens or 1
    if len(alone):
        pack_of[alone] = num_regular_packs + np.arange(len(alone))
    if config.max_tiles is not None or config.max_tokens is not None:
        # still over after the extra steps: say so rather than hand out an over-full buffer
        reg = pack_of[regular]
        load_v = np.bincount(reg, weights=stats.tiles[regular], minlength=num_total)
        load_t = np.bincount(reg, weights=stats.tokens[regular], minlength=num_total)
        if (load_v > q_v).any() or (load_t > q_t).any():
            raise InputError(f"could not pack under the fixed caps tiles={q_v} tokens={q_t} "
                             f"({int((load_v > q_v).sum() + (load_t > q_t).sum())} packs over); raise the caps "
                             f"or lower target_samples", source="caps",
                             field="max_tokens" if (load_t > q_t).any() else "max_tiles")
    # pack loads for the assignment (own packs and any empty packs included)
    p_tiles = np.bincount(pack_of[pack_of >= 0], weights=stats.tiles[pack_of >= 0], minlength=num_total)
    all_v, all_l = config.cost.sample_costs(stats.tiles, stats.tokens)
    p_vis = np.bincount(pack_of[pack_of >= 0], weights=all_v[pack_of >= 0], minlength=num_total)
    p_llm = np.bincount(pack_of[pack_of >= 0], weights=all_l[pack_of >= 0], minlength=num_total)
    empty = int((np.bincount(pack_of[pack_of >= 0], minlength=num_total) == 0).sum())
    if empty:  # the packer keeps every pack non-empty when there are no more packs than samples
        raise InputError(f"{empty} of {num_total} micro-batches came out empty (target_samples "
                         f"{config.target_samples}); raise target_samples", source=stats.source,
                         field="target_samples")
    pack_ids = assign_sorted(p_tiles, p_vis, p_llm, dp_size=dp_size, num_microbatches=num_microbatches,
                             rng=rng)
    return build_schedule(
        pack_of=pack_of, num_packs=num_total, pack_ids=pack_ids, dp_size=dp_size,
        num_microbatches=num_microbatches, caps=Caps(tiles=int(q_v), tokens=int(q_t)),
        num_samples=len(stats), padding="varlen", method="omnibal", seed=seed, epoch=epoch,
        stats_fingerprint=stats.fingerprint(), dropped=dropped,
        meta={"config": config.to_dict(), "exchange_passes": list(passes), "own_packs": alone.tolist()},
    )
