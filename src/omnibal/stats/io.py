"""Read and write `SampleStats` files.

Formats (``format=`` names; auto-detected from the extension, and for ``.json`` from the first record):

``jsonl``          one record per line: ``{"key": int|str, "tiles": int, "tokens": int, "images": int}``.
``json``           a JSON list of the same records.
``parquet``        columns ``tiles``, ``tokens``, ``images`` (integers) and ``key`` (uint64).
``token-lengths``  the public OmniBal token-length format: a JSON list of
                   ``{"vit_num": int, "token_num": int, "image_flags": int}`` with no sample ids.

Image convention (:class:`~omnibal.stats.table.ImageConvention`, InternVL tiles or LLaVA single image): a
JSONL file carries it in a first header line ``{"omnibal_stats": {"convention": "llava/576"}}``, a parquet
file in its schema metadata (``omnibal.convention``). Files without it (written before it existed, JSON
lists, the public token-length files) load with ``convention=None``, which the prediction path reads as
InternVL-1.5's (and says so); ``save_stats`` refuses to write a non-default convention into a format that
cannot record it.

``key`` is optional: a string id is turned into a stable 64-bit key with :func:`hash_key`; a record
without one gets ``index_keys(<file name>, n)[i]`` (its index in the file), so keys survive skipping.

The token-length format stores ``image_flags``, which in the published files always equals ``vit_num``: it
counts the tiles flagged as coming from a real image (InternVL's per-tile ``image_flags``), not images. A
text-only sample that carries a dummy tile has ``image_flags`` 0. So on reading, ``images = 1 if
image_flags > 0 else 0`` (one image per sample: the published subsets are single-image), and on writing,
``image_flags = tiles if images > 0 else 0``; the published files round-trip exactly.

Bad input raises :class:`~omnibal.errors.InputError` naming the file, the record (``line N`` for JSONL and
JSON syntax errors, ``index N`` for list entries and parquet rows) and the field. With ``on_error="skip"``
bad records are dropped, counted and reported in a :class:`LoadReport` (and by a warning from
:func:`load_stats`); a file with no valid record is always an error.

Speed: JSONL goes through pyarrow's multithreaded JSON reader when the file is well formed (a strict
fast path whose result is checked: one row per line); anything it refuses is re-read line by line by the
reference parser, which finds the exact bad spot. JSON lists are loaded whole with :mod:`json`. The JSON/JSONL
parsing lives in :mod:`omnibal.stats.json_records`; range checks, parquet and writing are here.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from omnibal.errors import InputError
from omnibal.layout import OnError
from omnibal.outputs import atomic_path, check_file, write_text
from omnibal.stats.json_records import (
    OMNIBAL,
    TOKEN_LENGTHS,
    Columns,
    decode_utf8,
    is_utf8,
    json_records,
    jsonl_fast,
    jsonl_records,
)
from omnibal.stats.table import (
    INTERNVL_CONVENTION,
    MAX_IMAGES,
    MAX_TILES,
    MAX_TOKENS,
    ImageConvention,
    SampleStats,
    index_keys,
)

FORMATS = ("jsonl", "json", "parquet", "token-lengths")
ON_ERROR = tuple(OnError)

_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}
# Kept in the report; the count covers all of them.
MAX_REPORTED_ERRORS = 20


@dataclass(frozen=True, kw_only=True)
class LoadReport:
    """What a load read and what it skipped (``on_error="skip"``)."""

    source: str
    """The file read."""
    format: str
    """The format it was read as."""
    num_records: int
    """Records found in the file (valid or not)."""
    num_loaded: int
    """Records that made it into the table."""
    num_skipped: int
    """Records dropped as invalid."""
    errors: tuple[InputError, ...] = field(default=())
    """The first :data:`MAX_REPORTED_ERRORS` reasons, in file order."""

    def summary(self) -> str:
        head = f"{self.source}: loaded {self.num_loaded} of {self.num_records} records ({self.format})"
        if not self.num_skipped:
            return head
        lines = [f"{head}; skipped {self.num_skipped} invalid record(s):"]
        lines += [f"  {e}" for e in self.errors]
        if self.num_skipped > len(self.errors):
            lines.append(f"  ... and {self.num_skipped - len(self.errors)} more")
        return "\n".join(lines)


HEADER_KEY = "omnibal_stats"
"""Key of a JSONL file's header line (its only key): ``{"omnibal_stats": {"convention": ...}}``."""
PARQUET_CONVENTION = b"omnibal.convention"


