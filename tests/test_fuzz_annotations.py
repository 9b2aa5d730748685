"""Fuzzing the annotation reader (``omnibal.stats.annotations.compute_stats``) and the image-header reader with
adversarial records, corrupt files and images, and paths that escape the image root.

Promises (docs/guarantees.md, "Bad input"):

* whatever an annotation file holds, ``compute_stats`` returns statistics that account for every record
  (``loaded + skipped == records``; nothing skipped under ``on_error="raise"``) or raises ``InputError``
  naming the annotation file; never another exception type;
* whatever bytes an image file holds (truncated, not an image, a header claiming 30000 x 30000 pixels),
  its size is read from the header or an ``InputError`` names it;
* an image path that points outside the image root (``../..``, an absolute path, a symlink leading out) is
  refused unless ``allow_outside_root=True``.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.stats import annotations

AnnotationConfig, compute_stats = annotations.AnnotationConfig, annotations.compute_stats

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_counter = iter(range(10**9))


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` (no pixel data: the reader must not need any)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(
        b"IEND", b"")


@pytest.fixture
def image_root(tmp_path) -> Path:
    root = tmp_path / "images"
    root.mkdir()
    (root / "ok.png").write_bytes(png_header(800, 600))
    (root / "sub").mkdir()
    (root / "sub" / "tall.png").write_bytes(png_header(100, 2000))
    return root


def checked_compute(path: Path, config) -> tuple | None:
    try:
        stats, report = compute_stats(path, config)
    except InputError as exc:
        assert str(path) in str(exc), f"the error does not name the annotation file: {exc}"
        return None
    assert len(stats) == report.num_loaded > 0
    assert report.num_loaded + report.num_skipped == report.num_records
    if config.on_error == "raise":
        assert report.num_skipped == 0
    return stats, report


def _write(tmp_path: Path, data: bytes, suffix: str = ".jsonl") -> Path:
    path = tmp_path / f"ann{next(_counter)}{suffix}"
    path.write_bytes(data)
    return path


# ------------------------------------------------------------------------------------------ records
json_leaf = (st.none() | st.booleans() | st.integers(-(2**66), 2**66) | st.floats(allow_nan=True)
             | st.text(max_size=10) | st.sampled_from(["<image>", "<image><image>", "ok.png", "missing.png",
                                                      "sub/tall.png", "../x.png", "/etc/hostname", ""]))
json_any = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    st.sampled_from(["from", "value", "image", "id", "width", "height", "conversations", "x"]), kids, max_size=4),
    max_leaves=10)
turn = st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt"]),
                              "value": st.text(max_size=30) | st.sampled_from(
                                  ["<image>\nWhat is this?", "A chart.", "<image><image> compare", ""])})
good = st.fixed_dictionaries({"conversations": st.lists(turn, min_size=1, max_size=4)}, optional={
    "id": st.text(max_size=8) | st.integers(0, 10**6), "image": st.sampled_from(["ok.png", "sub/tall.png"]),
})
record = good | st.builds(lambda rec, k, v: {**rec, k: v}, good,
                          st.sampled_from(["conversations", "image", "id", "width", "height"]), json_any) | json_any


@FUZZ
@given(records=st.lists(record, min_size=1, max_size=8), on_error=st.sampled_from(["raise", "skip"]),
       as_list=st.booleans())
def test_adversarial_records(tmp_path, image_root, records, on_error, as_list):
    if as_list:
        path = _write(tmp_path, json.dumps(records, allow_nan=True).encode(), ".json")
    else:
        path = _write(tmp_path, b"".join(json.dumps(r, allow_nan=True).encode() + b"\n" for r in records))
    out = checked_compute(path, AnnotationConfig(image_root=str(image_root), on_error=on_error))
    if out is not None:
        assert out[1].num_records == len(records)


@FUZZ
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".jsonl", ".json"]),
       on_error=st.sampled_from(["raise", "skip"]))
@example(data=b"[" * 100_000, suffix=".json", on_error="raise")
@example(data=b"{" * 100_000 + b"\n", suffix=".jsonl", on_error="skip")
@example(data=b"\xff\xfe\n", suffix=".jsonl", on_error="skip")
def test_arbitrary_bytes(tmp_path, image_root, data, suffix, on_error):
    checked_compute(_write(tmp_path, data, suffix), AnnotationConfig(image_root=str(image_root), on_error=on_error))


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_lone_surrogate_id(tmp_path, image_root, on_error):
    data = b'{"id": "\\ud800", "conversations": [{"from": "human", "value": "hi"}]}\n'
    checked_compute(_write(tmp_path, data), AnnotationConfig(image_root=str(image_root), on_error=on_error))


# ------------------------------------------------------------------------------------------ images
def _one_image_record(image: str) -> bytes:
    return json.dumps({"id": "a", "image": image,
                       "conversations": [{"from": "human", "value": "<image>\nq"}, {"from": "gpt", "value": "a"}]}
                      ).encode() + b"\n"


@FUZZ
@given(data=st.binary(max_size=200) | st.builds(lambda w, h, cut: png_header(w, h)[:cut], st.integers(0, 2**31 - 1),
                                                 st.integers(0, 2**31 - 1), st.integers(0, 80)))
@example(data=png_header(0, 5))
def test_any_image_bytes(tmp_path, image_root, data):
    (image_root / "fuzz.png").write_bytes(data)
    out = checked_compute(_write(tmp_path, _one_image_record("fuzz.png")), AnnotationConfig(image_root=str(image_root)))
    if out is None:
        with pytest.raises(InputError) as exc:
            compute_stats(_write(tmp_path, _one_image_record("fuzz.png")), AnnotationConfig(image_root=str(image_root)))
        assert "fuzz.png" in str(exc.value)  # names the image as well as the annotation file


@pytest.mark.parametrize("size", [(30_000, 30_000), (2**31 - 1, 2**31 - 1)])
def test_header_beyond_pillows_bomb_limit_is_an_input_error_or_counted(tmp_path, image_root, size):
    (image_root / "big.png").write_bytes(png_header(*size))
    checked_compute(_write(tmp_path, _one_image_record("big.png")), AnnotationConfig(image_root=str(image_root)))


def test_large_but_real_image_is_counted_not_refused(tmp_path, image_root):
    """A 30000 x 30000 scan is a legitimate (if large) image: only its header is read, so Pillow's
    decompression-bomb guard (meant for decoding) must not turn it into a crash."""
    (image_root / "scan.png").write_bytes(png_header(30_000, 30_000))
    stats, _ = compute_stats(_write(tmp_path, _one_image_record("scan.png")),
                             AnnotationConfig(image_root=str(image_root)))
    assert stats.tiles[0] >= 1 and stats.images[0] == 1


@pytest.mark.parametrize("kind", ["directory", "empty", "text", "missing"])
def test_unreadable_images_are_named(tmp_path, image_root, kind):
    target = image_root / f"bad-{kind}.png"
    if kind == "directory":
        target.mkdir()
    elif kind == "empty":
        target.write_bytes(b"")
    elif kind == "text":
        target.write_text("not an image")
    with pytest.raises(InputError) as exc:
        compute_stats(_write(tmp_path, _one_image_record(target.name)), AnnotationConfig(image_root=str(image_root)))
    assert target.name in str(exc.value) and exc.value.record == "line 1"


# ---------------------------------------------------------------------------------- outside the root
def _escapes(image_root: Path, tmp_path: Path) -> dict[str, str]:
    outside = tmp_path / "secret.png"
    outside.write_bytes(png_header(64, 64))
    link_dir = image_root / "link-out"
    link_file = image_root / "link.png"
    try:
        link_dir.symlink_to(tmp_path, target_is_directory=True)
        link_file.symlink_to(outside)
    except OSError:
        pytest.skip("no symlinks on this file system")
    return {"dotdot": "../secret.png", "deep-dotdot": "sub/../../secret.png", "absolute": str(outside),
            "symlinked-dir": "link-out/secret.png", "symlinked-file": "link.png"}


@pytest.mark.parametrize("case", ["dotdot", "deep-dotdot", "absolute", "symlinked-dir", "symlinked-file"])
def test_paths_outside_the_image_root_are_refused(tmp_path, image_root, case):
    image = _escapes(image_root, tmp_path)[case]
    path = _write(tmp_path, _one_image_record(image))
    with pytest.raises(InputError, match="outside") as exc:
        compute_stats(path, AnnotationConfig(image_root=str(image_root)))
    assert str(path) in str(exc.value) and exc.value.field == "image"
    # also when the record gives the size (no file is opened, the path is still refused)
    rec = json.loads(_one_image_record(image))
    path2 = _write(tmp_path, json.dumps({**rec, "width": 64, "height": 64}).encode() + b"\n")
    with pytest.raises(InputError, match="outside"):
        compute_stats(path2, AnnotationConfig(image_root=str(image_root)))
    # skip mode counts it as skipped, never silently
    mixed = _write(tmp_path, _one_image_record("ok.png") + _one_image_record(image))
    stats, report = compute_stats(mixed, AnnotationConfig(image_root=str(image_root), on_error="skip"))
    assert (report.num_loaded, report.num_skipped) == (1, 1)


@pytest.mark.parametrize("case", ["dotdot", "absolute", "symlinked-dir", "symlinked-file"])
def test_outside_paths_allowed_when_asked(tmp_path, image_root, case):
    image = _escapes(image_root, tmp_path)[case]
    stats, _ = compute_stats(_write(tmp_path, _one_image_record(image)),
                             AnnotationConfig(image_root=str(image_root), allow_outside_root=True))
    assert stats.images[0] == 1


def test_paths_inside_the_root_still_work(tmp_path, image_root):
    """``sub/../ok.png`` and ``./ok.png`` stay inside the root: never refused."""
    data = _one_image_record("sub/../ok.png") + _one_image_record("./ok.png") + _one_image_record("sub/tall.png")
    stats, report = compute_stats(_write(tmp_path, data), AnnotationConfig(image_root=str(image_root)))
    assert report.num_loaded == 3


def test_workers_give_the_same_result(tmp_path, image_root):
    """The worker pool keeps file order and the same errors as the in-process path."""
    lines = [_one_image_record("ok.png"), _one_image_record("missing.png"), b"{bad json\n"] * 20
    path = _write(tmp_path, b"".join(lines))
    one = compute_stats(path, AnnotationConfig(image_root=str(image_root), on_error="skip", chunk_size=7))
    two = compute_stats(path, AnnotationConfig(image_root=str(image_root), on_error="skip", chunk_size=7, workers=2))
    assert one[0].equals(two[0])
    assert one[1].num_skipped == two[1].num_skipped == 40
    assert [str(e) for e in one[1].errors] == [str(e) for e in two[1].errors]
