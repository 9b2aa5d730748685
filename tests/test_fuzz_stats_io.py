"""Fuzzing the stats loaders (``omnibal.stats.io``) with corrupted, truncated, huge, non-UTF-8 and adversarial
files.

The promise under test (docs/guarantees.md, "Bad input"): whatever bytes a stats file holds, a load either
returns a table that accounts for every record in the file (``loaded + skipped == records``, nothing skipped
under ``on_error="raise"``), or raises :class:`omnibal.errors.InputError` whose message names the file.
Any other exception type (``UnicodeError``, ``RecursionError``, ``KeyError``, a pyarrow error, ...) fails the
test, and so does a record that disappears without being counted.

A second property is differential: JSONL files of >= 1000 lines go through pyarrow's reader (the fast path)
and every other file through the line-by-line reference parser; the two must agree on every file, which is
checked by feeding the same records once in a fast-path-eligible layout and once with a leading blank line
(which sends the file to the reference parser without changing any record).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.stats.io import read_stats, save_stats
from omnibal.stats.table import SampleStats

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SLOW_FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# -------------------------------------------------------------------------------------------- helpers
_counter = iter(range(10**9))


def _write(tmp_path: Path, data: bytes, suffix: str) -> Path:
    path = tmp_path / f"f{next(_counter)}{suffix}"
    path.write_bytes(data)
    return path


def checked_load(path: Path, *, on_error: str = "raise", format: str | None = None):
    """Load ``path`` and check the promise; returns ``(stats, report)`` or ``None`` when refused."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # read_stats never warns; a warning here would be a silent path
            stats, report = read_stats(path, on_error=on_error, format=format)
    except InputError as exc:
        assert str(path) in str(exc), f"the error does not name the file: {exc}"
        assert exc.source == str(path)
        return None
    assert len(stats) == report.num_loaded > 0
    assert report.num_loaded + report.num_skipped == report.num_records, report.summary()
    if on_error == "raise":
        assert report.num_skipped == 0
    else:
        assert len(report.errors) == min(report.num_skipped, 20)
        assert all(str(path) in str(e) for e in report.errors)
    return stats, report


def _nonblank_lines(data: bytes) -> int:
    return sum(1 for line in data.split(b"\n") if line.strip())


# JSON values of every kind, for fields and whole records
json_scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
)
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    st.text(max_size=5), kids, max_size=3), max_leaves=8)
good_record = st.fixed_dictionaries({
    "tiles": st.integers(0, 4096), "tokens": st.integers(1, 1 << 24), "images": st.integers(0, 1),
}, optional={"key": st.integers(0, 2**64 - 1) | st.text(max_size=12)}).filter(lambda r: r["images"] <= r["tiles"])
any_field = st.sampled_from(["tiles", "tokens", "images", "key"])
adversarial_record = good_record | st.builds(
    lambda rec, name, value: {**rec, name: value}, good_record, any_field, json_values
) | st.builds(lambda rec, name: {k: v for k, v in rec.items() if k != name}, good_record, any_field) | json_values


def _jsonl(records) -> bytes:
    return b"".join(json.dumps(r, allow_nan=True).encode() + b"\n" for r in records)


# ---------------------------------------------------------------------------------------- raw bytes
@FUZZ
@given(data=st.binary(max_size=400), suffix=st.sampled_from([".jsonl", ".json", ".parquet"]),
       on_error=st.sampled_from(["raise", "skip"]))
@example(data=b"\xef\xbb\xbf[]", suffix=".json", on_error="raise")  # BOM
@example(data="[{}]".encode("utf-16"), suffix=".json", on_error="raise")
@example(data=b"[" * 100_000, suffix=".json", on_error="raise")  # unclosed and deep
@example(data=b"[" * 100_000 + b"]" * 100_000, suffix=".jsonl", on_error="skip")  # deep and closed
@example(data=b'[{"tiles": ' + b"9" * 5000 + b', "tokens": 1, "images": 0}]', suffix=".json", on_error="raise")
@example(data=b"PAR1" + b"\x00" * 64 + b"PAR1", suffix=".parquet", on_error="raise")
@example(data=b"\x00\n\x00\n", suffix=".jsonl", on_error="skip")
def test_arbitrary_bytes_load_or_input_error(tmp_path, data, suffix, on_error):
    checked_load(_write(tmp_path, data, suffix), on_error=on_error)


# ------------------------------------------------------------------------------- adversarial records
@FUZZ
@given(records=st.lists(adversarial_record, min_size=1, max_size=12), on_error=st.sampled_from(["raise", "skip"]))
def test_adversarial_records_jsonl(tmp_path, records, on_error):
    data = _jsonl(records)
    out = checked_load(_write(tmp_path, data, ".jsonl"), on_error=on_error)
    if out is not None:
        assert out[1].num_records == _nonblank_lines(data)  # every line counted: loaded or skipped


