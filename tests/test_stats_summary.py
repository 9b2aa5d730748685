"""Summaries: numbers checked against numpy, the text table and the PNG."""

from __future__ import annotations

import numpy as np

from omnibal.stats.summary import plot_histograms, summarize
from omnibal.stats.table import SampleStats


def test_summary_numbers_and_text(tmp_path):
    s = SampleStats.from_arrays(tiles=[1, 5, 5, 13, 1], tokens=[300, 1500, 1400, 4000, 100], images=[1, 1, 2, 1, 0])
    summ = summarize(s)
    assert summ.num_samples == 5 and summ.num_text_only == 1 and summ.num_multi_image == 1
    assert summ.tiles.total == 25 and summ.tokens.mean == np.mean([300, 1500, 1400, 4000, 100])
    assert summ.tiles_histogram == {1: 2, 5: 2, 13: 1}
    assert summ.tokens.percentiles[50] == 1400
    assert sum(c for _, _, c in summ.tokens_histogram) == 5
    text = summ.to_text()
    assert "5 samples" in text and "tokens per sample" in text and "[3,072, 4,096)          1" in text
    d = summ.to_dict()
    assert d["tiles_histogram"] == {"1": 2, "5": 2, "13": 1}
    png = plot_histograms(s, tmp_path / "h.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_token_bins_cover_an_edge_value():
    s = SampleStats.from_arrays(tiles=[1, 1], tokens=[4096, 20000])
    hist = summarize(s).tokens_histogram
    assert sum(c for _, _, c in hist) == 2
    assert any(lo <= 4096 < hi and c == 1 for lo, hi, c in hist)
    assert hist[-1][0] <= 20000 < hist[-1][1]
