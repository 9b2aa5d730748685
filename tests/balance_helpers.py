"""Shared helpers for the balance/sampler/online/metrics tests."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from omnibal.stats.table import SampleStats


@lru_cache(maxsize=4)
def real_stats(stats_dir: str, which: str = "merged") -> SampleStats:
    """The real InternVL-1.2M subsets through the project's loader (``which``: ai2d, chartqa, merged)."""
    from conftest import REAL_STATS_FILES
    from omnibal.stats.io import load_stats

    parts = {name: load_stats(f"{stats_dir}/{fname}") for name, fname in REAL_STATS_FILES.items()}
    if which == "merged":
        return SampleStats.concat([parts["ai2d"], parts["chartqa"]])
    return parts[which]


def random_stats(n: int, seed: int = 0, *, max_tiles: int = 13, text_only: float = 0.1) -> SampleStats:
    """A VLM-like random table: tiles 0..max_tiles, tokens = 256 per tile + text."""
    rng = np.random.default_rng(seed)
    tiles = rng.integers(1, max_tiles + 1, n)
    tiles[rng.random(n) < text_only] = 0
    tokens = 256 * tiles + rng.integers(20, 600, n)
    return SampleStats.from_arrays(tiles=tiles, tokens=tokens, source=f"random(n={n},seed={seed})")


def assert_exactly_once(schedule) -> None:
    counts = schedule.sample_counts()
    dropped = np.zeros(schedule.num_samples, bool)
    dropped[schedule.dropped] = True
    assert (counts[~dropped] == 1).all(), f"missing {(counts[~dropped] == 0).sum()}, repeated {(counts > 1).sum()}"
    assert (counts[dropped] == 0).all()
    assert schedule.pack_ids.shape[1:] == (schedule.dp_size, schedule.num_microbatches)


def two_profile_mixture(n: int, seed: int = 0) -> SampleStats:
    """Two synthetic subsets with different tile profiles: wide charts (mostly 3 tiles: a 2x1 grid plus the
    thumbnail) and square documents (mostly 5: 2x2 plus the thumbnail), half and half."""
    from omnibal.stats.synthetic import SubsetProfile, SyntheticConfig, synthetic_internvl_mixture

    profiles = (
        SubsetProfile(name="wide_charts", weight=1, text_median=120, text_sigma=0.4, long_side_median=900,
                      long_side_sigma=0.1, aspect_ratios=(2.0,), aspect_jitter=0.05),
        SubsetProfile(name="square_docs", weight=1, text_median=150, text_sigma=0.4, long_side_median=800,
                      long_side_sigma=0.1, aspect_ratios=(1.0,), aspect_jitter=0.05),
    )
    return synthetic_internvl_mixture(n, seed=seed, config=SyntheticConfig(profiles=profiles))