@FUZZ
@given(records=st.lists(adversarial_record, min_size=1, max_size=12),
       fmt=st.sampled_from(["json", "token-lengths"]), on_error=st.sampled_from(["raise", "skip"]))
def test_adversarial_records_json_list(tmp_path, records, fmt, on_error):
    if fmt == "token-lengths":
        rename = {"tiles": "vit_num", "tokens": "token_num", "images": "image_flags"}
        records = [{rename.get(k, k): v for k, v in r.items()} if isinstance(r, dict) else r for r in records]
    data = json.dumps(records, allow_nan=True).encode()
    out = checked_load(_write(tmp_path, data, ".json"), on_error=on_error, format=fmt)
    if out is not None:
        assert out[1].num_records == len(records)


@FUZZ
@given(key=st.text(max_size=10).filter(lambda k: not any(0xD800 <= ord(c) <= 0xDFFF for c in k)))
def test_any_string_id_is_accepted_with_a_stable_key(tmp_path, key):
    _check_stable_key(tmp_path, key)


@pytest.mark.parametrize("key", ["\ud800", "a\udcffb"])
def test_lone_surrogate_id_is_accepted_with_a_stable_key(tmp_path, key):
    _check_stable_key(tmp_path, key)


def _check_stable_key(tmp_path, key):
    data = json.dumps({"key": key, "tiles": 1, "tokens": 5, "images": 1}).encode() + b"\n"
    a = checked_load(_write(tmp_path, data, ".jsonl"))
    b = checked_load(_write(tmp_path, data, ".jsonl"))
    assert a is not None and b is not None
    assert a[0].keys[0] == b[0].keys[0]


def test_non_utf8_file_name_without_ids(tmp_path):
    """Keyless records take their keys from the file name; a name that is not UTF-8 must still work."""
    name = b"stats-\xff\xfe.jsonl"
    path = tmp_path / name.decode("utf-8", "surrogateescape")
    try:
        path.write_bytes(b'{"tiles": 1, "tokens": 5, "images": 1}\n')
    except (OSError, UnicodeError):
        pytest.skip("the file system refuses non-UTF-8 names")
    out = checked_load(path)
    assert out is not None and len(out[0]) == 1


# ------------------------------------------------------------------------- mutations of a valid file
def _valid_stats(n: int, seed: int) -> SampleStats:
    rng = np.random.default_rng(seed)
    tiles = rng.integers(0, 14, n)
    return SampleStats.from_arrays(tiles=tiles, tokens=rng.integers(1, 9000, n), images=(tiles > 0).astype(int),
                                   keys=rng.integers(0, 2**63, n).astype(np.uint64))


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=6)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.integers(1, 30)),
    st.tuples(st.just("non-utf8"), st.floats(0, 1), st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"])),
)


def _mutate(data: bytes, muts) -> bytes:
    for m in muts:
        at = int(m[1] * len(data))
        if m[0] == "truncate":
            data = data[:at]
        elif m[0] == "flip":
            data = data[:at] + bytes([m[2]]) + data[at + 1:]
        elif m[0] == "delete":
            data = data[:at] + data[at + m[2]:]
        else:
            data = data[:at] + m[2] + data[at:]
    return data


@FUZZ
@given(fmt=st.sampled_from(["jsonl", "json", "token-lengths"]), n=st.integers(1, 30), seed=st.integers(0, 99),
       muts=st.lists(mutation, min_size=1, max_size=3), on_error=st.sampled_from(["raise", "skip"]))
def test_mutated_text_files(tmp_path, fmt, n, seed, muts, on_error):
    src = save_stats(_valid_stats(n, seed), tmp_path / f"src{next(_counter)}.{'jsonl' if fmt == 'jsonl' else 'json'}",
                     format=fmt)
    data = _mutate(src.read_bytes(), muts)
    path = _write(tmp_path, data, src.suffix)
    out = checked_load(path, on_error=on_error, format=fmt)
    if out is not None and fmt == "jsonl":
        assert out[1].num_records == _nonblank_lines(data)