_LIMITS = {"tiles": (0, MAX_TILES), "tokens": (1, MAX_TOKENS), "images": (0, MAX_IMAGES)}


# ------------------------------------------------------------------------------------------------ API
def detect_format(path: str | os.PathLike) -> str:
    """The format of ``path`` from its extension; ``.json`` files are told apart by their first record."""
    p = Path(path)
    fmt = _EXTENSIONS.get(p.suffix.lower())
    if fmt is None:
        raise InputError(
            f"cannot tell the format from the extension {p.suffix!r}; pass format= one of {FORMATS}",
            source=str(p),
        )
    if fmt == "json" and p.is_file():
        with open(p, "rb") as f:
            head = f.read(4096)
        m = re.match(rb'\s*\[\s*\{\s*"([^"\\]*)"', head)
        if m and m.group(1).decode("utf-8", "replace") in TOKEN_LENGTHS.fields:
            return "token-lengths"
    return fmt


def load_stats(path: str | os.PathLike, *, format: str | None = None, on_error: str = "raise") -> SampleStats:
    """Read a stats file. ``on_error="skip"`` drops invalid records and warns how many (see :func:`read_stats`)."""
    stats, report = read_stats(path, format=format, on_error=on_error)
    if report.num_skipped:
        warnings.warn(report.summary(), SkippedRecordsWarning, stacklevel=2)
    return stats


def read_stats(
    path: str | os.PathLike, *, format: str | None = None, on_error: str = "raise"
) -> tuple[SampleStats, LoadReport]:
    """Read a stats file and say what was read and skipped."""
    source = str(path)
    if on_error not in ON_ERROR:
        raise InputError(f"must be one of {ON_ERROR}, got {on_error!r}", source="on_error")
    fmt = format or detect_format(path)
    if fmt not in FORMATS:
        raise InputError(f"unknown format {fmt!r}; one of {FORMATS}", source="format")
    if not Path(path).is_file():
        raise InputError("no such file", source=source)
    convention = None
    if fmt == "parquet":
        cols, convention = _read_parquet(source)
    else:
        data = Path(path).read_bytes()
        if not data.strip():
            raise InputError("empty file: no records", source=source)
        if fmt == "jsonl":
            convention, data, body = _jsonl_header(data, source)
            fast = is_utf8(body) and jsonl_fast(body, source)
            if fast and len(body) != len(data):  # the header line is not a record: record i is on line i + 2
                fast.locate = lambda i: f"line {i + 2}"
            cols = fast or jsonl_records(data, source, on_error)
        else:
            schema = TOKEN_LENGTHS if fmt == "token-lengths" else OMNIBAL
            cols = json_records(decode_utf8(data, source), source, schema, on_error)
    stats, report = _finish(cols, source, fmt, on_error)
    if convention is not None:
        stats = SampleStats(tiles=stats.tiles, tokens=stats.tokens, images=stats.images, keys=stats.keys,
                            source=stats.source, convention=convention)
    return stats, report


def _jsonl_header(data: bytes, source: str) -> tuple[ImageConvention | None, bytes, bytes]:
    """``(convention, data, body)``: a header line's convention; ``data`` with that line blanked (line
    numbers stay exact for the line-by-line reader); ``body`` without it (for the fast reader)."""
    if not data.lstrip().startswith(b'{"' + HEADER_KEY.encode()):
        return None, data, data
    end = data.find(b"\n")
    end = len(data) if end < 0 else end
    try:
        header = json.loads(data[:end].decode("utf-8"))[HEADER_KEY]
        convention = ImageConvention.parse(header["convention"], source=source)
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"bad header line: {exc}", source=source, record="line 1", field=HEADER_KEY) from None
    return convention, b" " * end + data[end:], data[end + 1:]


