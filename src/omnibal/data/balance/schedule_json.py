"""The schedule JSON form read back: the one reader of the format, behind :meth:`Schedule.from_dict
<omnibal.data.balance.schedule.Schedule.from_dict>` (the balancer's files, ``omnibal balance --out``, and
hand-made ones the trainer takes with ``--schedule-file``).

A hand-made file may be the plain single-level form: ``dp_size``, ``num_microbatches`` and ``steps`` as nested
lists of sample rows, without ``caps`` (absent or null; the trainer then sizes a pipeline's buffer from the
micro-batches themselves). A multi-level file has caps: its levels were packed to them. Every field is
checked, and an InputError names the file, the record (step, rank, micro-batch) and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from omnibal.errors import InputError
from omnibal.layout import Padding
from omnibal.validate import is_int


def read_json(text_or_path: str | Path) -> tuple[Any, str]:
    """``(document, source)`` of a schedule's JSON text, or of the file at a path (a ``Path``, or a string
    that is not an object's text); any failure to read or parse it is an InputError naming the file."""
    source, text = "<json>", str(text_or_path)
    if isinstance(text_or_path, Path) or not text.lstrip().startswith("{"):
        source = str(text_or_path)
        try:
            text = Path(text_or_path).read_bytes().decode("utf-8")
        except OSError as exc:
            raise InputError(f"cannot read schedule: {exc.strerror or exc}", source=source) from None
        except UnicodeDecodeError as exc:
            raise InputError(f"not UTF-8 text (byte {exc.start})", source=source) from None
    try:
        return json.loads(text), source
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON: {exc.msg}", source=source, record=f"line {exc.lineno}") from None
    except (ValueError, RecursionError) as exc:  # huge integers, deep nesting
        raise InputError(f"not valid JSON: {type(exc).__name__}: {str(exc)[:120]}", source=source) from None


def schedule_fields(d: Any, source: str) -> dict:
    """The keyword fields of a :class:`Schedule <omnibal.data.balance.schedule.Schedule>` read from its JSON
    form ``d``, every one checked; ``caps`` is ``(tiles, tokens)``, or None for a single-level schedule
    without caps."""
    if not isinstance(d, dict):
        raise InputError("a schedule is a JSON object", source=source)
    for key in ("dp_size", "num_microbatches", "steps"):
        if key not in d:
            raise InputError(f"missing key {key!r}", source=source, field=key)
    check_keys(d, source)
    dp, m = _int_field(d, "dp_size", 1, source), _int_field(d, "num_microbatches", 1, source)
    if not isinstance(d["steps"], list):
        raise InputError("must be a list of steps", source=source, field="steps")
    num_steps = len(d["steps"])
    levels, level_sp = _read_levels(d, num_steps, dp, source)
    caps = _read_caps(d, levels, source)
    level_mbs = _read_level_microbatches(d, levels, level_sp, m, source)
    step_mbs = [m] * num_steps if level_mbs is None else [level_mbs[lv] for lv in levels]
    samples, offsets = _read_steps(d["steps"], dp, step_mbs, source)
    arr = np.asarray(samples, dtype=np.int64)
    dropped = d.get("dropped", [])
    if not isinstance(dropped, list) or not all(is_int(i) and 0 <= i < 2**62 for i in dropped):
        raise InputError("must be a list of rows (integers >= 0)", source=source, field="dropped")
    num_samples = _int_field(d, "num_samples", 1, source) if "num_samples" in d else (
        max(([int(arr.max())] if len(arr) else []) + dropped, default=-1) + 1)
    if (len(arr) and arr.max() >= num_samples) or (dropped and max(dropped) >= num_samples):
        raise InputError(f"sample index out of range [0, {num_samples})", source=source, field="steps")
    padding = d.get("padding", "varlen")
    if padding not in tuple(Padding):
        raise InputError(f"must be one of {', '.join(Padding)}", source=source, field="padding")
    for key, kind in (("method", str), ("stats_fingerprint", str), ("meta", dict)):
        if key in d and not isinstance(d[key], kind):
            raise InputError(f"must be a {kind.__name__}", source=source, field=key)
    pack_ids = _slot_pack_ids(step_mbs, dp, m, offsets)
    if levels is not None:
        pack_ids = _share_sp_packs(pack_ids, levels, level_sp, d["steps"], source)
    return dict(
        dp_size=dp, num_microbatches=m, caps=caps, pack_samples=arr, pack_offsets=np.asarray(offsets, dtype=np.int64),
        pack_ids=pack_ids, num_samples=num_samples, padding=padding, method=d.get("method", "unknown"),
        seed=_int_field(d, "seed", 0, source) if "seed" in d else 0,
        epoch=_int_field(d, "epoch", 0, source) if "epoch" in d else 0,
        stats_fingerprint=d.get("stats_fingerprint", ""), dropped=np.asarray(dropped, dtype=np.int64),
        meta=d.get("meta", {}), levels=levels, level_sp=level_sp, level_microbatches=level_mbs)


