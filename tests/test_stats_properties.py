"""Property tests: parsers fed random and corrupted input give a correct table or a named InputError."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.stats.annotations import AnnotationConfig, compute_stats
from omnibal.stats.io import read_stats, save_stats
from omnibal.stats.table import MAX_IMAGES, MAX_TILES, MAX_TOKENS, SampleStats

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

weird = st.one_of(
    st.integers(-(10**30), 10**30),
    st.integers(0, 20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=5),
    st.lists(st.integers(0, 3), max_size=2),
)
good_record = st.fixed_dictionaries(
    {"tiles": st.integers(1, 13), "tokens": st.integers(1, 9000), "images": st.integers(0, 1)},
    optional={"key": st.one_of(st.integers(0, 2**64 - 1), st.text(min_size=1, max_size=8))},
)
any_record = st.one_of(
    good_record,
    st.dictionaries(st.sampled_from(["tiles", "tokens", "images", "key", "x"]), weird, max_size=5),
    weird,
)


_TMP_ROOT = tempfile.TemporaryDirectory(prefix="omnibal-prop-")  # removed when the test process ends


def _tmp(name: str) -> Path:
    """A fresh folder per hypothesis example (function-scoped pytest fixtures do not reset between examples),
    all under one root that is cleaned up: the suite used to leave ~500 folders in /tmp per run."""
    return Path(tempfile.mkdtemp(dir=_TMP_ROOT.name)) / name


def _valid(rec) -> bool:
    """The rules the loader enforces, stated independently."""
    if not isinstance(rec, dict) or not {"tiles", "tokens", "images"} <= rec.keys():
        return False

    def whole(v, lo, hi):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if isinstance(v, float) and (not np.isfinite(v) or v != int(v)):
            return False
        return lo <= v <= hi

    ok = (whole(rec["tiles"], 0, MAX_TILES) and whole(rec["tokens"], 1, MAX_TOKENS)
          and whole(rec["images"], 0, MAX_IMAGES))
    ok = ok and rec["images"] <= rec["tiles"]
    if "key" in rec:
        k = rec["key"]
        ok = ok and not isinstance(k, bool) and (isinstance(k, str) or (isinstance(k, int) and 0 <= k < 2**64))
    return ok


def _check(path: Path, records: list, locate) -> None:
    try:
        stats, report = read_stats(path)
    except InputError as err:
        assert err.source == str(path)
        bad = [i for i, r in enumerate(records) if not _valid(r)]
        assert bad or not records, f"valid input rejected: {err}"
        if records and err.record is not None:
            assert err.record == locate(bad[0]), (err, bad[0])
        return
    assert all(_valid(r) for r in records) and records
    assert stats.tiles.tolist() == [int(r["tiles"]) for r in records]
    assert stats.tokens.tolist() == [int(r["tokens"]) for r in records]
    assert report.num_skipped == 0
    # skip mode keeps exactly the valid ones
    kept, rep = read_stats(path, on_error="skip")
    assert len(kept) == len(records) and rep.num_skipped == 0


@SETTINGS
@given(st.lists(any_record, max_size=12))
def test_jsonl_random_records(records):
    path = _tmp("r.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    _check(path, records, lambda i: f"line {i + 1}")


@SETTINGS
@given(st.lists(any_record, max_size=12))
def test_json_random_records(records):
    path = _tmp("r.json")
    path.write_text(json.dumps(records))
    _check(path, records, lambda i: f"index {i}")


@SETTINGS
@given(st.lists(good_record, min_size=1, max_size=8), st.data())
def test_corrupted_bytes_never_crash(records, data):
    for name in ("c.jsonl", "c.json"):
        path = _tmp(name)
        raw = ("".join(json.dumps(r) + "\n" for r in records) if name.endswith("l") else json.dumps(records)).encode()
        cut = data.draw(st.integers(0, len(raw)))
        junk = data.draw(st.binary(max_size=6))
        pos = data.draw(st.integers(0, cut))
        corrupted = raw[:pos] + junk + raw[pos:cut]
        path.write_bytes(corrupted)
        for mode in ("raise", "skip"):
            try:
                stats, report = read_stats(path, on_error=mode)
            except InputError as err:
                assert err.source == str(path)
            else:
                assert isinstance(stats, SampleStats) and report.num_loaded == len(stats) >= 1
                assert report.num_loaded + report.num_skipped == report.num_records


@SETTINGS
@given(
    st.lists(
        st.tuples(st.integers(0, 13), st.integers(1, 20000), st.integers(0, 1), st.integers(0, 2**64 - 1)),
        min_size=1, max_size=30,
    )
)  # fmt: skip
def test_round_trip_any_valid_table(rows):
    tiles, tokens, images, keys = zip(*rows)
    tiles, tokens, images = np.array(tiles), np.array(tokens), np.minimum(images, tiles)
    s = SampleStats(tiles=tiles, tokens=tokens, images=images, keys=np.array(keys, dtype=np.uint64))
    for ext in ("jsonl", "json", "parquet"):
        assert read_stats(save_stats(s, _tmp(f"s.{ext}")))[0].equals(s)


conv_turn = st.one_of(
    st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt"]), "value": st.text(max_size=30)}),
    st.dictionaries(st.sampled_from(["from", "value"]), weird, max_size=2),
)
annotation = st.one_of(
    st.fixed_dictionaries(
        {"conversations": st.lists(conv_turn, max_size=3)},
        optional={
            "image": st.one_of(st.just("a.png"), st.lists(st.just("a.png"), max_size=3), weird),
            "width": st.one_of(st.integers(-5, 5000), weird),
            "height": st.one_of(st.integers(-5, 5000), weird),
            "id": weird,
        },
    ),
    weird,
)


@SETTINGS
@given(st.lists(annotation, min_size=1, max_size=8), st.sampled_from(["raise", "skip"]))
def test_annotations_random_records(records, mode):
    path = _tmp("ann.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    try:
        stats, report = compute_stats(path, AnnotationConfig(workers=1, on_error=mode))
    except InputError as err:
        assert err.source == str(path)
        assert err.record is None or err.record.startswith("line ")
        return
    assert len(stats) == report.num_loaded and report.num_loaded + report.num_skipped == len(records)
    assert (stats.tokens >= 1).all() and (stats.tiles >= 0).all()