def output_format(path: str | os.PathLike, format: str | None = None) -> str:
    """The stats format ``save_stats`` writes ``path`` in (``format``, else by the extension)."""
    p = Path(path)
    fmt = format or _EXTENSIONS.get(p.suffix.lower())
    if fmt not in FORMATS:
        raise InputError(f"cannot tell the format of {p.name!r}; pass format= one of {FORMATS}", source=str(p))
    return fmt


def save_stats(stats: SampleStats, path: str | os.PathLike, *, format: str | None = None) -> Path:
    """Write ``stats`` (atomically: a temporary file renamed into place). Returns the path written."""
    p = Path(path)
    fmt = output_format(p, format)
    if fmt in ("json", "token-lengths") and stats.convention not in (None, INTERNVL_CONVENTION):
        raise InputError(f"the {fmt} format cannot record the statistics' image convention ({stats.convention}); "
                         "write .jsonl or .parquet", source=str(p), field="convention")

    check_file(p, "out")
    if fmt == "parquet":  # a killed writer leaves the old file; the new one gets the umask's mode
        with atomic_path(p) as tmp:
            _write_parquet(stats, str(tmp))
    else:
        write_text(p, _render_json(stats, fmt))
    return p


class SkippedRecordsWarning(UserWarning):
    """Invalid records were skipped (``on_error="skip"``); the message says how many and why."""


# ------------------------------------------------------------------------------------------ writing
def _render_json(stats: SampleStats, fmt: str) -> str:
    tiles, tokens, images = stats.tiles.tolist(), stats.tokens.tolist(), stats.images.tolist()
    if fmt == "token-lengths":
        rows = [
            f'{{"vit_num": {t}, "token_num": {n}, "image_flags": {t if i > 0 else 0}}}'
            for t, n, i in zip(tiles, tokens, images)
        ]
    else:
        rows = [
            f'{{"key": {k}, "tiles": {t}, "tokens": {n}, "images": {i}}}'
            for k, t, n, i in zip(stats.keys.tolist(), tiles, tokens, images)
        ]
    if fmt == "jsonl":
        header = ""
        if stats.convention is not None:
            header = json.dumps({HEADER_KEY: {"convention": str(stats.convention)}}) + "\n"
        return header + "\n".join(rows) + "\n"
    return "[\n" + ",\n".join(rows) + "\n]\n"


def _write_parquet(stats: SampleStats, path: str) -> None:
    # heavy (~0.5 s): only parquet / fast JSON reading needs it
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "key": pa.array(stats.keys, type=pa.uint64()),
            "tiles": pa.array(stats.tiles, type=pa.int32()),
            "tokens": pa.array(stats.tokens, type=pa.int32()),
            "images": pa.array(stats.images, type=pa.int32()),
        }
    )
    if stats.convention is not None:
        table = table.replace_schema_metadata({PARQUET_CONVENTION: str(stats.convention).encode()})
    pq.write_table(table, path)


