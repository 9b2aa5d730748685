"""`Schedule`: the result of balancing one epoch -- packs and their (step, dp_rank, micro-batch) slots.

Packs are stored in CSR form: pack ``k`` holds the stats rows ``pack_samples[pack_offsets[k]:pack_offsets[k+1]]``.
``pack_ids[step, dp_rank, micro]`` names the pack that rank ``dp_rank`` runs as micro-batch ``micro`` of
``step``. Every rank has the same number of steps and micro-batches (a pipeline needs it); a pack may be
empty only where documented (a baseline whose sample count does not fill the last step).

The stable JSON form (``to_json``) is the one the issue specifies, with metadata keys beside it::

    {"dp_size": N, "num_microbatches": M, "caps": {"tiles": Q_v, "tokens": Q_t},
     "steps": [ [ [ [i, ...] per micro-batch ] per rank ] per step ], ...metadata}

where ``i`` is the row index of the sample in the stats file. A hand-made single-level schedule may leave out
``caps`` (``Schedule.caps`` None); :mod:`omnibal.data.balance.schedule_json` is the one reader of the form.

Multi-level (HBP) schedules add ``"levels": [l, ...]`` (the packing level of each step) and
``"level_sp": [d, ...]`` (the sequence-parallel degree of each level); both are absent for a single-level
schedule, so older files load unchanged. In a step of a level with SP degree ``d`` the ranks ``r`` with the
same ``r // d`` form one SP group and hold identical micro-batch lists (the same packs, split along the
sequence at run time); exactly-once is counted over distinct SP groups, i.e. over the group leaders
``r % d == 0`` (:meth:`Schedule.leader_mask`). A multi-level schedule may also give each level its own
micro-batch count, ``"level_microbatches": [m, ...]`` (``num_microbatches`` is then the largest): a step of
level ``l`` lists ``m[l]`` micro-batches per rank (so the steps of a short level can hold as many tokens as a
long level's and pay the pipeline fill and drain and the gradient sync as rarely). In memory such a step
fills slots ``[0, m[l])`` of ``pack_ids``; the slots after them point at an empty pack and never run
(:meth:`Schedule.slot_mask`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from omnibal.cost.table import NUM_FEATURES, csr_features, microbatch_features, segment_max
from omnibal.data.balance.common import stable_order
from omnibal.data.balance.schedule_json import read_json, schedule_fields
from omnibal.errors import InputError
from omnibal.layout import Padding

FORMAT = "omnibal.schedule/1"


@dataclass(frozen=True, kw_only=True)
class Caps:
    """The fixed per-micro-batch buffer: at most ``tiles`` vision tiles and ``tokens`` LLM tokens."""

    tiles: int
    """Q_v: vision tiles per micro-batch."""
    tokens: int
    """Q_t: LLM tokens per micro-batch."""

    def to_dict(self) -> dict:
        return {"tiles": int(self.tiles), "tokens": int(self.tokens)}


@dataclass(frozen=True, kw_only=True, eq=False)
class Schedule:
    """One epoch of micro-batches for every DP rank (see the module docstring)."""

    dp_size: int
    """Data-parallel ranks."""
    num_microbatches: int
    """Micro-batches per rank per step (gradient accumulation / pipeline micro-batches)."""
    caps: Caps | None
    """The per-micro-batch buffer the packs respect (packs of ``own_pack`` oversize samples excepted); None:
    a hand-made single-level schedule that names none (a pipeline sizes its buffer from the micro-batches)."""
    pack_samples: np.ndarray
    """Flat stats row indices of all packs (int64), pack after pack."""
    pack_offsets: np.ndarray
    """``[num_packs + 1]`` CSR offsets into ``pack_samples``."""
    pack_ids: np.ndarray
    """``[num_steps, dp_size, num_microbatches]`` pack index of every micro-batch slot."""
    num_samples: int
    """Rows of the stats the schedule was built from."""
    padding: str = "varlen"
    """How a micro-batch runs: ``varlen`` (concatenated, per-sample attention), ``pad_to_longest``
    (a B x t_max batch), ``fixed_buffer`` (padded to the caps, per-sample attention)."""
    method: str = "omnibal"
    """Balancer that produced it."""
    seed: int = 0
    """Seed of the shuffle."""
    epoch: int = 0
    """Epoch it was built for (reshuffled per epoch)."""
    stats_fingerprint: str = ""
    """``SampleStats.fingerprint()`` of the stats it was built from."""
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Rows left out on purpose (``oversize='drop'``); never silent: listed here and in the metrics."""
    meta: dict = field(default_factory=dict)
    """JSON-able extras (config, timings, cost model name)."""
    levels: tuple[int, ...] | None = None
    """Packing level of each step (HBP); ``None`` = one level (SP degree 1 everywhere)."""
    level_sp: tuple[int, ...] | None = None
    """Sequence-parallel degree of each level (divides ``dp_size``); set exactly when ``levels`` is."""
    level_microbatches: tuple[int, ...] | None = None
    """Micro-batches per rank of each level's steps (the largest is ``num_microbatches``); ``None`` =
    ``num_microbatches`` on every step. Needs ``levels``."""
    source: str = "schedule"
    """Where it came from (the file it was read from), for the messages that name it."""

    def __post_init__(self) -> None:
        samples = np.ascontiguousarray(self.pack_samples, dtype=np.int64)
        offsets = np.ascontiguousarray(self.pack_offsets, dtype=np.int64)
        ids = np.ascontiguousarray(self.pack_ids, dtype=np.int64)
        dropped = np.ascontiguousarray(self.dropped, dtype=np.int64)
        assert offsets.ndim == 1 and offsets[0] == 0 and offsets[-1] == len(samples), "bad CSR offsets"
        assert np.all(np.diff(offsets) >= 0), "offsets must not decrease"
        assert ids.ndim == 3 and ids.shape[1:] == (self.dp_size, self.num_microbatches), ids.shape
        assert self.padding in tuple(Padding), self.padding
        for name, arr in (("pack_samples", samples), ("pack_offsets", offsets), ("pack_ids", ids),
                          ("dropped", dropped)):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        self._init_levels()

    def _init_levels(self) -> None:
        """Normalise ``levels``/``level_sp`` to int tuples and check SP groups hold identical packs."""
        assert (self.levels is None) == (self.level_sp is None), "levels and level_sp come together"
        if self.levels is None:
            return
        levels, level_sp = tuple(int(x) for x in self.levels), tuple(int(x) for x in self.level_sp)
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "level_sp", level_sp)
        assert len(levels) == self.num_steps, (len(levels), self.num_steps)
        assert all(0 <= lv < len(level_sp) for lv in levels), "level index out of range"
        assert all(d >= 1 and self.dp_size % d == 0 for d in level_sp), "an SP degree must divide dp_size"
        bad = self.sp_group_mismatch()
        assert bad is None, f"SP group of step {bad[0]} rank {bad[1]} holds other packs than its leader"
        if self.level_microbatches is not None:
            counts = tuple(int(x) for x in self.level_microbatches)
            object.__setattr__(self, "level_microbatches", counts)
            assert len(counts) == len(level_sp), "one micro-batch count per level"
            assert all(1 <= m <= self.num_microbatches for m in counts), counts
            assert max(counts) == self.num_microbatches, "num_microbatches is the largest level count"
            unused = self.pack_ids[~np.broadcast_to(self.slot_mask()[:, None, :], self.pack_ids.shape)]
            assert not self.pack_sizes()[unused].any(), "a slot past its level's micro-batch count holds samples"

    # -- sequence-parallel levels ---------------------------------------------------------------------
    def step_sp(self) -> np.ndarray:
        """SP degree of every step (``[num_steps]``; 1 for a single-level schedule)."""
        if self.levels is None:
            return np.ones(self.num_steps, np.int64)
        return np.asarray(self.level_sp, np.int64)[np.asarray(self.levels, np.int64)] if self.num_steps else (
            np.ones(0, np.int64))

    def step_microbatches(self) -> np.ndarray:
        """Micro-batches per rank of every step (``[num_steps]``; ``num_microbatches`` unless the levels
        have their own counts)."""
        if self.level_microbatches is None:
            return np.full(self.num_steps, self.num_microbatches, np.int64)
        return np.asarray(self.level_microbatches, np.int64)[np.asarray(self.levels, np.int64)] if (
            self.num_steps) else np.zeros(0, np.int64)

    def slot_mask(self) -> np.ndarray:
        """``[num_steps, num_microbatches]``: True for the micro-batch slots a step runs."""
        return np.arange(self.num_microbatches)[None, :] < self.step_microbatches()[:, None]

    def leader_mask(self) -> np.ndarray:
        """``[num_steps, dp_size]``: True for the first rank of each SP group -- the slots that count once
        for exactly-once (every rank of a single-level schedule)."""
        ranks = np.arange(self.dp_size)
        return (ranks[None, :] % self.step_sp()[:, None]) == 0

    def sp_group_mismatch(self) -> tuple[int, int] | None:
        """(step, rank) of the first rank whose micro-batches differ from its SP group leader's, else None."""
        sp = self.step_sp()
        ranks = np.arange(self.dp_size)
        leader = (ranks[None, :] // sp[:, None]) * sp[:, None]  # [S, D]
        lead_ids = np.take_along_axis(self.pack_ids, leader[:, :, None], axis=1)
        # the same pack ids: equal; other ids (e.g. read from JSON) are compared by content
        for step, r in np.argwhere((lead_ids != self.pack_ids).any(axis=2)):
            if any(not np.array_equal(self.pack(int(a)), self.pack(int(b)))
                   for a, b in zip(self.pack_ids[step, r], lead_ids[step, r])):
                return int(step), int(r)
        return None

    # -- shape --------------------------------------------------------------------------------------
    @property
    def num_packs(self) -> int:
        return len(self.pack_offsets) - 1

    @property
    def num_steps(self) -> int:
        return int(self.pack_ids.shape[0])

    def pack(self, k: int) -> np.ndarray:
        return self.pack_samples[self.pack_offsets[k]:self.pack_offsets[k + 1]]

    def microbatch(self, step: int, dp_rank: int, micro: int) -> np.ndarray:
        """Stats row indices of one micro-batch."""
        return self.pack(int(self.pack_ids[step, dp_rank, micro]))

    def pack_sizes(self) -> np.ndarray:
        return np.diff(self.pack_offsets)

    def sample_counts(self) -> np.ndarray:
        """How many times each stats row is scheduled (1 everywhere for a valid epoch, 0 for dropped rows)."""
        # an SP group's ranks share one pack: only its leader's slots count (every slot when single-level)
        uses = np.bincount(self.pack_ids[self.leader_mask()].reshape(-1), minlength=self.num_packs)
        weights = np.repeat(uses, self.pack_sizes()).astype(np.float64)
        return np.bincount(self.pack_samples, weights=weights, minlength=self.num_samples).astype(np.int64)

    # -- costs --------------------------------------------------------------------------------------
    def features(self, stats, padding: str | None = None) -> np.ndarray:
        """Cost features ``[num_steps, dp_size, num_microbatches, 4]`` of every micro-batch as it runs
        (``padding`` defaults to the schedule's own): ``(one, tiles, tokens, tokens_sq)``."""
        self._check_stats(stats)
        padding = padding or self.padding
        tiles = stats.tiles[self.pack_samples].astype(np.float64)
        tokens = stats.tokens[self.pack_samples].astype(np.float64)
        if padding == "varlen":
            per_pack = csr_features(tiles, tokens, self.pack_offsets)
        elif padding == "pad_to_longest":
            per_pack = csr_features(tiles, tokens, self.pack_offsets)
            sizes = self.pack_sizes().astype(np.float64)
            t_max = segment_max(tokens, self.pack_offsets)
            per_pack[:, 2] = sizes * t_max
            per_pack[:, 3] = sizes * t_max * t_max
        elif padding == "fixed_buffer":
            if self.caps is None:
                raise InputError("a schedule without caps has no fixed buffer", source=self.source, field="caps")
            per_pack = csr_features(tiles, tokens, self.pack_offsets)
            pad = np.clip(self.caps.tokens - per_pack[:, 2], 0, None)
            # Padding fills the token buffer as one extra masked segment; the ViT runs on Q_v tiles.
            per_pack[:, 1] = np.maximum(per_pack[:, 1], self.caps.tiles)
            per_pack[:, 2] = per_pack[:, 2] + pad
            per_pack[:, 3] = per_pack[:, 3] + pad * pad
        else:
            raise InputError(f"unknown padding {padding!r}; choose one of {', '.join(Padding)}", field="padding")
        if self.num_packs == 0:
            per_pack = np.zeros((0, NUM_FEATURES))
        feats = per_pack[self.pack_ids]
        if self.level_microbatches is not None:  # slots a step does not run cost nothing (not even the fixed term)
            feats = feats * self.slot_mask()[:, None, :, None]
        return feats

    def _check_stats(self, stats) -> None:
        if len(stats) != self.num_samples:
            raise InputError(f"schedule was built for {self.num_samples} samples, stats have {len(stats)}",
                             source=getattr(stats, "source", None), field="num_samples")
        if self.stats_fingerprint and stats.fingerprint() != self.stats_fingerprint:
            raise InputError("stats fingerprint does not match the schedule's (different or changed stats)",
                             source=getattr(stats, "source", None), field="fingerprint")

    # -- JSON ---------------------------------------------------------------------------------------
    def steps_nested(self) -> list:
        """``steps[step][rank][micro] = [row, ...]`` as plain lists (the stable JSON form; a step lists the
        micro-batches it runs)."""
        packs = np.split(self.pack_samples, self.pack_offsets[1:-1]) if self.num_packs else []
        pack_lists = [p.tolist() for p in packs]
        counts = self.step_microbatches().tolist()
        return [[[pack_lists[k] for k in rank[:m]] for rank in step] for step, m in zip(self.pack_ids.tolist(), counts)]

    def to_dict(self) -> dict:
        levels = {} if self.levels is None else {"levels": list(self.levels), "level_sp": list(self.level_sp)}
        if self.level_microbatches is not None:
            levels["level_microbatches"] = list(self.level_microbatches)
        return {
            "dp_size": int(self.dp_size),
            "num_microbatches": int(self.num_microbatches),
            "caps": None if self.caps is None else self.caps.to_dict(),
            "steps": self.steps_nested(),
            "format": FORMAT,
            "num_samples": int(self.num_samples),
            "padding": self.padding,
            "method": self.method,
            "seed": int(self.seed),
            "epoch": int(self.epoch),
            "stats_fingerprint": self.stats_fingerprint,
            "dropped": self.dropped.tolist(),
            "meta": self.meta,
            **levels,
        }

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), separators=(",", ":"))
        if path is not None:
            from omnibal.outputs import write_text

            write_text(path, text)  # atomic: a killed writer leaves the previous file, never a truncated one
        return text

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "<schedule>") -> Schedule:
        """The JSON form back: the format's one reader (:mod:`omnibal.data.balance.schedule_json`), for the
        balancer's files and hand-made ones (a single-level file may leave out ``caps``); every field is
        checked (an InputError names the file, record and field)."""
        fields = schedule_fields(d, source)
        caps = fields.pop("caps")
        return cls(caps=None if caps is None else Caps(tiles=caps[0], tokens=caps[1]), source=source, **fields)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Schedule:
        """:meth:`from_dict` of a JSON text, or of the file at a path (a ``Path``, or a string that is not an
        object's text)."""
        d, source = read_json(text_or_path)
        return cls.from_dict(d, source=source)

    def fingerprint(self) -> str:
        """SHA-256 (32 hex digits) of what the schedule deals (:func:`csr_fingerprint`): two ranks that built the
        same schedule get the same one, any other pack, pack numbering or slot changes it. What a checkpoint
        records, and what the ranks of a job compare before they train a schedule."""
        counts = self.step_microbatches() if self.level_microbatches is not None else None
        return csr_fingerprint(self.dp_size, self.num_microbatches, self.num_steps,
                               (self.pack_samples, self.pack_offsets, self.pack_ids), counts)

    def equals(self, other: Schedule) -> bool:
        """Same micro-batches in the same slots (packs compared by content, not by numbering)."""
        if (self.dp_size, self.num_microbatches, self.num_steps) != (other.dp_size, other.num_microbatches,
                                                                      other.num_steps):
            return False
        return (self.steps_nested() == other.steps_nested() and self.caps == other.caps
                and self.levels == other.levels and self.level_sp == other.level_sp
                and self.level_microbatches == other.level_microbatches)