def _read_caps(d: dict, levels, source: str) -> tuple[int, int] | None:
    """``(tiles, tokens)`` of ``caps``; None when a single-level file has none (absent or null)."""
    caps = d.get("caps")
    if caps is None and levels is None:
        return None
    shape = "{\"tiles\": int, \"tokens\": int}"
    if caps is None:
        said = "missing key 'caps'" if "caps" not in d else f"must be {shape}, not null"
        raise InputError(f"{said}: a multi-level schedule was packed to caps", source=source, field="caps")
    if not isinstance(caps, dict):
        raise InputError(f"must be {shape}", source=source, field="caps")
    return _int_field(caps, "tiles", 1, source, "caps."), _int_field(caps, "tokens", 1, source, "caps.")


KEYS = ("dp_size", "num_microbatches", "caps", "steps", "format", "num_samples", "padding", "method", "seed",
        "epoch", "stats_fingerprint", "dropped", "meta", "levels", "level_sp", "level_microbatches")
"""Every key of the JSON form (extras go under ``meta``)."""


def check_keys(d: dict, source: str) -> None:
    """Refuse a key the schedule format does not have (a misspelt ``dropped`` would otherwise be ignored)."""
    unknown = sorted(str(k) for k in d if k not in KEYS)
    if unknown:
        raise InputError(f"unknown key {unknown[0]!r} (a schedule has {', '.join(KEYS)}; extras go under 'meta')",
                         source=source, field=unknown[0])


def _int_field(d: dict, key: str, low: int, source: str, prefix: str = "") -> int:
    value = d.get(key)
    if not is_int(value) or not low <= value < 2**62:
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
            is_int(x) and 1 <= x <= dp and dp % x == 0 for x in level_sp):
        raise InputError(f"must be a non-empty list of SP degrees that divide dp_size {dp}", source=source,
                         field="level_sp")
    if not isinstance(levels, list) or len(levels) != num_steps or not all(
            is_int(x) and 0 <= x < len(level_sp) for x in levels):
        raise InputError(f"must list one level in [0, {len(level_sp)}) per step ({num_steps} steps)",
                         source=source, field="levels")
    return tuple(levels), tuple(level_sp)


def _read_level_microbatches(d: dict, levels, level_sp, m: int, source: str):
    """``level_microbatches`` of the JSON form checked (one count per level, the largest ``num_microbatches``),
    or None."""
    if "level_microbatches" not in d:
        return None
    counts = d["level_microbatches"]
    if levels is None:
        raise InputError("'level_microbatches' needs 'levels' and 'level_sp'", source=source, field="levels")
    if not isinstance(counts, list) or len(counts) != len(level_sp) or not all(
            is_int(x) and 1 <= x <= m for x in counts) or max(counts) != m:
        raise InputError(f"must list one micro-batch count in [1, {m}] per level ({len(level_sp)} levels), the "
                         f"largest equal to num_microbatches {m}", source=source, field="level_microbatches")
    return tuple(counts)


def _slot_pack_ids(step_mbs: list[int], dp: int, m: int, offsets: list[int]) -> np.ndarray:
    """``[num_steps, dp, m]`` pack ids of packs read step by step (``step_mbs[s]`` per rank); the slots a step
    does not run point at one empty pack appended to ``offsets``."""
    counts = np.asarray(step_mbs, np.int64)
    ids = np.full((len(counts), dp, m), -1, np.int64)
    used = np.broadcast_to((np.arange(m)[None, :] < counts[:, None])[:, None, :], ids.shape)
    ids[used] = np.arange(int(used.sum()), dtype=np.int64)
    if (ids < 0).any():
        offsets.append(offsets[-1])
        ids[ids < 0] = len(offsets) - 2
    return ids


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


def _read_steps(steps, dp: int, step_mbs: list[int], source: str) -> tuple[list[int], list[int]]:
    """Flat sample rows and CSR offsets of ``steps[step][rank][micro] = [row, ...]`` (``step_mbs[s]``
    micro-batches per rank in step ``s``). A micro-batch may be empty here (the balancer's baselines leave the
    last step's unfilled ones so); the trainer refuses an empty one it would run, naming its slot."""
    samples: list[int] = []
    offsets = [0]
    for s, step in enumerate(steps):
        m = step_mbs[s]
        if not isinstance(step, list) or len(step) != dp:
            raise InputError(f"needs {dp} ranks", source=source, record=f"step {s}", field="steps")
        for r, rank in enumerate(step):
            if not isinstance(rank, list) or len(rank) != m:
                raise InputError(f"needs {m} micro-batches", source=source, record=f"step {s} rank {r}",
                                 field="steps")
            for k, mb in enumerate(rank):
                if not isinstance(mb, list) or not all(is_int(i) and 0 <= i < 2**62 for i in mb):
                    raise InputError("a micro-batch is a list of sample rows (integers >= 0)", source=source,
                                     record=f"step {s} rank {r} micro-batch {k}", field="steps")
                samples.extend(mb)
                offsets.append(len(samples))
    return samples, offsets
