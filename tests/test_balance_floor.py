"""Floors: no schedule beats ``vision_balance_floor`` or ``FullPacks``' token bound (brute force on tiny inputs,
and the balancer's schedules on real and synthetic stats)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balance_helpers import real_stats
from omnibal.data.balance import DEFAULT_COST, balance
from omnibal.data.balance.floor import FullPacks, pad_floor, vision_balance_floor
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


def _least_largest_pack(tiles: list[int], tokens: list[int], packs: int, cap: int) -> float:
    """The least largest pack's tokens over every split of the samples into ``packs`` non-empty packs of at
    most ``cap`` tiles (brute force: labels per sample); inf when none fits."""
    best = np.inf
    for labels in itertools.product(range(packs), repeat=len(tiles)):
        if len(set(labels)) < packs:
            continue
        if np.bincount(labels, weights=tiles, minlength=packs).max() > cap:
            continue
        best = min(best, float(np.bincount(labels, weights=tokens, minlength=packs).max()))
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(0, 60)), min_size=3, max_size=7), st.integers(2, 3),
       st.integers(0, 2))
def test_no_split_of_a_tiny_input_holds_fewer_tokens_in_its_fullest_pack(samples, packs, extra):
    """``FullPacks.least_tokens`` is a bound: no packing's largest pack holds fewer tokens (tokens are 256 a
    tile plus the text, as in InternVL)."""
    tiles = [v for v, _ in samples]
    tokens = [256 * v + x for v, x in samples]
    if len(tiles) < packs:
        return
    cap = max(-(-sum(tiles) // packs), max(tiles)) + extra
    best = _least_largest_pack(tiles, tokens, packs, cap)
    if np.isfinite(best):
        assert best >= FullPacks(np.array(tiles), np.array(tokens)).least_tokens(packs, cap) - 1e-6


def test_the_fullest_packs_bound_the_token_buffer_of_ai2d_at_1024_ranks(shared_stats_dir):
    """ai2d at 3 steps of 1,024: V/P = 10.05, so 150 packs hold 11 tiles (three samples at least); their
    tokens, not the mean pack's 2,792, set the least Q_t. The balancer's buffer is not under it."""
    stats = real_stats(str(shared_stats_dir), "ai2d")
    p = 3 * 1024
    bound = FullPacks(stats.tiles, stats.tokens).least_tokens(p, 11)
    assert bound > stats.tokens.sum() / p + 100
    sched = balance(stats, dp_size=1024)
    assert (sched.num_steps, sched.caps.tiles) == (3, 11)
    assert sched.caps.tokens >= bound
    floor = pad_floor(stats.tiles, stats.tokens, slots_per_step=1024, cost=DEFAULT_COST)
    assert schedule_metrics(sched, stats)["buffer_pad_compute"] >= floor.compute - 1e-12