# ------------------------------------------------------------------------------------------ reading
def _read_parquet(source: str) -> tuple[Columns, ImageConvention | None]:
    # heavy (~0.5 s): only parquet / fast JSON reading needs it
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(source)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"not a readable parquet file: {exc}", source=source) from None
    if table.num_rows == 0:
        raise InputError("no records (0 rows)", source=source)
    try:
        column_names = table.column_names
    except UnicodeDecodeError as exc:  # a corrupted schema: pyarrow decodes the names only when asked
        raise InputError(f"not a readable parquet file: a column name is not UTF-8 ({exc})", source=source) from None
    cols = {}
    for name in ("tiles", "tokens", "images", "key"):
        if name not in column_names:
            if name == "key":
                continue
            raise InputError(f"missing column (has {column_names})", source=source, field=name)
        col = table.column(name)
        if not (pa.types.is_integer(col.type)):
            raise InputError(f"column must be integers, got {col.type}", source=source, field=name)
        if col.null_count:
            i = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise InputError("null value", source=source, record=i, field=name)
        arr = col.to_numpy()
        if name == "key":
            if arr.dtype.kind == "i" and (arr < 0).any():
                i = int(np.flatnonzero(arr < 0)[0])
                raise InputError(f"key must be >= 0, got {arr[i]}", source=source, record=i, field=name)
            cols["keys"] = arr.astype(np.uint64)
        else:
            if arr.dtype == np.uint64 and (arr > np.uint64(1 << 62)).any():
                i = int(np.flatnonzero(arr > np.uint64(1 << 62))[0])
                raise InputError(f"absurd value {arr[i]}", source=source, record=i, field=name)
            cols[name] = arr.astype(np.int64)
    if "keys" not in cols:
        cols["keys"] = index_keys(Path(source).name, table.num_rows)
    meta = (table.schema.metadata or {}).get(PARQUET_CONVENTION)
    convention = None if meta is None else ImageConvention.parse(meta.decode("utf-8", "replace"), source=source)
    return Columns(schema=OMNIBAL, num_records=table.num_rows, locate=lambda i: i, errors={}, **cols), convention


# ------------------------------------------------------------------------------------------ checking
def _value_errors(cols: Columns, source: str) -> np.ndarray:
    """Vectorised range and consistency checks; records the first reason per bad row in ``cols.errors``."""
    s = cols.schema
    n = cols.num_records
    bad = np.zeros(n, dtype=bool)
    if cols.errors:
        bad[list(cols.errors)] = True
    images_limit = (0, MAX_TILES) if s.images_from_flags else _LIMITS["images"]
    checks = [
        (cols.tiles, s.tiles, *_LIMITS["tiles"]),
        (cols.tokens, s.tokens, *_LIMITS["tokens"]),
        (cols.images, s.images, *images_limit),
    ]
    for values, name, lo, hi in checks:
        rows = (values < lo) | (values > hi)
        _note(cols, rows & ~bad,
              lambda i, v=values, nm=name, lo=lo, hi=hi: (f"must be in [{lo}, {hi}], got {v[i]}", nm))
        bad |= rows
    over = cols.images > cols.tiles
    what = "image tiles" if s.images_from_flags else "images"
    _note(cols, over & ~bad, lambda i: (
        f"{what} {cols.images[i]} > {s.tiles} {cols.tiles[i]} (every image has at least one tile)", s.images))
    bad |= over
    return bad


def _note(cols: Columns, rows: np.ndarray, reason) -> None:
    idx = np.flatnonzero(rows)
    # only the earliest rows need a message: raise reports the first, skip reports the first few
    for i in idx[: MAX_REPORTED_ERRORS + 1].tolist():
        msg, name = reason(i)
        cols.errors.setdefault(i, InputError(msg, source=cols.source_name, record=cols.locate(i), field=name))


def _finish(cols: Columns, source: str, fmt: str, on_error: str) -> tuple[SampleStats, LoadReport]:
    cols.source_name = source
    bad = _value_errors(cols, source)
    num_bad = int(bad.sum())
    if num_bad and on_error == "raise":
        raise cols.errors[min(cols.errors)]
    keep = ~bad
    if num_bad == cols.num_records:
        first = cols.errors[min(cols.errors)]
        raise InputError(f"no valid records ({num_bad} skipped; first: {first})", source=source)
    images = cols.images[keep]
    if cols.schema.images_from_flags:
        images = (images > 0).astype(np.int64)
    stats = SampleStats(
        tiles=cols.tiles[keep], tokens=cols.tokens[keep], images=images, keys=cols.keys[keep], source=source
    )
    errors = tuple(cols.errors[i] for i in sorted(cols.errors)[:MAX_REPORTED_ERRORS])
    report = LoadReport(source=source, format=fmt, num_records=cols.num_records, num_loaded=len(stats),
                        num_skipped=num_bad, errors=errors)  # fmt: skip
    return stats, report
