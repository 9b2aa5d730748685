"""Stragglers: the gradient sync waits for the expected slowest DP rank when ranks vary unpredictably."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.sim import SimConfig, rank_jitter, simulate_epoch
from omnibal.sim.step import expected_max
from sim_helpers import random_features, random_table


@pytest.mark.parametrize("num_ranks", [2, 3, 8, 64])
def test_expected_max_matches_monte_carlo(num_ranks):
    rng = np.random.default_rng(num_ranks)
    means = rng.uniform(0.8, 1.2, num_ranks)
    draws = means * (1 + 0.08 * rng.standard_normal((200_000, num_ranks)))
    assert expected_max(means, 0.08) == pytest.approx(draws.max(axis=1).mean(), rel=3e-3)


def test_expected_max_of_two_equal_is_exact():
    # E[max(X1, X2)] for iid N(m, s^2) is m + s / sqrt(pi)
    assert expected_max(np.array([2.0, 2.0]), 0.1) == pytest.approx(2.0 + 0.2 / np.sqrt(np.pi), rel=1e-6)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.01, 100.0), min_size=1, max_size=16), st.floats(0.0, 0.3))
def test_expected_max_bounds(values, sd):
    means = np.array(values)
    got = expected_max(means, sd)
    assert got >= means.max() - 1e-9  # never below the slowest mean
    assert got <= means.max() * (1 + sd * np.sqrt(2 * np.log(len(means)) + 1)) + 1e-9


def test_no_jitter_and_one_rank_unchanged():
    table = random_table(8, seed=1)
    feats = random_features(5, 1, 4, seed=2)
    base = simulate_epoch(table, [0, 4, 8], None, feats, SimConfig())
    jit = simulate_epoch(table, [0, 4, 8], None, feats, SimConfig(compute_jitter=0.1))
    np.testing.assert_allclose(jit.step_time, base.step_time)  # one DP rank: nothing to wait for


def test_more_ranks_wait_longer():
    table = random_table(8, seed=3)
    one = random_features(4, 1, 4, seed=5)
    times = []
    for dp in (1, 2, 8, 32):
        feats = np.repeat(one, dp, axis=1)  # every rank the same predicted work
        res = simulate_epoch(table, [0, 8], None, feats, SimConfig(dp_size=dp, compute_jitter=0.05,
                                                                  dp_bandwidth=1e30, dp_latency=0.0))
        times.append(res.step_time.mean())
        assert (res.sync_wait >= 0).all()
    assert times == sorted(times) and times[-1] > times[0] * 1.05
    with pytest.raises(InputError, match="compute_jitter"):
        simulate_epoch(table, [0, 8], None, one, SimConfig(compute_jitter=-0.1))


def test_rank_jitter_recovers_the_noise_and_ignores_shared_drift():
    table = random_table(9, seed=7)
    feats = random_features(400, 4, 3, seed=8)  # [S, D, M, 4]
    pred = (table.evaluate("fwd_time", feats).sum(axis=(-1, -2)) + table.evaluate("bwd_time", feats).sum(axis=(-1, -2)))
    rng = np.random.default_rng(0)
    drift = rng.uniform(0.7, 1.4, (400, 1))  # the machine's speed, shared by all ranks of a step
    times = 1.3 * pred * drift * (1 + 0.06 * rng.standard_normal(pred.shape))
    assert rank_jitter(table, feats, np.zeros(9, bool), times) == pytest.approx(0.06, rel=0.1)
    with pytest.raises(InputError, match="2 DP ranks"):
        rank_jitter(table, feats[:, :1], np.zeros(9, bool), times[:, :1])
    with pytest.raises(InputError, match="step_times"):
        rank_jitter(table, feats, np.zeros(9, bool), times[:, :2])
