"""Annotation parsing: bad records named by file, record, field (and image path); skip mode; workers."""

from __future__ import annotations

import json
import shutil

import pytest

from omnibal.errors import InputError
from omnibal.examples import IMAGES_DIR
from omnibal.stats.annotations import AnnotationConfig, available_cores, compute_stats

CONV = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A square."}]
TEXT = [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "Hi."}]


def _write(path, records, *, jsonl=True):
    if jsonl:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    else:
        path.write_text(json.dumps(records))
    return path


@pytest.fixture()
def root(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    shutil.copy(IMAGES_DIR / "square_448.png", img / "sq.png")
    shutil.copy(IMAGES_DIR / "wide_1920x1080.png", img / "wide.png")
    (img / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 garbage, not a jpeg")
    return tmp_path


CFG = AnnotationConfig(workers=1)

BAD = [
    ({"image": "img/missing.png", "conversations": CONV}, "image", "image not found: "),
    ({"image": "img/broken.jpg", "conversations": CONV}, "image", "unreadable image header"),
    ({"image": "img/sq.png"}, "conversations", "missing"),
    ({"image": "img/sq.png", "conversations": []}, "conversations", "non-empty"),
    ({"image": "img/sq.png", "conversations": [{"from": "human", "value": 3}]}, "conversations", "string 'value'"),
    ({"image": "img/sq.png", "conversations": [{"value": "x"}]}, "conversations", "from"),
    ({"image": 7, "conversations": CONV}, "image", "path or a list"),
    ({"image": "", "conversations": CONV}, "image", "empty image path"),
    ({"conversations": CONV}, "conversations", "placeholder"),
    ({"image": ["img/sq.png", "img/sq.png"], "conversations": CONV}, "conversations", "placeholder"),
    ({"image": "img/x.png", "width": 800, "conversations": CONV}, "height", "together"),
    ({"image": "img/x.png", "width": 0, "height": 5, "conversations": CONV}, "width", "pixels"),
    ({"image": "img/x.png", "width": float("nan"), "height": 5, "conversations": CONV}, "width", "whole number"),
    ({"image": "img/x.png", "width": 10**9, "height": 5, "conversations": CONV}, "width", "pixels"),
    ({"image": ["img/a.png", "img/b.png"], "width": [5], "height": [5, 5],
      "conversations": [{"from": "human", "value": "<image><image>"}]}, "width", "one size per image"),
    ({"width": 5, "height": 5, "conversations": TEXT}, "width", "without an image"),
    ({"id": [1], "conversations": TEXT}, "id", "string or an integer"),
    ({"conversations": [{"from": "human", "value": ""}]}, "conversations", "no tokens"),
    ([1, 2], None, "JSON object"),
]


@pytest.mark.parametrize("bad,field,match", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_record_is_named(root, bad, field, match):
    path = _write(root / "ann.jsonl", [{"image": "img/sq.png", "conversations": CONV}, bad])
    with pytest.raises(InputError, match=match) as exc:
        compute_stats(path, CFG)
    err = exc.value
    assert err.source == str(path) and err.record == "line 2" and err.field == field
    if match.startswith(("image not found", "unreadable")):
        assert "img/" in str(err)  # header errors name the image path too


def test_malformed_json_line_and_non_utf8(root):
    path = root / "ann.jsonl"
    path.write_bytes(b'{"conversations": [{"from": "human", "value": "hi"}]}\n{"conversations": [\n\xff\xfe\n')
    with pytest.raises(InputError, match="malformed JSON") as exc:
        compute_stats(path, CFG)
    assert exc.value.record == "line 2"
    stats, report = compute_stats(path, AnnotationConfig(workers=1, on_error="skip"))
    assert len(stats) == 1 and report.num_skipped == 2 and report.num_records == 3
    assert [e.record for e in report.errors] == ["line 2", "line 3"] and "UTF-8" in str(report.errors[1])


def test_json_list_and_empty_files(root):
    path = _write(root / "ann.json", [{"image": "img/wide.png", "conversations": CONV}, {"conversations": TEXT}],
                  jsonl=False)  # fmt: skip
    stats, _ = compute_stats(path, CFG)
    assert stats.tiles.tolist() == [9, 1] and stats.images.tolist() == [1, 0]
    bad = _write(root / "bad.json", [{"conversations": TEXT}, {"image": "img/nope.png", "conversations": CONV}],
                 jsonl=False)  # fmt: skip
    with pytest.raises(InputError, match="index 1"):
        compute_stats(bad, CFG)
    (root / "empty.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match="no records"):
        compute_stats(root / "empty.jsonl", CFG)
    (root / "obj.json").write_text('{"conversations": []}')
    with pytest.raises(InputError, match="JSON list"):
        compute_stats(root / "obj.json", CFG)
    (root / "trunc.json").write_text('[{"conversations": ')
    with pytest.raises(InputError, match="malformed JSON"):
        compute_stats(root / "trunc.json", CFG)
    with pytest.raises(InputError, match="not found"):
        compute_stats(root / "absent.jsonl", CFG)


def test_skip_mode_counts_and_keeps_keys(root):
    recs = [{"id": i, "image": "img/sq.png" if i % 3 else "img/missing.png", "conversations": CONV} for i in range(9)]
    path = _write(root / "ann.jsonl", recs)
    stats, report = compute_stats(path, AnnotationConfig(workers=1, on_error="skip"))
    assert report.num_records == 9 and report.num_skipped == 3 and len(stats) == 6
    assert "skipped 3" in report.summary()
    full = compute_stats(_write(root / "ok.jsonl", [r for r in recs if r["id"] % 3]), CFG)[0]
    assert stats.tiles.tolist() == full.tiles.tolist()
    assert len(set(stats.keys.tolist())) == 6


def test_all_bad_is_an_error_even_when_skipping(root):
    path = _write(root / "ann.jsonl", [{"image": "img/missing.png", "conversations": CONV}])
    with pytest.raises(InputError, match="no valid records"):
        compute_stats(path, AnnotationConfig(workers=1, on_error="skip"))


@pytest.mark.multiprocess
def test_workers_give_the_same_table_and_first_error(root):
    recs = [{"image": "img/wide.png" if i % 2 else "img/sq.png", "conversations": CONV} for i in range(200)]
    recs += [{"conversations": TEXT}] * 50
    path = _write(root / "ann.jsonl", recs)
    one = compute_stats(path, AnnotationConfig(workers=1, chunk_size=16))[0]
    two = compute_stats(path, AnnotationConfig(workers=2, chunk_size=16))[0]
    assert one.equals(two) and len(one) == 250
    recs[137] = {"image": "img/missing.png", "conversations": CONV}
    recs[201] = "{broken"
    path = _write(root / "ann2.jsonl", recs)
    with pytest.raises(InputError) as exc:
        compute_stats(path, AnnotationConfig(workers=2, chunk_size=16))
    assert exc.value.record == "line 138"
    _, report = compute_stats(path, AnnotationConfig(workers=2, chunk_size=16, on_error="skip"))
    assert report.num_skipped == 2 and [e.record for e in report.errors] == ["line 138", "line 202"]
    table, report = compute_stats(path, AnnotationConfig(workers=0, chunk_size=16, on_error="skip"))
    assert table.equals(compute_stats(path, AnnotationConfig(workers=1, on_error="skip"))[0])
    assert report.workers == available_cores()  # 0: one per core this process may use


def test_bad_tokenizer_path(root, tmp_path):
    path = _write(root / "ann.jsonl", [{"conversations": TEXT}])
    with pytest.raises(InputError, match="tokenizer"):
        compute_stats(path, AnnotationConfig(workers=1, tokenizer=str(tmp_path / "nope.json")))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(InputError, match="tokenizer"):
        compute_stats(path, AnnotationConfig(workers=1, tokenizer=str(tmp_path / "bad.json")))
