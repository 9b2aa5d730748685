"""Balance metrics on hand-built schedules."""

from __future__ import annotations

import numpy as np
import pytest

from omnibal.data.balance import BalanceCost
from omnibal.data.balance.schedule import Caps, Schedule
from omnibal.data.metrics import coverage, metrics_table, schedule_metrics
from omnibal.stats.table import SampleStats

TILES_ONLY = BalanceCost(vision_coef=(0, 1, 0, 0), llm_coef=(0, 0, 1, 0))


def _sched(packs, ids, n, caps=(10, 1000), padding="varlen", dropped=()):
    flat = np.concatenate([np.asarray(p, np.int64) for p in packs]) if packs else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in packs])])
    return Schedule(dp_size=ids.shape[1], num_microbatches=ids.shape[2], caps=Caps(tiles=caps[0], tokens=caps[1]),
                    pack_samples=flat, pack_offsets=offsets, pack_ids=ids, num_samples=n, padding=padding,
                    dropped=np.asarray(dropped, np.int64))


def test_hand_computed_values():
    stats = SampleStats.from_arrays(tiles=[2, 2, 4, 1], tokens=[100, 300, 400, 200])
    # one step, two ranks: rank 0 = samples {0, 1}, rank 1 = {2, 3}
    sched = _sched([[0, 1], [2, 3]], np.array([[[0], [1]]]), 4)
    m = schedule_metrics(sched, stats, TILES_ONLY)
    assert m["vision_max_mean_ranks"] == pytest.approx(5 / 4.5)
    assert m["llm_max_mean_ranks"] == pytest.approx(600 / 500)
    assert m["dist_ratio_vision"] == pytest.approx(1 - 4.5 / 5)
    assert m["dist_ratio_text"] == pytest.approx(1 - 500 / 600)
    # pad to longest: (300-100)/(300*2) and (400-200)/(400*2), averaged
    assert m["pad_ratio_longest"] == pytest.approx((200 / 600 + 200 / 800) / 2)
    assert m["buffer_pad_tiles"] == pytest.approx(1 - 9 / 20)
    assert m["buffer_pad_tokens"] == pytest.approx(1 - 1000 / 2000)
    assert m["useful_fraction"] == pytest.approx((9 + 1000) / (2 * (5 + 600)))
    assert m["coverage_ok"] and m["samples_per_microbatch_mean"] == 2
    assert "| method |" in metrics_table([m])


def test_padded_schedule_counts_padding_as_work():
    stats = SampleStats.from_arrays(tiles=[1, 1], tokens=[100, 300])
    sched = _sched([[0, 1]], np.array([[[0]]]), 2, padding="pad_to_longest")
    m = schedule_metrics(sched, stats, TILES_ONLY)
    assert m["useful_fraction"] == pytest.approx((2 + 400) / (2 + 600))


def test_coverage_counts_missing_repeated_dropped():
    sched = _sched([[0, 1], [1, 2]], np.array([[[0], [1]]]), 5, dropped=[4])
    c = coverage(sched)
    assert c == {"coverage_exactly_once": 2, "coverage_missing": 1, "coverage_repeated": 1, "coverage_dropped": 1,
                 "coverage_ok": False}


def test_steps_with_empty_microbatches_are_counted_apart():
    stats = SampleStats.from_arrays(tiles=[1, 1, 1], tokens=[10, 10, 10])
    sched = _sched([[0], [1], [2], []], np.array([[[0], [1]], [[2], [3]]]), 3)
    m = schedule_metrics(sched, stats, TILES_ONLY)
    assert m["steps_with_empty_microbatches"] == 1 and m["empty_microbatches"] == 1
    assert m["vision_max_mean_ranks"] == pytest.approx(1.0)
