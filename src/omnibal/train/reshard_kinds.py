"""Resharding the schedules that are not the single-level balancer's: HBP levels and random micro-batches.

:mod:`omnibal.train.reshard` re-balances the rest of a single-level balancer epoch with the sampler. The
trainer also runs multi-level (HBP) schedules and, in baseline and online mode, seeded random micro-batches;
a resume on another DP size must finish their epochs exactly once too:

``hbp``     the untrained rows are balanced again by :func:`omnibal.hbp.balance.balance_hbp` at the old level
            lengths, for the new world. A level keeps its SP degree where the new world can form it, else the
            largest degree below it that divides the new DP size and the attention heads (the run says so: a
            rank then holds more of each pack).
``random``  the untrained rows are dealt again, seeded, into micro-batches of the old batch size for the new
            world; a last step holds what is left, split evenly (never an empty micro-batch). Rows too few
            for one sample per slot of a step are left untrained and said.

Both keep a record (:func:`rest_record`) in the checkpoint's sampler state, so a resharded run resumes and
reshards again. The original random schedule is rebuilt from its record; an original HBP schedule is the
``--schedule-file`` the run is given, checked against the checkpoint's fingerprint.
"""

from __future__ import annotations

import numpy as np

from omnibal.data.balance.schedule import Schedule
from omnibal.errors import InputError
from omnibal.train.feed import IndexSchedule, random_microbatch_schedule