@SLOW_FUZZ
@given(n=st.integers(1, 50), seed=st.integers(0, 99), muts=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_parquet(tmp_path, n, seed, muts):
    src = save_stats(_valid_stats(n, seed), tmp_path / f"src{next(_counter)}.parquet")
    checked_load(_write(tmp_path, _mutate(src.read_bytes(), muts), ".parquet"))


@SLOW_FUZZ
@given(n=st.integers(1, 20), column=st.sampled_from(["tiles", "tokens", "images", "key"]),
       kind=st.sampled_from(["float", "string", "null", "negative", "huge-uint", "bool", "missing", "list"]))
def test_adversarial_parquet_columns(tmp_path, n, column, kind):
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {"key": pa.array(np.arange(n, dtype=np.uint64)), "tiles": pa.array([1] * n, pa.int32()),
            "tokens": pa.array([7] * n, pa.int32()), "images": pa.array([1] * n, pa.int32())}
    bad = {"float": pa.array([0.5] * n), "string": pa.array(["1"] * n), "null": pa.array([1] * (n - 1) + [None]),
           "negative": pa.array([-3] * n, pa.int64()), "huge-uint": pa.array([2**64 - 1] * n, pa.uint64()),
           "bool": pa.array([True] * n), "list": pa.array([[1]] * n)}
    if kind == "missing":
        cols.pop(column)
    else:
        cols[column] = bad[kind]
    path = tmp_path / f"p{next(_counter)}.parquet"
    pq.write_table(pa.table(cols), path)
    out = checked_load(path)
    if kind in ("float", "string", "null", "bool", "list") or (kind == "missing" and column != "key"):
        assert out is None, f"{kind} {column} was accepted"
    if kind == "negative":
        assert out is None  # a negative key or size is refused, never wrapped around


# --------------------------------------------------------------------------------- huge inputs
def test_huge_line_and_huge_numbers_are_named(tmp_path):
    cases = {
        "long-string.jsonl": b'{"key": "' + b"x" * 5_000_000 + b'", "tiles": 1, "tokens": 3, "images": 1}\n',
        "big-int.jsonl": b'{"tiles": ' + b"9" * 100_000 + b', "tokens": 3, "images": 0}\n',
        "big-float.json": b'[{"tiles": 1e999, "tokens": 3, "images": 0}]',
        "many-fields.jsonl": b"{" + b",".join(b'"f%d": 1' % i for i in range(100_000)) + b', "tiles": 1, '
                             b'"tokens": 3, "images": 1}\n',
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        out = checked_load(path)
        if name in ("long-string.jsonl", "many-fields.jsonl"):
            assert out is not None and len(out[0]) == 1
        else:
            assert out is None


# --------------------------------------------------------------- fast path == reference parser
@SLOW_FUZZ
@given(base=st.lists(good_record, min_size=1, max_size=4), bad=st.lists(adversarial_record, max_size=3),
       positions=st.lists(st.integers(0, 1099), max_size=3), on_error=st.sampled_from(["raise", "skip"]))
def test_fast_path_agrees_with_reference_parser(tmp_path, base, bad, positions, on_error):
    records = [base[i % len(base)] for i in range(1100)]
    for rec, at in zip(bad, positions):
        records[at] = rec
    data = _jsonl(records)
    assume(data[:1] == b"{")
    ref_dir = tmp_path / f"ref{next(_counter)}"
    ref_dir.mkdir()
    name = f"same{next(_counter)}.jsonl"  # same file name: keyless records get the same index keys
    (tmp_path / f"fast{name}").write_bytes(data)
    fast = checked_load(tmp_path / f"fast{name}", on_error=on_error)
    (ref_dir / f"fast{name}").write_bytes(b"\n" + data)  # a blank first line: reference parser only
    ref = checked_load(ref_dir / f"fast{name}", on_error=on_error)
    assert (fast is None) == (ref is None)
    if fast is not None:
        assert fast[0].equals(ref[0])
        assert fast[1].num_skipped == ref[1].num_skipped


@pytest.mark.parametrize("line", [
    b'{"tiles": 1, "tiles": 2, "tokens": 3, "images": 0}',  # duplicate field: which one wins?
    b'{"tiles": 2, "tokens": 3, "images": 0} {"tiles": 2, "tokens": 3, "images": 0}',  # two records, one line
    b'{"tiles": 2.0, "tokens": 3, "images": 0}',
    b'{"tiles": 2e0, "tokens": 3, "images": 0}',
    b'{"tiles": 2, "tokens": 3, "images": 0, "key": null}',
    b'{"tiles": 2, "tokens": 3, "images": 0, "key": -1}',
    b'{"tiles": 2, "tokens": 3, "images": 0, "key": 18446744073709551616}',
    b'{"tiles": 2, "tokens": 3, "images": 0, "key": 1.0}',
    b'{"tiles": true, "tokens": 3, "images": 0}',
])
def test_fast_path_agrees_on_tricky_lines(tmp_path, line):
    good = b'{"tiles": 1, "tokens": 3, "images": 1, "key": 5}'
    data = b"\n".join([good] * 1200 + [line]) + b"\n"
    for on_error in ("raise", "skip"):
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "b").mkdir(exist_ok=True)
        (tmp_path / "a" / "t.jsonl").write_bytes(data)
        (tmp_path / "b" / "t.jsonl").write_bytes(b"\n" + data)
        fast = checked_load(tmp_path / "a" / "t.jsonl", on_error=on_error)
        ref = checked_load(tmp_path / "b" / "t.jsonl", on_error=on_error)
        assert (fast is None) == (ref is None), (line, on_error)
        if fast is not None:
            assert fast[0].equals(ref[0]), (line, on_error)
            assert fast[1].num_records == ref[1].num_records
