"""`Schedule`: the result of balancing one epoch -- packs and their (step, dp_rank, micro-batch) slots.

Packs are stored in CSR form: pack ``k`` holds the stats rows ``pack_samples[pack_offsets[k]:pack_offsets[k+1]]``.
``pack_ids[step, dp_rank, micro]`` names the pack that rank ``dp_rank`` runs as micro-batch ``micro`` of
``step``. Every rank has the same number of steps and micro-batches (a pipeline needs it); a pack may be
empty only where documented (a baseline whose sample count does not fill the last step).

The stable JSON form (``to_json``) is the one the issue specifies, with metadata keys beside it::

    {"dp_size": N, "num_microbatches": M, "caps": {"tiles": Q_v, "tokens": Q_t},
     "steps": [ [ [ [i, ...] per micro-batch ] per rank ] per step ], ...metadata}

where ``i`` is the row index of the sample in the stats file.

Multi-level (HBP) schedules add ``"levels": [l, ...]`` (the packing level of each step) and
``"level_sp": [d, ...]`` (the sequence-parallel degree of each level); both are absent for a single-level
schedule, so older files load unchanged. In a step of a level with SP degree ``d`` the ranks ``r`` with the
same ``r // d`` form one SP group and hold identical micro-batch lists (the same packs, split along the
sequence at run time); exactly-once is counted over distinct SP groups, i.e. over the group leaders
``r % d == 0`` (:meth:`Schedule.leader_mask`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from omnibal.cost.table import NUM_FEATURES, microbatch_features, pack_features
from omnibal.errors import InputError
from omnibal.layout import Padding

FORMAT = "omnibal.schedule/1"
PADDINGS = tuple(Padding)


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
    caps: Caps
    """The per-micro-batch buffer the packs respect (packs of ``own_pack`` oversize samples excepted)."""
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

    def __post_init__(self) -> None:
        samples = np.ascontiguousarray(self.pack_samples, dtype=np.int64)
        offsets = np.ascontiguousarray(self.pack_offsets, dtype=np.int64)
        ids = np.ascontiguousarray(self.pack_ids, dtype=np.int64)
        dropped = np.ascontiguousarray(self.dropped, dtype=np.int64)
        assert offsets.ndim == 1 and offsets[0] == 0 and offsets[-1] == len(samples), "bad CSR offsets"
        assert np.all(np.diff(offsets) >= 0), "offsets must not decrease"
        assert ids.ndim == 3 and ids.shape[1:] == (self.dp_size, self.num_microbatches), ids.shape
        assert self.padding in PADDINGS, self.padding
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

    # -- sequence-parallel levels ---------------------------------------------------------------------
    def step_sp(self) -> np.ndarray:
        """SP degree of every step (``[num_steps]``; 1 for a single-level schedule)."""
        if self.levels is None:
            return np.ones(self.num_steps, np.int64)
        return np.asarray(self.level_sp, np.int64)[np.asarray(self.levels, np.int64)] if self.num_steps else (
            np.ones(0, np.int64))

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
            per_pack = _csr_features(tiles, tokens, self.pack_offsets)
        elif padding == "pad_to_longest":
            per_pack = _csr_features(tiles, tokens, self.pack_offsets)
            sizes = self.pack_sizes().astype(np.float64)
            t_max = _segment_max(tokens, self.pack_offsets)
            per_pack[:, 2] = sizes * t_max
            per_pack[:, 3] = sizes * t_max * t_max
        elif padding == "fixed_buffer":
            per_pack = _csr_features(tiles, tokens, self.pack_offsets)
            pad = np.clip(self.caps.tokens - per_pack[:, 2], 0, None)
            # Padding fills the token buffer as one extra masked segment; the ViT runs on Q_v tiles.
            per_pack[:, 1] = np.maximum(per_pack[:, 1], self.caps.tiles)
            per_pack[:, 2] = per_pack[:, 2] + pad
            per_pack[:, 3] = per_pack[:, 3] + pad * pad
        else:
            raise InputError(f"unknown padding {padding!r}; choose one of {PADDINGS}", field="padding")
        if self.num_packs == 0:
            per_pack = np.zeros((0, NUM_FEATURES))
        return per_pack[self.pack_ids]

    def _check_stats(self, stats) -> None:
        if len(stats) != self.num_samples:
            raise InputError(f"schedule was built for {self.num_samples} samples, stats have {len(stats)}",
                             source=getattr(stats, "source", None), field="num_samples")
        if self.stats_fingerprint and stats.fingerprint() != self.stats_fingerprint:
            raise InputError("stats fingerprint does not match the schedule's (different or changed stats)",
                             source=getattr(stats, "source", None), field="fingerprint")

    # -- JSON ---------------------------------------------------------------------------------------
    def steps_nested(self) -> list:
        """``steps[step][rank][micro] = [row, ...]`` as plain lists (the stable JSON form)."""
        packs = np.split(self.pack_samples, self.pack_offsets[1:-1]) if self.num_packs else []
        pack_lists = [p.tolist() for p in packs]
        return [[[pack_lists[k] for k in rank] for rank in step] for step in self.pack_ids.tolist()]

    def to_dict(self) -> dict:
        levels = {} if self.levels is None else {"levels": list(self.levels), "level_sp": list(self.level_sp)}
        return {
            "dp_size": int(self.dp_size),
            "num_microbatches": int(self.num_microbatches),
            "caps": self.caps.to_dict(),
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
        """The JSON form back; every field is checked (an InputError names the file, record and field)."""
        if not isinstance(d, dict):
            raise InputError("a schedule is a JSON object", source=source)
        for key in ("dp_size", "num_microbatches", "caps", "steps"):
            if key not in d:
                raise InputError(f"missing key {key!r}", source=source, field=key)
        check_keys(d, source)
        dp, m = _int_field(d, "dp_size", 1, source), _int_field(d, "num_microbatches", 1, source)
        caps = d["caps"]
        if not isinstance(caps, dict):
            raise InputError("must be {\"tiles\": int, \"tokens\": int}", source=source, field="caps")
        tiles, tokens = _int_field(caps, "tiles", 1, source, "caps."), _int_field(caps, "tokens", 1, source, "caps.")
        samples, offsets = _read_steps(d["steps"], dp, m, source)
        arr = np.asarray(samples, dtype=np.int64)
        dropped = d.get("dropped", [])
        if not isinstance(dropped, list) or not all(_is_int(i) and 0 <= i < 2**62 for i in dropped):
            raise InputError("must be a list of rows (integers >= 0)", source=source, field="dropped")
        num_samples = _int_field(d, "num_samples", 1, source) if "num_samples" in d else (
            max(([int(arr.max())] if len(arr) else []) + dropped, default=-1) + 1)
        if (len(arr) and arr.max() >= num_samples) or (dropped and max(dropped) >= num_samples):
            raise InputError(f"sample index out of range [0, {num_samples})", source=source, field="steps")
        padding = d.get("padding", "varlen")
        if padding not in PADDINGS:
            raise InputError(f"must be one of {PADDINGS}", source=source, field="padding")
        for key, kind in (("method", str), ("stats_fingerprint", str), ("meta", dict)):
            if key in d and not isinstance(d[key], kind):
                raise InputError(f"must be a {kind.__name__}", source=source, field=key)
        num_steps = len(d["steps"])
        levels, level_sp = _read_levels(d, num_steps, dp, source)
        pack_ids = np.arange(num_steps * dp * m, dtype=np.int64).reshape(num_steps, dp, m)
        if levels is not None:
            pack_ids = _share_sp_packs(pack_ids, levels, level_sp, d["steps"], source)
        return cls(
            dp_size=dp, num_microbatches=m, caps=Caps(tiles=tiles, tokens=tokens), pack_samples=arr,
            pack_offsets=np.asarray(offsets, dtype=np.int64),
            pack_ids=pack_ids, num_samples=num_samples, padding=padding, method=d.get("method", "unknown"),
            seed=_int_field(d, "seed", 0, source) if "seed" in d else 0,
            epoch=_int_field(d, "epoch", 0, source) if "epoch" in d else 0,
            stats_fingerprint=d.get("stats_fingerprint", ""), dropped=np.asarray(dropped, dtype=np.int64),
            meta=d.get("meta", {}), levels=levels, level_sp=level_sp,
        )

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Schedule:
        source = "<json>"
        text = str(text_or_path)
        if isinstance(text_or_path, Path) or not text.lstrip().startswith("{"):
            source = str(text_or_path)
            try:
                text = Path(text_or_path).read_text(encoding="utf-8")
            except OSError as exc:
                raise InputError(f"cannot read schedule: {exc}", source=source) from exc
            except UnicodeDecodeError as exc:
                raise InputError(f"not UTF-8 text (byte {exc.start})", source=source) from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"not valid JSON: {exc.msg}", source=source, record=f"line {exc.lineno}") from exc
        except (ValueError, RecursionError) as exc:  # huge integers, deep nesting
            raise InputError(f"not valid JSON: {type(exc).__name__}", source=source) from None
        return cls.from_dict(d, source=source)

    def equals(self, other: Schedule) -> bool:
        """Same micro-batches in the same slots (packs compared by content, not by numbering)."""
        if (self.dp_size, self.num_microbatches, self.num_steps) != (other.dp_size, other.num_microbatches,
                                                                      other.num_steps):
            return False
        return (self.steps_nested() == other.steps_nested() and self.caps == other.caps
                and self.levels == other.levels and self.level_sp == other.level_sp)


KEYS = ("dp_size", "num_microbatches", "caps", "steps", "format", "num_samples", "padding", "method", "seed",
        "epoch", "stats_fingerprint", "dropped", "meta", "levels", "level_sp")
"""Every key of the JSON form (extras go under ``meta``)."""


def check_keys(d: dict, source: str) -> None:
    """Refuse a key the schedule format does not have (a misspelt ``dropped`` would otherwise be ignored)."""
    unknown = sorted(str(k) for k in d if k not in KEYS)
    if unknown:
        raise InputError(f"unknown key {unknown[0]!r} (a schedule has {', '.join(KEYS)}; extras go under 'meta')",
                         source=source, field=unknown[0])


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(d: dict, key: str, low: int, source: str, prefix: str = "") -> int:
    value = d.get(key)
    if not _is_int(value) or not low <= value < 2**62:
        raise InputError(f"must be an integer >= {low}, got {value!r:.40}", source=source, field=prefix + key)
    return value


def _read_levels(d: dict, num_steps: int, dp: int, source: str):
    """``levels``/``level_sp`` of the JSON form checked (both or neither), or ``(None, None)``."""
    if ("levels" in d) != ("level_sp" in d):
        missing = "level_sp" if "levels" in d else "levels"
        raise InputError("'levels' and 'level_sp' come together", source=source, field=missing)
    if "levels" not in d:
        return None, None
    level_sp, levels = d["level_sp"], d["levels"]
    if not isinstance(level_sp, list) or not level_sp or not all(
            _is_int(x) and 1 <= x <= dp and dp % x == 0 for x in level_sp):
        raise InputError(f"must be a non-empty list of SP degrees that divide dp_size {dp}", source=source,
                         field="level_sp")
    if not isinstance(levels, list) or len(levels) != num_steps or not all(
            _is_int(x) and 0 <= x < len(level_sp) for x in levels):
        raise InputError(f"must list one level in [0, {len(level_sp)}) per step ({num_steps} steps)",
                         source=source, field="levels")
    return tuple(levels), tuple(level_sp)


def _share_sp_packs(pack_ids: np.ndarray, levels, level_sp, steps: list, source: str) -> np.ndarray:
    """Point every rank of an SP group at its leader's packs; a rank whose lists differ is an InputError."""
    pack_ids = pack_ids.copy()
    for s, level in enumerate(levels):
        d = level_sp[level]
        for r in range(len(steps[s]) if d > 1 else 0):
            lead = (r // d) * d
            if r != lead:
                if steps[s][r] != steps[s][lead]:
                    raise InputError(f"rank {r} is in the SP group of rank {lead} (SP degree {d}) and must hold "
                                     "the same micro-batches", source=source, record=f"step {s} rank {r}",
                                     field="steps")
                pack_ids[s, r] = pack_ids[s, lead]
    return pack_ids


def _read_steps(steps, dp: int, m: int, source: str) -> tuple[list[int], list[int]]:
    """Flat sample rows and CSR offsets of ``steps[step][rank][micro] = [row, ...]``."""
    if not isinstance(steps, list):
        raise InputError("must be a list of steps", source=source, field="steps")
    samples: list[int] = []
    offsets = [0]
    for s, step in enumerate(steps):
        if not isinstance(step, list) or len(step) != dp or any(not isinstance(r, list) or len(r) != m for r in step):
            raise InputError(f"step must have {dp} ranks x {m} micro-batches", source=source,
                             record=f"step {s}", field="steps")
        for r, rank in enumerate(step):
            for k, mb in enumerate(rank):
                if not isinstance(mb, list) or not all(_is_int(i) and 0 <= i < 2**62 for i in mb):
                    raise InputError("a micro-batch is a list of sample rows (integers >= 0)", source=source,
                                     record=f"step {s} rank {r} micro-batch {k}", field="steps")
                samples.extend(mb)
                offsets.append(len(samples))
    return samples, offsets


def _csr_features(tiles: np.ndarray, tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Varlen features of CSR packs; like ``cost.table.pack_features`` but safe for empty packs anywhere
    (``np.add.reduceat`` rejects an empty pack at the end)."""
    sizes = np.diff(offsets)
    if len(tiles) == 0 or not (sizes == 0).any():
        return pack_features(tiles, tokens, offsets)
    label = np.repeat(np.arange(len(sizes)), sizes)
    num = len(sizes)
    return microbatch_features(np.bincount(label, tiles, num), np.bincount(label, tokens, num),
                               np.bincount(label, tokens * tokens, num))


def _segment_max(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Max of each CSR segment (0 for empty ones)."""
    out = np.zeros(len(offsets) - 1)
    sizes = np.diff(offsets)
    nonempty = sizes > 0
    if len(values):
        out[nonempty] = np.maximum.reduceat(values, offsets[:-1][nonempty])
    return out


def build_schedule(*, pack_of: np.ndarray, num_packs: int, pack_ids: np.ndarray, **kwargs) -> Schedule:
    """CSR packs from a per-sample pack label (``-1`` = not in any pack) with a stable in-pack order."""
    pack_of = np.asarray(pack_of, dtype=np.int64)
    rows = np.flatnonzero(pack_of >= 0)
    order = rows[np.argsort(pack_of[rows], kind="stable")]
    counts = np.bincount(pack_of[rows], minlength=num_packs)
    offsets = np.zeros(num_packs + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Schedule(pack_samples=order, pack_offsets=offsets, pack_ids=pack_ids, **kwargs)


__all__ = ["Caps", "Schedule", "FORMAT", "PADDINGS", "build_schedule", "microbatch_features"]
