"""HBP (Hierarchical Balance Packing): several packing levels of different pack lengths, one schedule.

Mixed short and long samples packed at one length force one compromise on every step: the pack length
(and the sequence-parallel degree and recompute that memory needs for it) is set by the longest sample,
and the short majority pays the communication and the recompute of the long few. HBP (Yao et al. 2025)
packs each sample at a level whose length fits it; every level has its own SP degree and its own static
buffer, and all ranks run the same level in a step.

**Levels.** :func:`choose_levels` picks the level lengths from ``candidate_lengths`` (default: powers of
two and their 1.5x midpoints, from the median sample up to the first one holding the longest sample) to
minimise the estimated epoch time :func:`levels_cost`. Each sample goes to the shortest level that holds
it (a shorter level needs a smaller SP degree or less recompute for the same per-rank memory). The estimate of
one level of length ``L`` with SP degree ``d`` over ``G = dp_size / d`` SP groups of ``M`` micro-batches:

    packs  = max(ceil(sum(tokens) / (fill * L)),                padding: a pack is at most L tokens, and
                 max_k ceil(#(tokens > L/(k+1)) / k))            at most k samples over L/(k+1) share one
    steps  = ceil(packs / (G * M))                               step granularity
    pack   = max(sum(cost) / (steps * G * M), max(cost))         attention imbalance: a pack is never
                                                                 cheaper than its costliest sample
    time   = steps * M * (pack / d * (1 + recompute(L / d))      SP splits the pack; recompute share at a
                          + a2a[d] * L / d + overhead)           rank's L/d tokens; Ulysses all-to-all

minimised over the SP degrees ``d`` whose ``L / d`` fits ``max_tokens_per_rank`` (memory): a larger
degree costs all-to-all time but needs less recompute. ``recompute``, ``a2a`` and the memory limit come
from the planner (:mod:`omnibal.hbp.planning`).
``cost`` is the balancer's vision + LLM cost (:class:`BalanceCost`, attention ``sum len^2`` included).
The minimum over every subset of at most ``max_levels`` candidates (whose longest holds every sample) is
found by dynamic programming over the sorted candidates, which gives the same optimum as trying every
subset (tested). A level needs at least ``G * M`` samples (no empty micro-batch).

**Packing.** Each level is balanced by the existing balancer (:func:`omnibal.data.balance.balance`, omnibal
method, vision + LLM cost) for its ``G`` SP groups with the token cap fixed to the level length; a group's
packs are given to all ``d`` ranks of the group (identical lists: :class:`Schedule` ``levels``/``level_sp``).
The levels' steps are interleaved by a seeded permutation, so long and short steps alternate over the
epoch. Deterministic in (stats, config, dp_size, num_microbatches, seed, epoch); every row is scheduled
exactly once per epoch (counted over SP groups), except rows dropped by ``oversize='drop'``.

**Resume / reshard.** A schedule is rebuilt from its inputs, so a resumed run continues at its step.
:func:`untrained_rows` lists the rows of the steps not yet trained; :func:`balance_hbp` with ``rows=`` and
``pack_lengths`` fixed to the old levels balances exactly them for a new world (another ``dp_size``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from omnibal.data.balance.api import epoch_rng
from omnibal.data.balance.schedule import Caps, Schedule
from omnibal.errors import InputError
from omnibal.hbp.levels import (
    CROWD_DEPTH,
    LEVEL_MICROBATCHES,
    HBPConfig,
    LevelCostModel,
    choose_levels,
    level_costs,
    level_degrees,
)
from omnibal.hbp.packing import balance_level

INTERLEAVE_STREAM = 0x4B5
"""epoch_rng stream of the level interleaving (independent of the balancer's shuffles)."""


def _check_oversize(stats, rows: np.ndarray, config: HBPConfig) -> tuple[np.ndarray, np.ndarray]:
    """(kept rows, dropped rows): a sample no level can hold is an InputError or, on request, dropped."""
    model = config.model
    limit = model.max_tokens_per_rank * max(model.sp_degrees)
    if config.pack_lengths is not None:
        limit = min(limit, max(config.pack_lengths))
    over = stats.tokens[rows] > limit
    if not over.any():
        return rows, rows[:0]
    bad = rows[over]
    if config.oversize == "error":
        listed = ", ".join(f"{int(i)} ({int(stats.tokens[i])} tokens)" for i in bad[:10])
        more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
        raise InputError(f"{len(bad)} samples are longer than the longest level can hold ({limit} tokens: "
                         f"{model.max_tokens_per_rank} per rank x SP degree {max(model.sp_degrees)}"
                         f"{', longest level ' + str(max(config.pack_lengths)) if config.pack_lengths else ''}): "
                         f"rows {listed}{more}; allow a larger SP degree or memory budget, or pass oversize='drop'",
                         source=stats.source, record=int(bad[0]), field="tokens")
    return rows[~over], bad


def required_packs(tokens: np.ndarray, length: int, slots: int, fill: float) -> int:
    """Packs a level of ``length`` needs for ``tokens``, whole steps of ``slots``: enough room at ``fill``,
    and room for the big ones (at most ``k`` samples over ``length / (k + 1)`` share a pack)."""
    if len(tokens) == 0:
        return 0
    crowded = max(math.ceil(int((tokens > length / (k + 1)).sum()) / k) for k in range(1, CROWD_DEPTH + 1))
    need = max(math.ceil(float(tokens.sum()) / (fill * length)), crowded, 1)
    return -(-need // slots) * slots


def _settle_levels(level_of: np.ndarray, tokens: np.ndarray, lengths, slots: list[int], fill: float,
                   source: str) -> tuple[np.ndarray, list[int]]:
    """Levels and pack counts such that every used level has a sample for each of its packs (no empty
    micro-batch): a level short of samples takes the longest samples of the levels below it; a level too
    small for one step hands its samples to the next longer level."""
    level_of = level_of.copy()
    top = len(lengths) - 1
    for _ in range(2 * len(lengths) + 2):
        changed = False
        for k in range(top, -1, -1):
            members = np.flatnonzero(level_of == k)
            if len(members) == 0:
                continue
            need = required_packs(tokens[members], lengths[k], slots[k], fill)
            if len(members) >= need:
                continue
            below = np.flatnonzero(level_of < k)
            if k < top and len(members) + len(below) < need:
                level_of[members] = k + 1  # cannot fill a step: the next level takes them
            else:
                order = below[np.argsort(-tokens[below], kind="stable")]
                level_of[order[:need - len(members)]] = k
            changed = True
        if not changed:
            break
    packs = [required_packs(tokens[level_of == k], lengths[k], slots[k], fill) for k in range(len(lengths))]
    if any(int((level_of == k).sum()) < packs[k] for k in range(len(lengths))):
        raise InputError(f"{len(level_of)} samples cannot fill whole steps of every level without empty "
                         f"micro-batches (levels {list(lengths)}, micro-batches per step {slots})", source=source,
                         field="dp_size")
    return level_of, packs


def level_microbatch_counts(lengths, sp, num_microbatches: int, rule: str = "tokens",
                            step_tokens: int | None = None, least: int = 1) -> tuple[int, ...]:
    """Micro-batches per rank of each level's step: ``num_microbatches`` everywhere (``same``), or (``tokens``)
    ``max(least, round(T / (L_k / d_k)))``, where ``L_k / d_k`` is the level's pack length per SP rank and ``T`` the
    tokens per rank a step should hold: ``step_tokens``, or ``num_microbatches`` packs of the level of the
    most tokens per rank (which then keeps ``num_microbatches``). Every step then holds about ``T`` tokens
    per rank (the optimizer sees about the same batch in tokens whatever the level); ``least``: the fewest
    micro-batches a step may have (a level whose per-rank pack exceeds ``T`` holds more)."""
    if rule not in LEVEL_MICROBATCHES:
        raise InputError(f"unknown micro-batch rule {rule!r}; choose one of {LEVEL_MICROBATCHES}",
                         source="microbatches", field="microbatches")
    if rule == "same":
        return (int(num_microbatches),) * len(lengths)
    per_rank = [length / d for length, d in zip(lengths, sp)]
    target = num_microbatches * max(per_rank) if step_tokens is None else step_tokens
    return tuple(max(least, round(target / x)) for x in per_rank)


def _degrees_dividing(model: LevelCostModel, dp_size: int) -> LevelCostModel:
    """The model with only the SP degrees a world of ``dp_size`` ranks can form (a resharded world may
    have fewer; a sample that then fits no level is an oversize sample)."""
    keep = [i for i, d in enumerate(model.sp_degrees) if dp_size % d == 0]
    if not keep:
        raise InputError(f"no SP degree of {list(model.sp_degrees)} divides dp_size {dp_size}", source="sp_degrees",
                         field="sp_degrees")
    return replace(model, sp_degrees=tuple(model.sp_degrees[i] for i in keep),
                   a2a_per_token=tuple(model.a2a_per_token[i] for i in keep))


def balance_hbp(stats, *, dp_size: int, num_microbatches: int = 1, seed: int = 0, epoch: int = 0,
                config: HBPConfig | None = None, rows=None, cache: dict | None = None) -> Schedule:
    """One multi-level epoch of ``stats`` (or of its ``rows``; see the module docstring).

    ``cache``: a dict kept between calls that memoises each level's balanced schedule by its inputs (the
    planner tries one level's SP degree at a time; the other levels are then balanced once)."""
    config = config or HBPConfig()
    rows = np.arange(len(stats), dtype=np.int64) if rows is None else np.unique(np.asarray(rows, np.int64))
    if len(rows) == 0:
        raise InputError("no samples to schedule", source=stats.source)
    config = replace(config, model=_degrees_dividing(config.model, dp_size))
    kept, dropped = _check_oversize(stats, rows, config)
    sub = stats.take(kept)
    if config.pack_lengths is None:
        choice = choose_levels(sub, dp_size=dp_size, num_microbatches=num_microbatches, config=config)
        lengths, sp, estimate = choice.lengths, list(choice.sp), choice.cost
    else:
        lengths, estimate = config.pack_lengths, None
        sp = list(config.level_sp or level_degrees(level_costs(
            sub, dp_size=dp_size, num_microbatches=num_microbatches, config=config), lengths))
    if 0 in sp:  # no SP degree fits memory or fills a step: the smallest that fits memory still runs it
        sp = [d or next(iter(config.model.feasible_sp(n)), 0) for d, n in zip(sp, lengths)]
    if 0 in sp or len(sp) != len(lengths):
        raise InputError(f"level lengths {list(lengths)} need SP degrees {sp}: a level's per-rank share must fit "
                         f"max_tokens_per_rank {config.model.max_tokens_per_rank}", source="pack_lengths",
                         field="pack_lengths")
    tokens = np.asarray(sub.tokens, np.int64)
    level_of = np.searchsorted(np.asarray(lengths), tokens, side="left")
    mbs = level_microbatch_counts(lengths, sp, num_microbatches, config.microbatches, config.step_tokens,
                                  config.min_microbatches)
    slots = [dp_size // d * m for d, m in zip(sp, mbs)]
    level_of, packs = _settle_levels(level_of, tokens, lengths, slots, config.fill, stats.source)
    parts = []
    for k, (length, d) in enumerate(zip(lengths, sp)):
        members = np.flatnonzero(level_of == k)
        if len(members):
            sched = _balance_level_cached(sub.take(members), length, packs[k] // slots[k], cache,
                                          dp_size=dp_size // d, num_microbatches=mbs[k], seed=seed,
                                          epoch=epoch, balance_config=config.balance)
            parts.append((k, d, kept[members], sched))
    return _combine(parts, stats, lengths, dropped, dp_size=dp_size, seed=seed, epoch=epoch, estimate=estimate,
                    config=config)


def _balance_level_cached(level_stats, length: int, num_steps: int, cache: dict | None, **kwargs) -> Schedule:
    """:func:`balance_level`, memoised in ``cache`` by the level's rows and every other input."""
    if cache is None:
        return balance_level(level_stats, length, num_steps, **kwargs)
    key = ("hbp-level", level_stats.fingerprint(), int(length), int(num_steps),
           *(repr(kwargs[k].to_dict()) if k == "balance_config" else kwargs[k] for k in sorted(kwargs)))
    if key not in cache:
        cache[key] = balance_level(level_stats, length, num_steps, **kwargs)
    return cache[key]


def _combine(parts, stats, lengths, dropped, *, dp_size, seed, epoch, estimate, config: HBPConfig) -> Schedule:
    """One schedule of the levels' schedules: rows mapped back, SP groups expanded, steps interleaved; with
    micro-batch counts per level, the slots past a level's count point at one empty pack."""
    samples, offsets, step_ids, step_level = [], [0], [], []
    mbs = [int(p[3].num_microbatches) for p in parts]
    most = max(mbs)
    for level, (_, d, rows, sched) in enumerate(parts):
        base = len(offsets) - 1
        samples.append(rows[sched.pack_samples])
        offsets.extend((offsets[-1] + sched.pack_offsets[1:]).tolist())
        step_ids.append(np.repeat(sched.pack_ids + base, d, axis=1))  # every rank of an SP group: same packs
        step_level.extend([level] * sched.num_steps)
    if most != min(mbs):
        offsets.append(offsets[-1])
        empty = len(offsets) - 2
        step_ids = [np.pad(ids, ((0, 0), (0, 0), (0, most - ids.shape[2])), constant_values=empty)
                    for ids in step_ids]
    pack_ids = np.concatenate(step_ids)
    order = epoch_rng(seed, epoch, INTERLEAVE_STREAM).permutation(len(pack_ids))
    level_caps = [p[3].caps.to_dict() for p in parts]
    meta = {"hbp": {"level_lengths": [int(lengths[p[0]]) for p in parts], "level_caps": level_caps,
                    "level_steps": [int(p[3].num_steps) for p in parts], "level_microbatches": mbs,
                    "estimated_time": None if estimate is None else float(estimate),
                    "config": {"max_levels": config.max_levels, "fill": config.fill,
                               "sp_degrees": list(config.model.sp_degrees),
                               "max_tokens_per_rank": int(config.model.max_tokens_per_rank),
                               "microbatches": config.microbatches, "step_tokens": config.step_tokens,
                               "min_microbatches": config.min_microbatches,
                               "balance": config.balance.to_dict()}}}
    return Schedule(
        dp_size=dp_size, num_microbatches=most,
        caps=Caps(tiles=max(c["tiles"] for c in level_caps), tokens=max(c["tokens"] for c in level_caps)),
        pack_samples=np.concatenate(samples), pack_offsets=np.asarray(offsets, np.int64),
        pack_ids=pack_ids[order], num_samples=len(stats), padding="varlen", method="hbp", seed=seed,
        epoch=epoch, stats_fingerprint=stats.fingerprint(), dropped=np.sort(dropped), meta=meta,
        levels=tuple(int(step_level[i]) for i in order), level_sp=tuple(int(p[1]) for p in parts),
        level_microbatches=None if most == min(mbs) else tuple(mbs))


def untrained_rows(schedule: Schedule, steps_done: int) -> np.ndarray:
    """Rows of the steps from ``steps_done`` on (each once: SP group leaders only), sorted."""
    if not 0 <= steps_done <= schedule.num_steps:
        raise InputError(f"steps_done must be in [0, {schedule.num_steps}], got {steps_done}", field="steps_done",
                         source="schedule")
    ids = schedule.pack_ids[steps_done:][schedule.leader_mask()[steps_done:]].reshape(-1)
    return np.sort(np.concatenate([schedule.pack(int(k)) for k in ids] or [np.zeros(0, np.int64)]))


def level_lengths(schedule: Schedule) -> tuple[int, ...]:
    """The level lengths a multi-level schedule was built with (to rebuild or reshard it)."""
    return tuple(schedule.meta["hbp"]["level_lengths"])

