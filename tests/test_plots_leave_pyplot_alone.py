"""Library plots draw on their own Figure objects: they neither switch matplotlib's global backend nor leave
figures in pyplot's registry (a user's notebook or GUI backend stays as it was; issue 21 "hidden state")."""

from __future__ import annotations

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")


def test_library_plots_keep_the_backend_and_open_no_pyplot_figure(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from omnibal.stats.summary import plot_histograms
    from omnibal.stats.table import SampleStats

    calls = []
    monkeypatch.setattr(matplotlib, "use", lambda *a, **k: calls.append(a))
    before = plt.get_fignums()
    stats = SampleStats.from_arrays(tiles=np.array([1, 3, 5, 1]), tokens=np.array([300, 900, 1200, 40]),
                                    images=np.array([1, 1, 1, 0]), source="t")
    out = plot_histograms(stats, tmp_path / "h.png")
    assert out.stat().st_size > 1000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert calls == [] and plt.get_fignums() == before
