"""Calibration of the simulator's compute scales from single-process step times."""

from __future__ import annotations

import numpy as np
import pytest

from omnibal.errors import InputError
from omnibal.sim.calibrate import Calibration, CalibrationRun, calibrate, nonneg_lstsq
from omnibal.sim.costs import SimConfig
from omnibal.sim.epoch import simulate_epoch
from sim_helpers import random_features, random_table


def _kinds_table(num_layers=9, seed=0):
    table = random_table(num_layers, seed=seed)
    num_vision = num_layers // 3
    from dataclasses import replace

    kinds = tuple(["vision_embed"] + ["vision_block"] * (num_vision - 1) + ["llm_embed"]
                  + ["llm_block"] * (num_layers - num_vision - 2) + ["lm_head"])
    return replace(table, kinds=kinds)


def _measure(true_table, feats, rec, overhead):
    res = simulate_epoch(true_table, [0, true_table.num_layers], rec, feats, SimConfig(step_overhead=overhead))
    return res.step_time


def test_recovers_known_scales_and_overhead():
    table = _kinds_table()
    truth = Calibration(groups=("vision", "llm"), fwd_scale=(1.7, 0.6), bwd_scale=(2.2, 0.9), step_overhead=0.3,
                        rel_rms_error=0.0, num_steps=0)
    true_table = truth.apply(table)
    runs = []
    for seed, rec in ((1, np.zeros(9, bool)), (2, np.ones(9, bool))):
        feats = random_features(12, 1, 4, seed=seed)
        runs.append(CalibrationRun(feats[:, 0], rec, _measure(true_table, feats, rec, 0.3)))
    cal = calibrate(table, runs, separate_backward=True)
    np.testing.assert_allclose(cal.fwd_scale, truth.fwd_scale, rtol=1e-6)
    np.testing.assert_allclose(cal.bwd_scale, truth.bwd_scale, rtol=1e-6)
    assert cal.step_overhead == pytest.approx(0.3, rel=1e-6)
    assert cal.rel_rms_error < 1e-9
    # the calibrated table predicts a held-out run exactly
    feats = random_features(5, 1, 3, seed=9)
    rec = np.arange(9) % 2 == 0
    pred = simulate_epoch(cal.apply(table), [0, 9], rec, feats, SimConfig(step_overhead=cal.step_overhead))
    np.testing.assert_allclose(pred.step_time, _measure(true_table, feats, rec, 0.3))


def test_noisy_measurements_give_close_scales():
    table = _kinds_table(seed=3)
    truth = Calibration(groups=("vision", "llm"), fwd_scale=(1.0, 1.0), bwd_scale=(2.0, 2.0), step_overhead=0.05,
                        rel_rms_error=0.0, num_steps=0)
    rng = np.random.default_rng(0)
    runs = []
    for seed, rec in ((1, np.zeros(9, bool)), (2, np.ones(9, bool))):
        feats = random_features(40, 1, 4, seed=seed)
        y = _measure(truth.apply(table), feats, rec, 0.05) * rng.normal(1.0, 0.02, 40)
        runs.append(CalibrationRun(feats[:, 0], rec, y))
    cal = calibrate(table, runs, separate_backward=True)
    assert 0.01 < cal.rel_rms_error < 0.05
    np.testing.assert_allclose(cal.bwd_scale, 2.0, rtol=0.15)


def test_nonneg_lstsq_never_negative():
    rng = np.random.default_rng(0)
    a = rng.random((30, 4))
    b = a @ np.array([1.0, -2.0, 0.5, 0.0]) + 3
    x = nonneg_lstsq(a, b)
    assert (x >= 0).all()


def test_bad_calibration_inputs():
    table = _kinds_table()
    feats = random_features(3, 1, 2)[:, 0]
    with pytest.raises(InputError, match="runs"):
        calibrate(table, [])
    with pytest.raises(InputError, match="step_times"):
        calibrate(table, [CalibrationRun(feats, np.zeros(9, bool), np.ones(2))])
    with pytest.raises(InputError, match="groups"):
        calibrate(table, [CalibrationRun(feats, np.zeros(9, bool), np.ones(3))], groups=("audio",))


def test_one_scale_per_group_keeps_the_backward_ratio():
    table = _kinds_table(seed=5)
    truth = Calibration(groups=("vision", "llm"), fwd_scale=(1.5, 0.8), bwd_scale=(1.5, 0.8), step_overhead=0.1,
                        rel_rms_error=0.0, num_steps=0)
    feats = random_features(6, 1, 4, seed=4)
    rec = np.zeros(9, bool)
    cal = calibrate(table, [CalibrationRun(feats[:, 0], rec, _measure(truth.apply(table), feats, rec, 0.1))],
                    separate_backward=False)
    np.testing.assert_allclose(cal.fwd_scale, (1.5, 0.8), rtol=1e-6)
    assert cal.bwd_scale == cal.fwd_scale


