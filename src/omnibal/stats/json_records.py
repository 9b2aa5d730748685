"""JSON and JSONL record parsing for :mod:`omnibal.stats.io`: bytes in, :class:`Columns` out.

The format's field names (:class:`Schema`), the pyarrow fast path for clean JSONL files, the reference
line-by-line JSONL reader (exact line numbers for every error), the JSON-list reader and the per-record
type checks. Range checks and the final table are :mod:`omnibal.stats.io`'s (shared with parquet).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from omnibal.errors import InputError
from omnibal.stats.table import hash_key, index_keys

_UINT64_MAX = (1 << 64) - 1


class Schema:
    """Field names of a format; ``images_from_flags`` marks the token-length format."""

    def __init__(self, tiles: str, tokens: str, images: str, *, images_from_flags: bool) -> None:
        self.tiles, self.tokens, self.images = tiles, tokens, images
        self.images_from_flags = images_from_flags

    @property
    def fields(self) -> tuple[str, str, str]:
        return (self.tiles, self.tokens, self.images)


OMNIBAL = Schema("tiles", "tokens", "images", images_from_flags=False)
TOKEN_LENGTHS = Schema("vit_num", "token_num", "image_flags", images_from_flags=True)


class Columns:
    """Parsed records: int64 columns, keys, per-row locators, and rows already known bad."""

    def __init__(self, *, schema: Schema, num_records: int, tiles, tokens, images, keys, locate, errors) -> None:
        self.schema = schema
        self.num_records = num_records
        self.tiles, self.tokens, self.images, self.keys = tiles, tokens, images, keys
        self.locate = locate  # row -> "line N" / index
        self.errors: dict[int, InputError] = errors  # row -> first error (structure / type)


def decode_utf8(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(f"not UTF-8 text (byte {exc.start})", source=source, record=f"line {line}") from None


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _json_error(exc: Exception, source: str, line_offset: int = 0) -> InputError:
    if isinstance(exc, json.JSONDecodeError):
        return InputError(
            f"malformed JSON: {exc.msg} (column {exc.colno})", source=source, record=f"line {exc.lineno + line_offset}"
        )
    if isinstance(exc, RecursionError):
        return InputError("malformed JSON: nested too deeply", source=source)
    return InputError(f"malformed JSON: {exc}", source=source)


def jsonl_fast(data: bytes, source: str) -> Columns | None:
    """pyarrow's JSON reader on a clean file; ``None`` sends the file to the line-by-line reader.

    Accepted only when every line is a non-blank record and pyarrow returns exactly one row per line (it
    would otherwise read two objects on one line as two rows), all four fields are present and integer.
    """
    # heavy (~0.5 s): only parquet / fast JSON reading needs it
    import pyarrow as pa
    import pyarrow.json as pj

    raw = np.frombuffer(data, dtype=np.uint8)
    starts = np.flatnonzero(raw == ord("\n")) + 1
    starts = np.concatenate([[0], starts[starts < len(raw)]])
    num_lines = len(starts)
    # every line must open a record at its first byte: no blank lines (line numbers stay exact) and, with
    # the row count checked below, no line that pyarrow could split into two rows
    if num_lines < 1000 or not (raw[starts] == ord("{")).all():
        return None
    schema = pa.schema([("key", pa.uint64()), ("tiles", pa.int64()), ("tokens", pa.int64()), ("images", pa.int64())])
    opts = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    try:
        table = pj.read_json(pa.BufferReader(data), parse_options=opts)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
        return None
    if table.num_rows != num_lines:
        return None
    cols = {}
    for name in ("tiles", "tokens", "images"):
        col = table.column(name)
        if col.null_count:
            return None
        cols[name] = col.to_numpy().astype(np.int64, copy=False)
    key_col = table.column("key")
    if key_col.null_count == 0:
        keys = key_col.to_numpy()
    elif key_col.null_count == table.num_rows:
        keys = index_keys(Path(source).name, table.num_rows)
    else:
        return None
    return Columns(
        schema=OMNIBAL, num_records=table.num_rows, keys=np.asarray(keys, dtype=np.uint64),
        locate=lambda i: f"line {i + 1}", errors={}, **cols,
    )  # fmt: skip


def jsonl_records(data: bytes, source: str, on_error: str) -> Columns:
    """The reference JSONL reader: one ``json.loads`` per non-blank line."""
    records, lines, errors = [], [], {}
    for lineno, raw_line in enumerate(data.split(b"\n"), start=1):
        if not raw_line.strip():
            continue
        try:
            records.append(json.loads(raw_line.decode("utf-8")))
        except UnicodeDecodeError as exc:
            err = InputError(f"not UTF-8 text (byte {exc.start} of the line)", source=source, record=f"line {lineno}")
        except (ValueError, RecursionError) as exc:
            err = _json_error(exc, source, lineno - 1)
        else:
            lines.append(lineno)
            continue
        if on_error == "raise":
            raise err from None
        errors[len(records)] = err
        records.append(None)
        lines.append(lineno)
    if not records:
        raise InputError("no records", source=source)
    return _columns_from_records(records, source, OMNIBAL, lambda i: f"line {lines[i]}", errors)


def json_records(text: str, source: str, schema: Schema, on_error: str) -> Columns:
    try:
        records = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _json_error(exc, source) from None  # a broken list has no records to skip to
    if not isinstance(records, list):
        raise InputError(f"expected a JSON list of records, got {type(records).__name__}", source=source)
    if not records:
        raise InputError("no records (empty list)", source=source)
    return _columns_from_records(records, source, schema, lambda i: i, {})


def _columns_from_records(records: list, source: str, schema: Schema, locate, errors: dict) -> Columns:
    n = len(records)
    fast = None if errors else _records_fast(records, schema)
    if fast is not None:
        tiles, tokens, images, raw_keys = fast
    else:
        tiles, tokens, images = (np.zeros(n, np.int64) for _ in range(3))
        raw_keys = [None] * n
        for i, rec in enumerate(records):
            if i in errors:
                continue
            try:
                tiles[i], tokens[i], images[i], raw_keys[i] = _record_values(rec, schema)
            except _FieldError as exc:
                errors[i] = InputError(exc.message, source=source, record=locate(i), field=exc.field)
    keys = _keys(raw_keys, source, n)
    return Columns(schema=schema, num_records=n, tiles=tiles, tokens=tokens, images=images, keys=keys,
                    locate=locate, errors=errors)  # fmt: skip


def _records_fast(records: list, schema: Schema):
    """Columns by whole-list passes when every record is a dict of plain ints; ``None`` otherwise."""
    if not all(type(r) is dict for r in records):
        return None
    out = []
    for name in schema.fields:
        try:
            vals = [r[name] for r in records]
        except KeyError:
            return None
        if set(map(type, vals)) != {int}:
            return None
        try:
            out.append(np.array(vals, dtype=np.int64))
        except OverflowError:
            return None
    if schema.images_from_flags:
        raw_keys = [None] * len(records)
    else:
        raw_keys = [r.get("key") for r in records]
        if not set(map(type, raw_keys)) <= {int, str, type(None)}:
            return None
        int_keys = [k for k in raw_keys if type(k) is int]
        if int_keys and not (min(int_keys) >= 0 and max(int_keys) <= _UINT64_MAX):
            return None
    return (*out, raw_keys)


class _FieldError(Exception):
    def __init__(self, message: str, field: str | None = None) -> None:
        self.message, self.field = message, field


def _record_values(rec, schema: Schema):
    if not isinstance(rec, dict):
        raise _FieldError(f"expected a JSON object, got {type(rec).__name__}")
    values = []
    for name in schema.fields:
        if name not in rec:
            raise _FieldError("missing", name)
        values.append(_as_int(rec[name], name))
    key = None
    if not schema.images_from_flags and "key" in rec:
        key = rec["key"]
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise _FieldError(f"must be an integer or a string id, got {_show(key)}", "key")
        if isinstance(key, int) and not 0 <= key <= _UINT64_MAX:
            raise _FieldError(f"integer key must be in [0, 2**64), got {_show(key)}", "key")
    return (*values, key)


def _as_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _FieldError(f"must be an integer, got {_show(value)}", name)
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise _FieldError(f"must be a whole number, got {value!r}", name)
        value = int(value)
    if not -(1 << 62) <= value <= (1 << 62):
        raise _FieldError(f"absurd value {_show(value)}", name)
    return value


def _show(value) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else f"<{value.bit_length()}-bit int>"
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _keys(raw_keys: list, source: str, n: int) -> np.ndarray:
    kinds = set(map(type, raw_keys))
    if kinds == {int}:
        return np.array(raw_keys, dtype=np.uint64)
    keys = index_keys(Path(source).name, n)
    if kinds == {type(None)}:
        return keys
    for i, k in enumerate(raw_keys):
        if isinstance(k, bool):
            continue
        if isinstance(k, int) and 0 <= k <= _UINT64_MAX:
            keys[i] = k
        elif isinstance(k, str):
            keys[i] = hash_key(k)
    return keys
