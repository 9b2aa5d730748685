"""`omnibal stats` modes, outputs and exit codes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import REAL_STATS_FILES
from omnibal.cli import main
from omnibal.stats.io import load_stats
from omnibal.stats.synthetic import synthetic_internvl_mixture


def test_synthetic_convert_summary_round_trip(tmp_path, capsys):
    syn = tmp_path / "syn.parquet"
    assert main(["stats", "--synthetic", "5000", "--seed", "2", "--out", str(syn), "--quiet"]) == 0
    assert load_stats(syn).equals(synthetic_internvl_mixture(5000, seed=2))
    tl = tmp_path / "syn_tl.json"
    assert main(["stats", "--convert", str(syn), "--out", str(tl), "--format", "token-lengths", "--quiet"]) == 0
    assert set(json.loads(tl.read_text())[0]) == {"vit_num", "token_num", "image_flags"}
    report = tmp_path / "r.json"
    png = tmp_path / "h.png"
    capsys.readouterr()
    assert main(["stats", "--summary", str(tl), "--report", str(report), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "5,000 samples" in out and "tiles per sample" in out
    summary = json.loads(report.read_text())["summary"]
    assert summary["num_samples"] == 5000 and summary["tiles"]["total"] == int(load_stats(syn).tiles.sum())
    assert png.stat().st_size > 1000


def test_summary_of_real_stats(shared_stats_dir, capsys):
    assert main(["stats", "--summary", str(shared_stats_dir / REAL_STATS_FILES["ai2d"])]) == 0
    out = capsys.readouterr().out
    assert "12,413 samples" in out and "30,870" in out  # rows and total tiles


@pytest.mark.parametrize(
    "argv,needle",
    [
        ([], "exactly one of"),
        (["--synthetic", "10"], "needs --out"),
        (["--convert", "x.json"], "needs --out"),
        (["--summary", "nope.jsonl"], "no such file"),
        (["--synthetic", "0", "--out", "x.jsonl"], "must be >= 1"),
    ],
)
def test_bad_arguments_exit_2(argv, needle, capsys):
    assert main(["stats", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_bad_stats_file_exit_2_and_skip(tmp_path, capsys):
    p = tmp_path / "s.jsonl"
    p.write_text('{"tiles": 1, "tokens": 5, "images": 1}\n{"tiles": 1, "tokens": -1, "images": 1}\n')
    assert main(["stats", "--summary", str(p)]) == 2
    assert "line 2" in capsys.readouterr().err
    out = tmp_path / "o.parquet"
    assert main(["stats", "--convert", str(p), "--out", str(out), "--on-error", "skip", "--quiet"]) == 0
    assert "skipped 1" in capsys.readouterr().err
    assert load_stats(out).tokens.tolist() == [5]


def test_annotations_skip_reports_on_stderr(tmp_path, capsys):
    ann = tmp_path / "a.jsonl"
    ann.write_text(
        '{"conversations": [{"from": "human", "value": "hello there"}]}\n'
        '{"image": "missing.png", "conversations": [{"from": "human", "value": "<image> what"}]}\n'
    )
    assert main(["stats", str(ann), "--workers", "1", "--quiet"]) == 2
    assert "missing.png" in capsys.readouterr().err
    out = tmp_path / "o.json"
    assert main(["stats", str(ann), "--workers", "1", "--on-error", "skip", "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 invalid record" in err and "line 2" in err and "ESTIMATE" in err
    assert np.array_equal(load_stats(out).tiles, [1])


def _counted(tmp_path, *flags) -> list[int]:
    """Tiles of a text-only sample and of one 2:1 image (size given by the record) counted with ``flags``."""
    ann = tmp_path / "a.jsonl"
    ann.write_text(
        '{"conversations": [{"from": "human", "value": "hello"}]}\n'
        '{"image": "wide.png", "width": 896, "height": 448, "conversations": [{"from": "human", "value": "<image>"}]}\n'
    )
    out = tmp_path / "o.jsonl"
    assert main(["stats", str(ann), "--workers", "1", "--out", str(out), "--quiet", *flags]) == 0
    return load_stats(out).tiles.tolist()


@pytest.mark.parametrize("flags,tiles", [
    ((), [1, 3]),  # the dummy tile; a 2x1 grid and the thumbnail
    (("--no-thumbnail",), [1, 2]),
    (("--no-dummy-tile", "--thumbnail"), [0, 3]),
    (("--max-tiles", "1"), [1, 1]),
    (("--convention", "llava", "--thumbnail"), [1, 1]),  # llava: one tile per image, whatever else is given
    (("--no-exif", "--no-split-max-tiles", "--workers", "0", "--chunk-size", "1"), [1, 3]),
])
def test_annotation_flags_are_the_config_fields(tmp_path, capsys, flags, tiles):
    assert _counted(tmp_path, *flags) == tiles


@pytest.mark.parametrize("flag", ["--no-thumbnail", "--thumbnail", "--tile-size", "--convention"])
def test_hf_model_refuses_the_settings_it_sets_given_either_way(tmp_path, capsys, flag):
    value = {"--tile-size": ["448"], "--convention": ["llava"]}.get(flag, [])
    assert main(["stats", str(tmp_path / "a.jsonl"), "--hf-model", str(tmp_path), flag, *value]) == 2
    assert f"omnibal stats: error: {flag}: set by --hf-model" in capsys.readouterr().err


def test_the_old_exif_spelling_is_gone(capsys):
    with pytest.raises(SystemExit):
        main(["stats", "a.jsonl", "--ignore-exif"])
    assert "unrecognized arguments: --ignore-exif" in capsys.readouterr().err