def deal_rows(rows: np.ndarray, *, dp_size: int, num_microbatches: int, batch_size: int, seed: int,
              source: str, equal_ranks: bool = False) -> tuple[IndexSchedule, np.ndarray]:
    """``rows`` (dataset rows) shuffled and dealt into micro-batches of ``batch_size`` for ``dp_size`` ranks,
    a last step holding the rest split evenly; returns (schedule of dataset rows, rows left untrained: fewer
    than one per slot of a step). ``equal_ranks`` (online mode: every rank draws as many samples as the
    others): the last step gives every rank the same number, leaving fewer than ``dp_size`` rows more."""
    slots = dp_size * num_microbatches
    order = np.asarray(rows, np.int64)[np.random.default_rng(seed).permutation(len(rows))]
    per_step = slots * batch_size
    full = len(order) // per_step
    grid = order[: full * per_step].reshape(full, dp_size, num_microbatches, batch_size)
    steps = [tuple(tuple(grid[s, r, k] for k in range(num_microbatches)) for r in range(dp_size))
             for s in range(full)]
    tail = order[full * per_step:]
    if equal_ranks:
        tail = tail[: len(tail) // dp_size * dp_size]
    left = np.sort(order[full * per_step + len(tail):]) if len(tail) >= slots else order[full * per_step:]
    if len(tail) >= slots:
        ranks = np.array_split(tail, dp_size)
        steps.append(tuple(tuple(np.array_split(mine, num_microbatches)) for mine in ranks))
    return IndexSchedule(dp_size, num_microbatches, tuple(steps), None, source), np.sort(left)


def untrained(schedule, next_step: int) -> np.ndarray:
    """Rows of ``schedule``'s steps from ``next_step`` on, each once (an SP group's leader), sorted."""
    counts = getattr(schedule, "step_microbatches", None)
    counts = counts() if counts is not None else [schedule.num_microbatches] * schedule.num_steps
    sp = schedule.step_sp() if getattr(schedule, "levels", None) is not None else [1] * schedule.num_steps
    parts = [np.asarray(schedule.microbatch(s, r, k), np.int64) for s in range(next_step, schedule.num_steps)
             for r in range(0, schedule.dp_size, int(sp[s])) for k in range(int(counts[s]))]
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def hbp_of(schedule) -> Schedule | None:
    """The multi-level balancer schedule behind ``schedule`` (itself or a remainder's), else None."""
    inner = getattr(schedule, "inner", schedule)
    return inner if isinstance(inner, Schedule) and inner.levels is not None and "hbp" in inner.meta else None


def new_degrees(level_sp, *, dp_size: int, num_heads: int) -> tuple[int, ...]:
    """Each level's SP degree in a world of ``dp_size`` ranks: its own where it divides the DP size and the
    heads, else the largest degree below it that does."""
    return tuple(max(d for d in range(1, int(old) + 1) if dp_size % d == 0 and num_heads % d == 0)
                 for old in level_sp)


def hbp_params(old: Schedule) -> dict:
    """What :func:`hbp_rest` reads of an HBP schedule: its levels, micro-batches, seed, epoch and settings.
    Per-level micro-batch counts (the ``tokens`` rule) keep the tokens per rank a step held: a level whose SP
    degree changes then runs the count that holds them at its new per-rank length."""
    lengths, sp = [int(x) for x in old.meta["hbp"]["level_lengths"]], [int(d) for d in old.level_sp]
    config = dict(old.meta["hbp"].get("config") or {})
    if config.get("microbatches") == "tokens" and config.get("step_tokens") is None:
        counts = old.level_microbatches or (old.num_microbatches,) * len(lengths)
        widest = max(range(len(lengths)), key=lambda k: lengths[k] / sp[k])
        config["step_tokens"] = max(1, round(counts[widest] * lengths[widest] / sp[widest]))
    return {"level_lengths": lengths, "level_sp": sp, "num_microbatches": int(old.num_microbatches),
            "seed": int(old.seed), "epoch": int(old.epoch), "config": config}


def hbp_rest(params: dict, rows: np.ndarray, stats, *, dp_size: int, num_heads: int, source: str) -> Schedule:
    """``rows`` balanced again at the old levels (``params``: :func:`hbp_params`) for ``dp_size`` ranks (see the
    module docstring)."""
    from omnibal.hbp.balance import balance_hbp
    from omnibal.hbp.levels import HBPConfig, LevelCostModel
    from omnibal.train.reshard import _config_from_dict

    saved = params["config"]
    sp = new_degrees(params["level_sp"], dp_size=dp_size, num_heads=num_heads)
    degrees = tuple(sorted(set(sp)))
    config = HBPConfig(model=LevelCostModel(sp_degrees=degrees, a2a_per_token=(0.0,) * len(degrees)),
                       pack_lengths=tuple(int(x) for x in params["level_lengths"]), level_sp=sp,
                       fill=float(saved.get("fill", 0.95)), microbatches=saved.get("microbatches", "same"),
                       step_tokens=saved.get("step_tokens"), min_microbatches=int(saved.get("min_microbatches", 1)),
                       balance=_config_from_dict(saved["balance"], source) if "balance" in saved else
                       HBPConfig().balance)
    try:
        return balance_hbp(stats, dp_size=dp_size, num_microbatches=int(params["num_microbatches"]),
                           seed=int(params["seed"]), epoch=int(params["epoch"]), config=config, rows=rows)
    except InputError as exc:
        raise InputError(f"the {len(rows)} samples left do not balance for dp {dp_size}: {exc.message}",
                         source=source, field=exc.field) from exc


def hbp_record(params: dict, rows: np.ndarray, *, dp_size: int, num_heads: int, step_offset: int) -> dict:
    """What rebuilds :func:`hbp_rest`'s schedule: the old levels and settings, the rows and where they start."""
    return {"kind": "hbp", **params, "dp_size": int(dp_size), "num_heads": int(num_heads),
            "rows": [int(r) for r in rows], "step_offset": int(step_offset)}


def rebuild(record: dict, stats, *, source: str):
    """The schedule a record describes (a random epoch, or an HBP or random remainder), or an InputError."""
    from omnibal.train.reshard import ResumedSchedule

    try:
        kind, rows = record["kind"], record.get("rows")
        rows = None if rows is None else np.asarray(rows, np.int64)
        if rows is not None and (rows.ndim != 1 or (len(rows) and (rows.min() < 0 or rows.max() >= len(stats)))):
            raise ValueError("rows outside the statistics")
        if kind == "random" and rows is None:
            sched = random_microbatch_schedule(int(record["num_samples"]), dp_size=int(record["dp_size"]),
                                               num_microbatches=int(record["num_microbatches"]),
                                               batch_size=int(record["batch_size"]), seed=int(record["seed"]))
            return sched
        offset = int(record["step_offset"])
        if kind == "random":
            inner, _ = deal_rows(rows, dp_size=int(record["dp_size"]), num_microbatches=int(record["num_microbatches"]),
                                 batch_size=int(record["batch_size"]), seed=int(record["seed"]) + offset,
                                 source=source, equal_ranks=bool(record.get("equal_ranks", False)))
        elif kind == "hbp":
            inner = hbp_rest(record, rows, stats, dp_size=int(record["dp_size"]), num_heads=int(record["num_heads"]),
                             source=source)
        else:
            raise ValueError(f"unknown kind {kind!r}")
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"unreadable schedule record: {exc}", source=source, field="sampler.rebuild") from None
    return ResumedSchedule(inner, None, offset, source=f"rest of the epoch after step {offset} ({kind})",
                           record=dict(record))