def csr_fingerprint(dp_size: int, num_microbatches: int, num_steps: int, arrays, counts=None) -> str:
    """SHA-256 (32 hex digits) of a schedule's layout, its CSR arrays ``(pack_samples, pack_offsets, pack_ids)``
    and, when its levels run their own micro-batch counts, every step's count; integers as little-endian
    int64, so every machine hashes the same bytes."""
    h = hashlib.sha256(f"{dp_size},{num_microbatches},{num_steps}".encode())
    if counts is not None:
        h.update(b"counts" + np.ascontiguousarray(counts, dtype="<i8").tobytes())
    for arr in arrays:
        h.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
    return h.hexdigest()[:32]


def build_schedule(*, pack_of: np.ndarray, num_packs: int, pack_ids: np.ndarray, **kwargs) -> Schedule:
    """CSR packs from a per-sample pack label (``-1`` = not in any pack) with a stable in-pack order."""
    pack_of = np.asarray(pack_of, dtype=np.int64)
    rows = np.flatnonzero(pack_of >= 0)
    order = rows[stable_order(pack_of[rows])]
    counts = np.bincount(pack_of[rows], minlength=num_packs)
    offsets = np.zeros(num_packs + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Schedule(pack_samples=order, pack_offsets=offsets, pack_ids=pack_ids, **kwargs)


__all__ = ["Caps", "Schedule", "FORMAT", "build_schedule", "csr_fingerprint", "microbatch_features"]
