"""``omnibal balance`` end to end on a small stats file."""

from __future__ import annotations

import json

import numpy as np

from omnibal.cli import main


def _write_token_lengths(path, n=400, seed=0):
    rng = np.random.default_rng(seed)
    tiles = rng.choice([1, 3, 5], n)
    rows = [{"vit_num": int(v), "token_num": int(256 * v + rng.integers(30, 300)), "image_flags": int(v)}
            for v in tiles]
    path.write_text(json.dumps(rows))


def test_balance_cli_writes_schedule_metrics_and_plot(tmp_path, capsys):
    stats = tmp_path / "stats.json"
    _write_token_lengths(stats)
    out, png, mjson = tmp_path / "s.json", tmp_path / "load.png", tmp_path / "m.json"
    rc = main(["balance", "--stats", str(stats), "--dp", "4", "--microbatches", "2", "--out", str(out),
               "--plot", str(png), "--metrics-json", str(mjson), "--seed", "3"])
    assert rc == 0
    d = json.loads(out.read_text())
    assert d["dp_size"] == 4 and d["num_microbatches"] == 2 and set(d["caps"]) == {"tiles", "tokens"}
    rows = sorted(i for step in d["steps"] for rank in step for mb in rank for i in mb)
    assert rows == list(range(400))
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(mjson.read_text())["coverage_ok"] is True
    assert "vision_max_mean_ranks" in capsys.readouterr().out


def test_balance_cli_baseline_and_bad_input(tmp_path, capsys):
    stats = tmp_path / "stats.json"
    _write_token_lengths(stats, n=50)
    assert main(["balance", "--stats", str(stats), "--dp", "2", "--balance-method", "random", "--quiet"]) == 0
    assert main(["balance", "--stats", str(stats), "--dp", "64"]) == 2
    assert "dp_size" in capsys.readouterr().err
    assert main(["balance", "--stats", str(stats), "--dp", "2", "--max-tiles", "2", "--max-tokens", "9000"]) == 2
    assert main(["balance", "--stats", str(tmp_path / "missing.json"), "--dp", "2"]) == 2
