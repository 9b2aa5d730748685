"""``vision_balance_floor``: no schedule's vision max/mean over ranks is under it (brute force on tiny inputs,
and the balancer's schedules on real and synthetic stats)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balance_helpers import real_stats
from omnibal.data.balance import balance
from omnibal.data.balance.floor import vision_balance_floor
from omnibal.data.metrics import schedule_metrics
from omnibal.stats.synthetic import synthetic_internvl_mixture


def _best_over_all_splits(tiles: list[int], dp: int, cap: int) -> float:
    """The lowest mean over steps of max/mean rank tiles over every split of ``tiles`` into steps of ``dp``
    ranks, one non-empty pack each, no pack over ``cap`` tiles (brute force: labels per sample)."""
    n, best = len(tiles), np.inf
    for steps in range(1, n // dp + 1):
        packs = steps * dp
        for labels in itertools.product(range(packs), repeat=n):
            if len(set(labels)) < packs:
                continue
            load = np.bincount(labels, weights=tiles, minlength=packs).reshape(steps, dp)
            if load.max() > cap:
                continue
            best = min(best, float((load.max(1) / load.mean(1)).mean()))
    return best


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=2, max_size=6), st.sampled_from([2, 3]), st.integers(5, 12))
def test_no_split_of_a_tiny_input_beats_the_floor(tiles, dp, cap):
    if len(tiles) < dp or max(tiles) > cap:
        return
    best = _best_over_all_splits(tiles, dp, cap)
    if np.isfinite(best):
        # the loosest floor: a pad of 1 - V / (packs x cap) at the most packs (n of them)
        pad = 1 - sum(tiles) / (len(tiles) // dp * dp * cap)
        assert best >= vision_balance_floor(np.array(tiles), dp_size=dp, tile_pad=pad) - 1e-12


def test_the_floor_is_one_when_the_tiles_split_evenly():
    assert vision_balance_floor(np.full(64, 3), dp_size=8) == 1.0
    assert vision_balance_floor(np.array([5, 5, 5, 4]), dp_size=2) == pytest.approx(1 + 1 / 19)


@pytest.mark.parametrize(("which", "dp_size", "micro"), [("ai2d", 128, 1), ("ai2d", 1024, 1), ("ai2d", 128, 8),
                                                         ("synthetic", 1024, 1)])
def test_the_balancer_never_beats_the_floor_and_it_is_over_the_goal(shared_stats_dir, which, dp_size, micro):
    """Where the floor is over 1.002 at the schedule's own tile pad no packing within the pad goal meets a
    vision max/mean of 1.002: the step totals cannot all be multiples of the DP size."""
    stats = (synthetic_internvl_mixture(30_730, seed=0) if which == "synthetic"
             else real_stats(str(shared_stats_dir), which))
    m = schedule_metrics(balance(stats, dp_size=dp_size, num_microbatches=micro), stats)
    floor = vision_balance_floor(stats.tiles, dp_size=dp_size, tile_pad=m["buffer_pad_tiles"])
    assert m["vision_max_mean_ranks"] >= floor - 1e-12
    assert vision_balance_floor(stats.tiles, dp_size=dp_size, tile_pad=0.1) > 1.002
