"""The simulator's online mode (OrchMLLM-style post-balancing): per-phase features, collectives, comparison."""

from __future__ import annotations

import numpy as np
import pytest

from omnibal.data.online_owners import tile_positions
from omnibal.sim.online import compare_online_offline, online_comm_time, online_step


def test_online_step_features_carry_each_phase_assignment():
    rng = np.random.default_rng(0)
    tiles = rng.integers(1, 13, 256)
    tokens = tiles * 256 + rng.integers(30, 900, 256)
    draws = rng.permutation(256)[:128].reshape(4, 32)
    feats, a, (data, vis, llm) = online_step(tiles, tokens, draws, num_microbatches=4)
    rows = draws.reshape(-1)
    assert feats.shape == (4, 4, 4)
    assert feats[..., 1].sum() == tiles[rows].sum() and feats[..., 2].sum() == tokens[rows].sum()
    for r in range(4):  # rank r's tiles are its vision tiles, its tokens its LLM samples'
        assert feats[r, :, 1].sum() == (a.vision_tiles == r).sum()
        assert feats[r, :, 2].sum() == tokens[rows[a.llm[r]]].sum()
        assert np.isclose(feats[r, :, 3].sum(), (tokens[rows[a.llm[r]]].astype(float) ** 2).sum())
    assert (data == np.repeat(np.arange(4), 32)).all()
    comm = online_comm_time(tiles[rows], tokens[rows], (data, vis, llm), dp_size=4, bandwidth=1e9, latency=1e-5,
                            pixel_bytes_per_tile=1e6, feature_bytes_per_tile=1e5)
    assert comm["total_s"] == comm["all_gather_s"] + comm["samples_a2a_s"] + comm["features_a2a_s"]
    assert comm["samples_a2a_s"] > comm["features_a2a_s"] / 2 > 0  # pixels outweigh one feature pass
    slow = online_comm_time(tiles[rows], tokens[rows], (data, vis, llm), dp_size=4, bandwidth=1e8, latency=1e-5,
                            pixel_bytes_per_tile=1e6, feature_bytes_per_tile=1e5)
    assert slow["total_s"] > comm["total_s"]
    same = (data, data[tile_positions(tiles[rows])], data)  # nothing moves: latency only
    assert online_comm_time(tiles[rows], tokens[rows], same, dp_size=4, bandwidth=1e9, latency=1e-5,
                            pixel_bytes_per_tile=1e6, feature_bytes_per_tile=1e5)["samples_a2a_s"] < 1e-3


def test_compare_online_offline_for_a_cluster():
    """The 128-GPU default shape (DP32 x PP4) on a small synthetic sample: online balances each phase of the
    baseline's own draws to <= 1.05, pays its collectives, and beats the baseline's step time."""
    r = compare_online_offline(num_samples=6000)
    base, online, omni = (r["modes"][m] for m in ("baseline", "online", "offline"))
    assert online["vision_max_mean"] <= 1.05 and online["llm_max_mean"] <= 1.05
    assert base["vision_max_mean"] > 1.1 and base["llm_max_mean"] > 1.1
    assert online["comm_s"] > 0 and base["comm_s"] == omni["comm_s"] == 0
    assert online["step_s"] < base["step_s"] and online["gpu_days"] < base["gpu_days"]
    assert omni["vision_max_mean"] <= 1.05 and omni["llm_max_mean"] <= 1.05
    # the control packs the same draws without padding and moves nothing: faster than the baseline by the
    # padding alone, at the baseline's balance; online is faster still by the balance
    control, blind = r["modes"]["control"], r["modes"]["online (owner-blind)"]
    assert control["comm_s"] == control["moved_gb_per_step"] == 0
    assert control["vision_max_mean"] == base["vision_max_mean"] and control["llm_max_mean"] == base["llm_max_mean"]
    assert online["step_s"] < control["step_s"] < base["step_s"]
    # owner-aware placement: the same vision balance, an LLM balance no worse, fewer bytes moved, less time
    # in collectives
    assert online["vision_max_mean"] == pytest.approx(blind["vision_max_mean"], rel=1e-12)
    assert online["llm_max_mean"] <= blind["llm_max_mean"] * (1 + 1e-12)
    assert online["moved_gb_per_step"] < 0.85 * blind["moved_gb_per_step"] and online["comm_s"] < blind["comm_s"]


def test_simulate_cli_online_vs_offline(capsys):
    from omnibal.cli import main

    assert main(["simulate", "--online-vs-offline", "--samples", "6000", "--dp", "8", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "DP8 x PP2" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"baseline", "online", "offline"} <= set(rows)


def test_docs_copy_the_online_prediction_verbatim():
    """docs/sim.md quotes benchmarks/results/online_sim.md's tables: every table row of the result file is
    in the doc, so a regenerated file with other figures fails here until the doc follows."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    rows = [line for line in (root / "benchmarks/results/online_sim.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| ---")]
    doc = (root / "docs/sim.md").read_text().splitlines()
    assert rows and all(row in doc for row in rows), [row for row in rows if row not in doc]