def rest_of_epoch(old, next_step: int, stats, *, dp_size: int, num_microbatches: int, num_heads: int,
                  source: str, equal_ranks: bool = False):
    """The rest of ``old``'s epoch after ``next_step``, for ``dp_size`` ranks: ``(ResumedSchedule, notices)``,
    or None when ``old`` is the single-level balancer's (:func:`omnibal.train.reshard.reshard_schedule`).
    ``equal_ranks``: random draws give every rank as many samples (online mode)."""
    from omnibal.train.reshard import ResumedSchedule

    hbp = hbp_of(old)
    record = getattr(old, "record", None)
    if hbp is None and (record or {}).get("kind") != "random":
        return None
    offset = getattr(old, "step_offset", 0)
    if not offset <= next_step <= old.num_steps:
        raise InputError(f"next_step {next_step} outside the checkpoint's schedule [{offset}, {old.num_steps}]",
                         source=source, field="sampler.next_step")
    rows = untrained(old, next_step)
    if len(rows) == 0:  # the epoch is done: nothing to re-balance, no step left to run
        empty = IndexSchedule(dp_size, num_microbatches, (), None, source)
        return ResumedSchedule(empty, None, next_step, f"the end of the epoch at step {next_step}"), []
    if hbp is not None:
        params = hbp_params(hbp)
        inner = hbp_rest(params, rows, stats, dp_size=dp_size, num_heads=num_heads, source=source)
        new = ResumedSchedule(inner, None, next_step, f"rest of the epoch after step {next_step}, re-balanced at "
                              f"its levels for dp {dp_size}", hbp_record(params, rows, dp_size=dp_size,
                                                                         num_heads=num_heads, step_offset=next_step))
        by_length = dict(zip(params["level_lengths"], params["level_sp"]))
        notes = [f"the level of {length} tokens runs at SP {d} (was {by_length[length]}): dp {dp_size} has no SP "
                 f"group of {by_length[length]} ranks, so each rank holds more of every pack"
                 for length, d in zip(inner.meta["hbp"]["level_lengths"], inner.level_sp)
                 if d != by_length.get(length, d)]
        return new, notes
    seed, batch = int(record["seed"]), int(record["batch_size"])
    inner, left = deal_rows(rows, dp_size=dp_size, num_microbatches=num_microbatches, batch_size=batch,
                            seed=seed + next_step, source=source, equal_ranks=equal_ranks)
    rec = {"kind": "random", "dp_size": dp_size, "num_microbatches": num_microbatches, "batch_size": batch,
           "seed": seed, "num_samples": int(record["num_samples"]), "rows": [int(r) for r in rows],
           "step_offset": int(next_step), "equal_ranks": equal_ranks}
    new = ResumedSchedule(inner, None, next_step, f"rest of the epoch after step {next_step}, dealt again in "
                          f"micro-batches of up to {batch} for dp {dp_size}", rec)
    notes = [f"{len(left)} samples of the rest of the epoch do not fill a last step of {dp_size} x "
             f"{num_microbatches} micro-batches{' with as many samples per rank' if equal_ranks else ''}: they are "
             "not trained"] if len(left) else []
    return new, notes
