"""Stats file formats: round trips, the real OmniBal statistics, and bad input named precisely."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from conftest import REAL_STATS_FILES
from omnibal.errors import InputError
from omnibal.stats.io import (
    FORMATS,
    SkippedRecordsWarning,
    detect_format,
    load_stats,
    read_stats,
    save_stats,
)
from omnibal.stats.table import SampleStats, hash_key, index_keys

EXT = {"jsonl": "jsonl", "json": "json", "parquet": "parquet", "token-lengths": "json"}


def _small() -> SampleStats:
    return SampleStats.from_arrays(
        tiles=[1, 13, 0, 5, 1], tokens=[300, 4000, 12, 1500, 7], images=[1, 1, 0, 2, 1], source="small"
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_every_format(tmp_path, fmt):
    s = _small()
    if fmt == "token-lengths":  # one image per sample and no keys in that format
        s = SampleStats.from_arrays(tiles=s.tiles, tokens=s.tokens, images=(s.images > 0), source="small")
    path = save_stats(s, tmp_path / f"s.{EXT[fmt]}", format=fmt)
    assert detect_format(path) == fmt
    back, report = read_stats(path)
    assert report.format == fmt and report.num_loaded == len(s) and report.num_skipped == 0
    assert np.array_equal(back.tiles, s.tiles) and np.array_equal(back.tokens, s.tokens)
    assert np.array_equal(back.images, s.images)
    if fmt == "token-lengths":
        assert np.array_equal(back.keys, index_keys(path.name, len(s)))
    else:
        assert back.equals(s)


def test_token_lengths_writes_image_flags_as_tile_count(tmp_path):
    s = SampleStats.from_arrays(tiles=[5, 1, 3], tokens=[1300, 300, 800], images=[1, 0, 1])
    path = save_stats(s, tmp_path / "t.json", format="token-lengths")
    assert json.loads(path.read_text()) == [
        {"vit_num": 5, "token_num": 1300, "image_flags": 5},
        {"vit_num": 1, "token_num": 300, "image_flags": 0},  # text-only with its dummy tile
        {"vit_num": 3, "token_num": 800, "image_flags": 3},
    ]


def test_string_ids_hash_and_missing_keys_use_index(tmp_path):
    p = tmp_path / "k.jsonl"
    p.write_text('{"key": "sample-7", "tiles": 1, "tokens": 5, "images": 1}\n{"tiles": 2, "tokens": 6, "images": 1}\n')
    s = load_stats(p)
    assert s.keys[0] == np.uint64(hash_key("sample-7"))
    assert s.keys[1] == index_keys("k.jsonl", 2)[1]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_large_uint64_keys_survive(tmp_path, fmt):
    keys = np.array([0, (1 << 64) - 1, 1 << 63], dtype=np.uint64)
    s = SampleStats(tiles=np.ones(3), tokens=np.ones(3), images=np.ones(3), keys=keys)
    assert load_stats(save_stats(s, tmp_path / f"k.{fmt}")).equals(s)


def test_real_stats_counts_and_round_trip(shared_stats_dir, tmp_path):
    for name, rows in (("ai2d", 12_413), ("chartqa", 18_317)):
        path = shared_stats_dir / REAL_STATS_FILES[name]
        raw = json.loads(path.read_text())
        s = load_stats(path)
        assert len(s) == len(raw) == rows
        assert int(s.tiles.sum()) == sum(r["vit_num"] for r in raw)
        assert int(s.tokens.sum()) == sum(r["token_num"] for r in raw)
        flags = np.array([r["image_flags"] for r in raw])
        assert np.array_equal(np.where(s.images > 0, s.tiles, 0), flags)  # image_flags == vit_num here
        assert int(s.images.sum()) == int((flags > 0).sum())
        for fmt in FORMATS:
            out = save_stats(s, tmp_path / f"{name}.{fmt}.{EXT[fmt]}", format=fmt)
            back = load_stats(out)
            assert np.array_equal(back.tiles, s.tiles) and np.array_equal(back.tokens, s.tokens)
            assert np.array_equal(back.images, s.images)
            if fmt == "token-lengths":
                assert json.loads(out.read_text()) == raw  # the published file round-trips exactly
            else:
                assert back.equals(s)


def test_jsonl_fast_path_matches_reference_reader(tmp_path):
    big = _small().replicate(3000)
    path = save_stats(big, tmp_path / "big.jsonl")
    fast = load_stats(path)
    # a blank line sends the file to the line-by-line reader; the table must be identical
    path2 = tmp_path / "big2.jsonl"
    path2.write_text(path.read_text().replace("\n", "\n\n", 1))
    assert fast.equals(big) and load_stats(path2).equals(big)


def test_two_records_on_one_line_is_an_error(tmp_path):
    big = _small().replicate(3000)
    path = save_stats(big, tmp_path / "big.jsonl")
    lines = path.read_text().splitlines()
    lines[1500] = lines[1500] + " " + lines[1501]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match="line 1501"):
        load_stats(path)


BAD = [
    ("a.jsonl", b'{"tiles": 1, "tokens": 2, "images": 1}\n{"tiles": 1, "tokens": 2\n', "line 2", None),
    ("b.jsonl", b'{"tiles": 1, "tokens": 5, "images": 1}\n\n{"tiles": 1, "tokens": -2, "images": 1}\n',
     "line 3", "tokens"),
    ("c.json", b'[{"tiles": 1, "tokens": 2, "images": 1}, {"tiles": "x", "tokens": 2, "images": 1}]',
     "index 1", "tiles"),
    ("d.json", b'[{"vit_num": 3, "token_num": 900, "image_flags": 3}, '
               b'{"vit_num": 1, "token_num": NaN, "image_flags": 1}]', "index 1", "token_num"),
    ("e.jsonl", b"", "empty", None),
    ("e2.json", b"[]", "no records", None),
    ("f.jsonl", b'{"tiles": 1, "tokens": 2, "images": 1}\n\xff\n', "line 2", None),
    ("g.json", b'[{"tiles": 1, "tokens": 2}]', "index 0", "images"),
    ("h.jsonl", b'{"tiles": 1, "tokens": 2, "images": 3}\n', "line 1", "images"),
    ("i.jsonl", b'{"tiles": 1, "tokens": 2, "images": true}\n', "line 1", "images"),
    ("j.jsonl", b'{"tiles": 100000000000000000000000, "tokens": 2, "images": 1}\n', "line 1", "tiles"),
    ("k.jsonl", b'{"tiles": 5000, "tokens": 2, "images": 1}\n', "line 1", "tiles"),
    ("l.jsonl", b'{"tiles": 0, "tokens": 0, "images": 0}\n', "line 1", "tokens"),
    ("m.jsonl", b'{"key": -1, "tiles": 1, "tokens": 1, "images": 1}\n', "line 1", "key"),
    ("n.jsonl", b'[1, 2]\n', "line 1", None),
    ("o.json", b'{"tiles": 1}', "JSON list", None),
    ("p.json", b"[" * 100_000, None, None),
    ("q.jsonl", b'{"tiles": 2.5, "tokens": 2, "images": 1}\n', "line 1", "tiles"),
]


@pytest.mark.parametrize("name,content,where,field", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_file_record_field(tmp_path, name, content, where, field):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(InputError) as exc:
        load_stats(path)
    assert str(path) in str(exc.value)
    if where:
        assert where in str(exc.value)
    assert exc.value.field == field


def test_skip_counts_and_reports(tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = '{"tiles": 1, "tokens": 5, "images": 1}'
    path.write_text("\n".join([good, "{oops", good, '{"tiles": 1, "tokens": 0, "images": 1}', good]) + "\n")
    stats, report = read_stats(path, on_error="skip")
    assert len(stats) == 3 and report.num_records == 5 and report.num_skipped == 2
    assert [e.record for e in report.errors] == ["line 2", "line 4"]
    assert "skipped 2" in report.summary()
    with pytest.warns(SkippedRecordsWarning, match="skipped 2"):
        load_stats(path, on_error="skip")
    ok = tmp_path / "ok.jsonl"
    ok.write_text(good + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped: no warning
        load_stats(ok, on_error="skip")
    # kept rows keep the keys they would have had without the bad ones
    assert stats.keys.tolist() == index_keys("mixed.jsonl", 5)[[0, 2, 4]].tolist()


def test_parquet_bad_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"tiles": [1, 2], "tokens": [3.5, 4.0], "images": [1, 1]}), p)
    with pytest.raises(InputError, match="integers") as exc:
        load_stats(p)
    assert exc.value.field == "tokens"
    pq.write_table(pa.table({"tiles": [1, None], "tokens": [3, 4], "images": [1, 1]}), p)
    with pytest.raises(InputError, match="index 1"):
        load_stats(p)
    pq.write_table(pa.table({"tiles": [1, 2], "images": [1, 1]}), p)
    with pytest.raises(InputError, match="missing column"):
        load_stats(p)
    p.write_bytes(b"not parquet")
    with pytest.raises(InputError, match="parquet"):
        load_stats(p)


def test_parquet_column_name_that_is_not_utf8(tmp_path):
    """A corrupted schema whose column name is not UTF-8 (found by test_fuzz_stats_io: a UnicodeDecodeError
    escaped from pyarrow) is an InputError naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "names.parquet"
    pq.write_table(pa.table({"tiles": [1, 2], "tokens": [3, 4], "images": [1, 1]}), p, store_schema=False)
    data = p.read_bytes()
    assert b"tokens" in data
    p.write_bytes(data.replace(b"tokens", b"\x80okens"))
    with pytest.raises(InputError, match="UTF-8") as exc:
        load_stats(p)
    assert exc.value.source == str(p)


def test_unknown_extension_and_missing_file(tmp_path):
    with pytest.raises(InputError, match="format"):
        load_stats(tmp_path / "x.csv")
    with pytest.raises(InputError, match="no such file"):
        load_stats(tmp_path / "x.jsonl")
