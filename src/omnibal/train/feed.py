"""What each rank feeds into its pipeline: schedules of sample indices and the micro-batches built from them.

A *schedule* says, for every step, DP rank and micro-batch, which dataset samples form that micro-batch.
It is the balancer's output (``omnibal.data.balance.Schedule``; JSON
``{"dp_size", "num_microbatches", "caps": {"tiles", "tokens"}, "steps": [[[[i, ...]]]]}``, the one reader of
which also takes a hand-made file without ``caps``: :func:`load_schedule`) in offline mode,
or :func:`random_microbatch_schedule` (fixed B random samples per micro-batch) in baseline mode. Anything
with ``dp_size``, ``num_microbatches``, ``num_steps`` and ``microbatch(step, dp_rank, micro)`` works.

A step runs :func:`step_microbatches` micro-batches per rank: ``num_microbatches`` everywhere, except in a
multi-level (HBP) schedule whose levels have their own counts (``Schedule.level_microbatches``;
``num_microbatches`` is then the largest). Such a step runs slots ``[0, m)``; the slots after hold one empty
pack and never run. :func:`check_schedule` refuses a schedule whose run slots are empty or whose unrun slots
hold samples.

Data path: only pipeline stage 0 of each DP rank reads samples and collates them; the labels travel
inside the carry (``token_meta``) to the last stage, so later stages touch no data and need no dataset.
The schedule is deterministic, so the sampler state of a checkpoint is just the next step index plus the
schedule's fingerprint: resuming continues the exact sample stream.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from omnibal.data.balance.schedule import Caps, Schedule, csr_fingerprint
from omnibal.errors import InputError


class ScheduleLike(Protocol):
    dp_size: int
    num_microbatches: int

    @property
    def num_steps(self) -> int: ...

    def microbatch(self, step: int, dp_rank: int, micro: int) -> np.ndarray: ...


@dataclass(frozen=True, eq=False)
class IndexSchedule:
    """A schedule held in memory as nested index arrays (the baseline's random micro-batches, a resharded
    remainder's rows); files are read as the balancer's :class:`Schedule`."""

    dp_size: int
    num_microbatches: int
    steps: tuple  # steps[step][dp_rank][micro] -> np.ndarray of sample indices
    caps: Caps | None = None
    source: str = "<schedule>"
    stats_fingerprint: str = ""
    """``SampleStats.fingerprint()`` of the statistics the schedule was made for ("" when it does not say)."""
    dropped: tuple = ()
    """Rows left out of the epoch on purpose."""
    record: dict | None = None
    """How to build it again (a random epoch's seed and layout: :mod:`omnibal.train.reshard_kinds`)."""

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def microbatch(self, step: int, dp_rank: int, micro: int) -> np.ndarray:
        return self.steps[step][dp_rank][micro]


def load_schedule(path: str | Path) -> Schedule:
    """A schedule JSON file (``omnibal balance --out``, or a hand-made single-level one that may leave out
    ``caps``), read by the format's one reader, :meth:`Schedule.from_json`."""
    return Schedule.from_json(Path(path))


def step_microbatches(schedule: ScheduleLike) -> np.ndarray:
    """Micro-batches per rank every step runs (``[num_steps]`` ints): the schedule's own counts
    (``Schedule.step_microbatches``: a multi-level schedule's levels may each have theirs), else
    ``num_microbatches`` on every step."""
    own = getattr(schedule, "step_microbatches", None)
    if own is None:
        return np.full(schedule.num_steps, schedule.num_microbatches, np.int64)
    return np.asarray(own(), np.int64)


def check_schedule_covers(schedule, *, stats_fingerprint: str, num_samples: int, source: str,
                          stats_source: str = "the statistics") -> None:
    """Refuse a schedule file made for other statistics, or that does not schedule every row of these once.

    The schedule must record the fingerprint of the statistics it was balanced from (``omnibal balance``
    writes it), equal to ``stats_fingerprint``; and every row is in exactly one micro-batch, except rows
    the schedule lists as ``dropped``."""
    recorded = getattr(schedule, "stats_fingerprint", "")
    if not recorded:
        raise InputError("the schedule does not record the statistics it was made for (stats_fingerprint): "
                         "make it with `omnibal balance --stats` on the same file", source=source,
                         field="stats_fingerprint")
    if recorded != stats_fingerprint:
        raise InputError(f"the schedule was balanced from other statistics (fingerprint {recorded}); {stats_source} "
                         f"have fingerprint {stats_fingerprint} ({num_samples} rows)", source=source,
                         field="stats_fingerprint")
    counts = _row_counts(schedule, num_samples, source)
    dropped = np.asarray(getattr(schedule, "dropped", ()), np.int64)
    if len(dropped) and (dropped.min() < 0 or dropped.max() >= num_samples):
        raise InputError(f"dropped row outside the {num_samples} rows", source=source, field="dropped")
    counts[dropped] += 1
    wrong = np.flatnonzero(counts != 1)
    if len(wrong):
        i = int(wrong[0])
        raise InputError(f"{len(wrong)} rows are not scheduled exactly once (row {i}: {int(counts[i])} times, "
                         f"dropped rows counted once): an epoch trains every sample once", source=source,
                         field="steps")


def schedule_fingerprint(schedule: ScheduleLike) -> str:
    """SHA-256 over every micro-batch's indices: a checkpoint resumes only the schedule it was made with, and
    the ranks of a run compare it before training (``Trainer.check_schedule_agrees``). The balancer's
    Schedule (CSR arrays): :meth:`Schedule.fingerprint <omnibal.data.balance.schedule.Schedule.fingerprint>`."""
    counts = step_microbatches(schedule)
    levels = getattr(schedule, "level_microbatches", None) is not None  # which slots run (single-level: unchanged)
    csr = _csr(schedule)
    if csr is not None:  # the balancer's Schedule: hash its arrays in one go
        return csr_fingerprint(schedule.dp_size, schedule.num_microbatches, schedule.num_steps, csr,
                               counts if levels else None)
    h = hashlib.sha256(f"{schedule.dp_size},{schedule.num_microbatches},{schedule.num_steps}".encode())
    if levels:
        h.update(b"counts" + counts.tobytes())
    for s in range(schedule.num_steps):
        for r in range(schedule.dp_size):
            for k in range(int(counts[s])):
                h.update(np.ascontiguousarray(schedule.microbatch(s, r, k), dtype=np.int64).tobytes())
                h.update(b"|")
    return h.hexdigest()[:32]


def check_schedule(schedule: ScheduleLike, *, dp_size: int, num_microbatches: int, num_samples: int | None,
                   source: str, pp_size: int = 1) -> None:
    """Refuse a schedule for another world or dataset (indices out of range), with an empty micro-batch, or
    whose per-step micro-batch counts do not fit the run: ``num_microbatches`` (``--microbatches``) must be the
    schedule's, i.e. its largest level count when the levels have their own, and a 1F1B pipeline of
    ``pp_size`` stages (pass 1 for GPipe) needs at least ``pp_size`` micro-batches in every step.
    ``num_samples`` None (a pipeline stage without the dataset) checks everything but the row indices."""
    if schedule.dp_size != dp_size:
        raise InputError(f"schedule is for dp_size {schedule.dp_size}, the run has {dp_size}", source=source,
                         field="dp_size")
    levels = getattr(schedule, "level_microbatches", None)
    if schedule.num_microbatches != num_microbatches:
        what = (f"levels run {list(levels)} micro-batches per rank: the run's micro-batch count must be the largest, "
                f"{schedule.num_microbatches}" if levels is not None else
                f"has {schedule.num_microbatches} micro-batches per rank")
        raise InputError(f"schedule {what}; the run has {num_microbatches}", source=source, field="num_microbatches")
    counts = check_step_counts(schedule, source)
    short = np.flatnonzero(counts < pp_size)
    if len(short):
        s = int(short[0])
        raise InputError(f"step {s} runs {int(counts[s])} micro-batches per rank; 1F1B over {pp_size} stages needs "
                         f"at least {pp_size} in every step (balance with more micro-batches)", source=source,
                         record=f"step {s}", field="level_microbatches" if levels is not None else "num_microbatches")
    if num_samples is None:
        _check_slots(schedule, counts, source)
    else:
        _row_counts(schedule, num_samples, source)  # no empty micro-batch, every index in range


def check_step_counts(schedule: ScheduleLike, source: str) -> np.ndarray:
    """:func:`step_microbatches`, checked: one count per step, each in ``[1, num_microbatches]``."""
    counts = step_microbatches(schedule)
    m = schedule.num_microbatches
    if counts.shape != (schedule.num_steps,):
        raise InputError(f"{len(counts)} micro-batch counts for {schedule.num_steps} steps", source=source,
                         field="level_microbatches")
    bad = np.flatnonzero((counts < 1) | (counts > m))
    if len(bad):
        s = int(bad[0])
        raise InputError(f"step {s} runs {int(counts[s])} micro-batches per rank, outside [1, {m}]", source=source,
                         record=f"step {s}", field="level_microbatches")
    return counts


def _slot_error(counts: np.ndarray, sizes: np.ndarray, source: str) -> InputError | None:
    """The first run slot that is empty or unrun slot that holds samples (``sizes [S, D, M]``), else None."""
    runs = np.arange(sizes.shape[2])[None, None, :] < counts[:, None, None]
    wrong = np.argwhere((runs & (sizes == 0)) | (~runs & (sizes > 0)))
    if not len(wrong):
        return None
    s, r, k = (int(x) for x in wrong[0])
    record = f"step {s} rank {r} micro-batch {k}"
    if k < counts[s]:
        return InputError("empty micro-batch", source=source, record=record, field="steps")
    return InputError(f"micro-batch slot {k} is past the {int(counts[s])} micro-batches step {s} runs but holds "
                      f"{int(sizes[s, r, k])} samples (they would never train)", source=source, record=record,
                      field="level_microbatches")


def _check_slots(schedule, counts: np.ndarray, source: str) -> None:
    """Every micro-batch a step runs holds samples; every slot past the step's count is empty."""
    csr = _csr(schedule)
    if csr is not None:
        samples, offsets, ids = csr
        # a resharded remainder's pack_ids hold only its own steps, the last ones of its numbering
        error = _slot_error(counts[len(counts) - len(ids):], np.diff(offsets)[ids], source)
        if error is not None:
            raise error
        return
    for s in range(schedule.num_steps):
        for r in range(schedule.dp_size):
            for k in range(int(counts[s])):
                if len(schedule.microbatch(s, r, k)) == 0:
                    raise InputError("empty micro-batch", source=source, record=f"step {s} rank {r} micro-batch {k}",
                                     field="steps")


def _row_counts(schedule, num_samples: int, source: str) -> np.ndarray:
    """How many times each row is scheduled (the micro-batches each step runs); an empty micro-batch, an unrun
    slot that holds samples or an index out of range is an InputError."""
    def bad(message: str, s: int, r: int, k: int) -> InputError:
        return InputError(message, source=source, record=f"step {s} rank {r} micro-batch {k}", field="steps")

    counts_per_step = check_step_counts(schedule, source)
    _check_slots(schedule, counts_per_step, source)
    csr = _csr(schedule)
    if csr is not None:  # the balancer's CSR packs, in one pass
        samples, offsets, ids = csr
        sizes = np.diff(offsets)
        if len(samples) and (samples.min() < 0 or samples.max() >= num_samples):
            raise _outside(csr, num_samples, schedule.num_steps - len(ids), source)
        # an SP group's ranks hold the same packs: its leader's slots count (every slot without levels); the
        # slots past a step's count are empty (checked above), so they add nothing
        counted = ids[schedule.leader_mask()] if getattr(schedule, "levels", None) is not None else ids
        uses = np.repeat(np.bincount(counted.reshape(-1), minlength=len(sizes)), sizes)
        return np.bincount(samples, weights=uses, minlength=num_samples).astype(np.int64)
    counts = np.zeros(num_samples, np.int64)
    for s in range(schedule.num_steps):
        for r in range(schedule.dp_size):
            for k in range(int(counts_per_step[s])):
                mb = np.asarray(schedule.microbatch(s, r, k), np.int64)
                if mb.min() < 0 or mb.max() >= num_samples:
                    index = int(mb.max() if mb.max() >= num_samples else mb.min())
                    raise bad(f"sample index {index} outside the dataset of {num_samples}", s, r, k)
                np.add.at(counts, mb, 1)
    return counts


def _outside(csr, num_samples: int, first_step: int, source: str) -> InputError:
    """The first micro-batch slot (step, rank, micro-batch order) of CSR packs that holds a row outside the
    dataset, named as the per-micro-batch path names it (``first_step``: the step of ``pack_ids[0]``)."""
    samples, offsets, ids = csr
    bad = np.flatnonzero((samples < 0) | (samples >= num_samples))
    slots = np.argwhere(np.isin(ids, np.searchsorted(offsets, bad, side="right") - 1))
    if not len(slots):  # only in a pack no slot runs
        return InputError(f"sample index {int(samples[bad[0]])} outside the dataset of {num_samples}",
                          source=source, field="steps")
    s, r, k = (int(x) for x in slots[0])
    mb = samples[offsets[ids[s, r, k]]:offsets[ids[s, r, k] + 1]]
    index = int(mb.max() if mb.max() >= num_samples else mb.min())
    return InputError(f"sample index {index} outside the dataset of {num_samples}", source=source,
                      record=f"step {first_step + s} rank {r} micro-batch {k}", field="steps")


def random_microbatch_schedule(num_samples: int, *, dp_size: int, num_microbatches: int, batch_size: int,
                               seed: int, num_steps: int | None = None) -> IndexSchedule:
    """The InternVL-style baseline: shuffle the dataset, deal fixed micro-batches of ``batch_size`` samples.

    Step ``s``, rank ``r``, micro-batch ``k`` takes the next ``batch_size`` samples of one seeded
    permutation; the tail that does not fill a whole step is left out (and reported by the caller).
    """
    per_step = dp_size * num_microbatches * batch_size
    available = num_samples // per_step
    if available == 0:
        raise InputError(f"{num_samples} samples cannot fill one step of {dp_size} x {num_microbatches} x "
                         f"{batch_size}", source="baseline schedule", field="baseline_batch_size")
    steps = available if num_steps is None else min(num_steps, available)
    perm = np.random.default_rng(seed).permutation(num_samples)[: steps * per_step]
    grid = perm.reshape(steps, dp_size, num_microbatches, batch_size)
    record = {"kind": "random", "dp_size": dp_size, "num_microbatches": num_microbatches, "batch_size": batch_size,
              "seed": seed, "num_samples": num_samples, "rows": None, "step_offset": 0}
    return IndexSchedule(dp_size, num_microbatches,
                         tuple(tuple(tuple(grid[s, r, k] for k in range(num_microbatches)) for r in range(dp_size))
                               for s in range(steps)), None, f"random micro-batches of {batch_size}, seed {seed}",
                         record=None if num_steps is not None else record)


def buffer_shape(schedule: ScheduleLike, tiles: np.ndarray, tokens: np.ndarray, *, pad_to_longest: bool,
                 steps: Sequence[int] | None = None) -> tuple[int, int]:
    """The smallest fixed (tiles, tokens) buffer that holds every micro-batch of the schedule.

    Packs: sums of tiles and tokens. Padded micro-batches: sum of tiles, B x longest sample. A pipeline
    needs one fixed shape, so the baseline pays for its worst micro-batch's buffer (memory and p2p bytes;
    the model skips the unused tail, so not compute).
    """
    csr = _csr(schedule)
    if csr is not None and steps is None:  # vectorised over the balancer's CSR packs
        samples, offsets, pack_ids = csr
        sizes = np.diff(offsets)
        packs = np.flatnonzero(sizes > 0)  # strictly increasing starts: reduceat segments are exactly the packs
        if len(packs) == 0:
            return 1, 1
        starts = offsets[:-1][packs]
        t = tokens[samples].astype(np.int64)
        need_tiles = np.add.reduceat(tiles[samples].astype(np.int64), starts)
        need_tokens = np.maximum.reduceat(t, starts) * sizes[packs] if pad_to_longest else np.add.reduceat(t, starts)
        used = np.isin(packs, pack_ids)
        if not used.any():
            return 1, 1
        return max(1, int(need_tiles[used].max())), max(1, int(need_tokens[used].max()))
    max_tiles = max_tokens = 1
    counts = step_microbatches(schedule)
    for s in steps if steps is not None else range(schedule.num_steps):
        for r in range(schedule.dp_size):
            for k in range(int(counts[s])):
                mb = schedule.microbatch(s, r, k)
                if len(mb) == 0:
                    continue
                t = tokens[mb]
                need_tokens = int(len(mb) * t.max()) if pad_to_longest else int(t.sum())
                max_tiles = max(max_tiles, int(tiles[mb].sum()))
                max_tokens = max(max_tokens, need_tokens)
    return max_tiles, max_tokens


@dataclass(frozen=True)
class Buffer:
    """Fixed micro-batch buffer (tiles, tokens); None on a 1-stage run sizes each micro-batch exactly."""

    tiles: int
    tokens: int


def fixed_buffer(schedule: ScheduleLike, stats, *, mode: str) -> Buffer:
    """The pipeline's fixed micro-batch buffer: the balancer's caps in offline mode (every pack fits them by
    construction; one that does not is refused by the collator), else the tightest buffer that holds every
    micro-batch of the schedule (the baseline pays for its worst padded micro-batch)."""
    caps = getattr(schedule, "caps", None)
    if mode == "offline" and caps is not None:
        return Buffer(int(caps.tiles), int(caps.tokens))
    tiles, tokens = buffer_shape(schedule, stats.tiles, stats.tokens, pad_to_longest=mode == "baseline")
    return Buffer(tiles, tokens)


def _csr(schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(pack_samples, pack_offsets, pack_ids) of a balancer Schedule, or None for other schedules."""
    arrays = [getattr(schedule, name, None) for name in ("pack_samples", "pack_offsets", "pack_ids")]
    return None if any(a is None for a in arrays) else tuple(np.asarray(a) for a in arrays)  # type: ignore