def test_per_stage_runs_separate_vision_from_llm():
    table = _kinds_table(seed=6)
    truth = Calibration(groups=("vision", "llm"), fwd_scale=(1.4, 0.7), bwd_scale=(1.4, 0.7), step_overhead=0.05,
                        rel_rms_error=0.0, num_steps=0)
    true_table = truth.apply(table)
    feats = random_features(6, 1, 4, seed=8)
    rec = np.zeros(9, bool)
    runs = []
    for layers in ((0, 3), (3, 9)):  # one rank's own compute in a 2-stage pipeline
        sub = simulate_epoch(true_table, [0, 9], rec, feats, SimConfig(step_overhead=0.05))  # whole model
        part = (true_table.evaluate("fwd_time", feats)[..., layers[0]:layers[1]].sum(axis=(-1, -2))
                + true_table.evaluate("bwd_time", feats)[..., layers[0]:layers[1]].sum(axis=(-1, -2)))[:, 0]
        runs.append(CalibrationRun(feats[:, 0], rec, part + 0.05, layers=layers))
        assert (sub.step_time > part).all()
    cal = calibrate(table, runs)  # the default: one scale per group
    np.testing.assert_allclose(cal.fwd_scale, (1.4, 0.7), rtol=1e-6)
    with pytest.raises(InputError, match="layers"):
        calibrate(table, [CalibrationRun(feats[:, 0], rec, part, layers=(5, 12))])


def test_recovers_the_shared_host_slowdown():
    """Ranks sharing a host compute 1.15x slower: fitted from runs of both kinds, it is recovered with the
    group scales and the overhead, and ``apply(shared_host=True)`` predicts a held-out shared run."""
    from omnibal.sim.calibrate import design_matrix

    table = _kinds_table(seed=4)
    truth = Calibration(groups=("vision", "llm"), fwd_scale=(1.3, 0.8), bwd_scale=(1.3, 0.8), step_overhead=0.05,
                        rel_rms_error=0.0, num_steps=0, shared_host_scale=1.15)
    runs = []
    for seed, rec, shared, layers in ((1, np.zeros(9, bool), False, None), (2, np.ones(9, bool), False, None),
                                      (3, np.zeros(9, bool), True, (0, 4)), (4, np.zeros(9, bool), True, (4, 9))):
        feats = random_features(10, 1, 4, seed=seed)[:, 0]
        true_table = truth.apply(table, shared_host=shared)
        # a rank's own time: the sum of its layers' costs (one stage of a pipeline when ``layers`` is set)
        probe = CalibrationRun(feats, rec, np.ones(len(feats)), layers=layers)
        y = design_matrix(true_table, probe, ("all",), separate_backward=False)[:, 0] + 0.05
        runs.append(CalibrationRun(feats, rec, y, layers=layers, shared_host=shared))
    cal = calibrate(table, runs)
    assert cal.shared_host_scale == pytest.approx(1.15, rel=1e-6)
    np.testing.assert_allclose(cal.fwd_scale, truth.fwd_scale, rtol=1e-6)
    assert cal.step_overhead == pytest.approx(0.05, rel=1e-6)
    assert cal.rel_rms_error < 1e-9
    feats = random_features(5, 1, 3, seed=9)
    rec = np.zeros(9, bool)
    pred = simulate_epoch(cal.apply(table, shared_host=True), [0, 9], rec, feats, SimConfig(step_overhead=0.05))
    want = simulate_epoch(truth.apply(table, shared_host=True), [0, 9], rec, feats, SimConfig(step_overhead=0.05))
    np.testing.assert_allclose(pred.step_time, want.step_time, rtol=1e-9)
    assert cal.to_dict()["shared_host_scale"] == pytest.approx(1.15, rel=1e-6)


def test_shared_host_scale_needs_both_kinds_of_run():
    table = _kinds_table(seed=5)
    feats = random_features(8, 1, 4, seed=1)
    rec = np.zeros(9, bool)
    y = simulate_epoch(table, [0, 9], rec, feats, SimConfig(step_overhead=0.0)).step_time * 1.2
    for shared in (False, True):  # all alone or all shared: the factor cannot be told from the group scales
        cal = calibrate(table, [CalibrationRun(feats[:, 0], rec, y, shared_host=shared)], groups=("all",))
        assert cal.shared_host_scale == 1.0
        assert cal.fwd_scale[0] == pytest.approx(1.2, rel=1e-6)


def test_skewed_noise_does_not_bias_the_scale():
    """Step times with right-skewed noise of mean 1 (a shared machine: some steps much slower): the fitted
    scale predicts the mean step, where weighting by the measured times would come out ~8% low
    (E[1/n] / E[1/n^2] = exp(-2 sigma^2) for lognormal noise n)."""
    table = _kinds_table(seed=6)
    rng = np.random.default_rng(1)
    feats = random_features(400, 1, 4, seed=2)
    rec = np.zeros(9, bool)
    truth = _measure(table, feats, rec, 0.0) * 1.3
    sigma = 0.2
    noise = rng.lognormal(-sigma ** 2 / 2, sigma, len(truth))  # mean 1
    cal = calibrate(table, [CalibrationRun(feats[:, 0], rec, truth * noise)], groups=("all",))
    assert cal.fwd_scale[0] == pytest.approx(1.3, rel=0.02)


@pytest.mark.parametrize("center", [-1.3, 0.0, 0.37, 1.38])
def test_golden_section_finds_the_minimum(center):
    from omnibal.sim.calibrate import golden_section_min

    # tolerance sqrt(eps): f is flat there
    assert golden_section_min(lambda v: (v - center) ** 2 + 1.0, -1.4, 1.4) == pytest.approx(center, abs=1e-6)
    # a minimum at the edge of the interval is approached, not missed
    assert golden_section_min(lambda v: v, -1.4, 1.4) == pytest.approx(-1.4, abs=1e-6)
