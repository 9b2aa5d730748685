"""Invariants of the pipeline-schedule engine (pure logic, no costs involved)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.sim.pipeline_order import (
    BWD,
    FWD,
    device_op_order,
    global_op_order,
    peak_inflight,
    simulate_pipeline,
)
from omnibal.sim.step import ring_allreduce_time, simulate_steps

SCHEDULES = ("gpipe", "1f1b")


@pytest.mark.parametrize("pp_schedule", SCHEDULES)
@pytest.mark.parametrize("num_mb", [1, 3, 8])
def test_one_stage_has_no_bubble(pp_schedule, num_mb):
    rng = np.random.default_rng(0)
    fwd = rng.uniform(0.1, 2.0, (5, num_mb, 1))
    bwd = rng.uniform(0.1, 2.0, (5, num_mb, 1))
    rec = rng.uniform(0.0, 1.0, (5, num_mb, 1))
    out = simulate_pipeline(fwd, bwd, rec, pp_schedule=pp_schedule)
    np.testing.assert_allclose(out.bubble, 0.0, atol=1e-12)
    np.testing.assert_allclose(out.makespan, (fwd + bwd + rec).sum(axis=(-2, -1)))


@pytest.mark.parametrize("pp_schedule", SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (4, 2), (8, 32), (3, 7)])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0), (0.3, 0.9)])
def test_equal_microbatch_bubble_formula(pp_schedule, p, m, f, b):
    out = simulate_pipeline(np.full((m, p), f), np.full((m, p), b), pp_schedule=pp_schedule)
    assert out.makespan == pytest.approx((m + p - 1) * (f + b))
    assert out.bubble == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (4, 2), (4, 4), (4, 9), (8, 3), (8, 16)])
def test_peak_inflight_per_stage(p, m):
    np.testing.assert_array_equal(peak_inflight("1f1b", p, m), [min(p - s, m) for s in range(p)])
    np.testing.assert_array_equal(peak_inflight("gpipe", p, m), [m] * p)


def test_peak_activation_bytes_follow_inflight_microbatches():
    p, m = 4, 6
    act = np.arange(1, m + 1, dtype=float)[:, None] * np.ones((m, p))  # micro-batch i holds i+1 bytes
    out = simulate_pipeline(np.ones((m, p)), np.ones((m, p)), act_bytes=act, pp_schedule="1f1b")
    # stage s under 1F1B holds micro-batches 0..p-s-1 at its peak at first, later windows slide forward;
    # the biggest window of p-s consecutive micro-batches is the last one
    expected = [act[m - min(p - s, m):, s].sum() for s in range(p)]
    np.testing.assert_allclose(out.peak_act_bytes, expected)
    gp = simulate_pipeline(np.ones((m, p)), np.ones((m, p)), act_bytes=act, pp_schedule="gpipe")
    np.testing.assert_allclose(gp.peak_act_bytes, act.sum(axis=0))


def test_transient_bytes_add_only_during_backward():
    p, m = 2, 2
    act = np.ones((m, p))
    trans = np.full((m, p), 10.0)
    out = simulate_pipeline(np.ones((m, p)), np.ones((m, p)), act_bytes=act, transient_bytes=trans)
    # stage 0 holds 2 micro-batches during its first backward, stage 1 holds 1
    np.testing.assert_allclose(out.peak_act_bytes, [12.0, 11.0])


@pytest.mark.parametrize("pp_schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
def test_op_order_respects_dependencies_and_covers_every_op(pp_schedule, chunks):
    for p in (1, 2, 5):
        for m in (1, 2, 7) if chunks == 1 else (p, 2 * p, 3 * p):
            order = global_op_order(pp_schedule, p, m, chunks)
            v = p * chunks
            assert len(order) == len(set(order)) == 2 * v * m
            seen = set()
            for d, kind, mb, k in order:
                assert k % p == d
                if kind == FWD and k > 0:
                    assert (FWD, mb, k - 1) in seen
                if kind == BWD:
                    assert (FWD, mb, k) in seen
                    if k < v - 1:
                        assert (BWD, mb, k + 1) in seen
                seen.add((kind, mb, k))
            for d in range(p):
                assert [o[1:] for o in order if o[0] == d] == list(device_op_order(pp_schedule, p, m, d, chunks))


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 3, 4), (4, 2, 8), (4, 3, 4), (4, 4, 16), (8, 2, 16)])
def test_interleaved_bubble_formula(p, v, m):
    f, b = 1.0, 2.0  # a device's whole forward / backward per micro-batch, split over its v chunks
    out = simulate_pipeline(np.full((m, p * v), f / v), np.full((m, p * v), b / v), pp_schedule="interleaved",
                            num_chunks=v)
    assert out.makespan == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)
    assert out.bubble == pytest.approx((p - 1) / (v * m + p - 1))
    np.testing.assert_allclose(out.busy, m * (f + b))
    # a device holds its warm-up chunks plus one (Megatron: 2 (P - d - 1) + (v - 1) P + 1); with M == P
    # Megatron runs every forward first (all M * v chunks in flight)
    expected = [m * v if m == p else min(2 * (p - d - 1) + (v - 1) * p + 1, m * v) for d in range(p)]
    np.testing.assert_array_equal(out.peak_inflight, expected)


def test_interleaved_layout_is_checked():
    with pytest.raises(InputError, match="divisible"):
        simulate_pipeline(np.ones((3, 4)), np.ones((3, 4)), pp_schedule="interleaved", num_chunks=2)
    with pytest.raises(InputError, match="num_chunks"):
        simulate_pipeline(np.ones((2, 4)), np.ones((2, 4)), pp_schedule="1f1b", num_chunks=2)
    with pytest.raises(InputError, match="chunks"):
        simulate_pipeline(np.ones((2, 4)), np.ones((2, 4)), pp_schedule="interleaved", num_chunks=1)


def test_p2p_delays_receiver():
    # two stages, one micro-batch: F0 -> send -> F1 -> B1 -> send -> B0
    out = simulate_pipeline(np.ones((1, 2)), np.full((1, 2), 2.0), None, np.full((1, 1), 0.5), keep_timeline=True)
    assert out.fwd_start[0, 1] == pytest.approx(1.5)
    assert out.bwd_start[0, 0] == pytest.approx(1.5 + 1 + 2 + 0.5)
    assert out.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)


def test_recompute_runs_inside_backward_op():
    out = simulate_pipeline(np.ones((2, 1)), np.ones((2, 1)), np.full((2, 1), 0.5), keep_timeline=True)
    np.testing.assert_allclose(out.bwd_end - out.bwd_start, 1.5)
    np.testing.assert_allclose(out.busy, [5.0])


def test_bad_inputs_name_the_field():
    with pytest.raises(InputError, match="pp_schedule"):
        simulate_pipeline(np.ones((2, 2)), np.ones((2, 2)), pp_schedule="zigzag")
    with pytest.raises(InputError, match="bwd"):
        simulate_pipeline(np.ones((2, 2)), np.ones((3, 2)))
    with pytest.raises(InputError, match="fwd"):
        simulate_pipeline(-np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(InputError, match="dp_bandwidth"):
        ring_allreduce_time(1.0, 4, 0.0, 0.0)


def test_ring_allreduce_formula():
    assert ring_allreduce_time(1e9, 1, 1e9, 1e-3) == 0.0
    assert ring_allreduce_time(1e9, 4, 1e9, 1e-3) == pytest.approx(1.5 + 6e-3)
    assert ring_allreduce_time(0.0, 4, 1e9, 1e-3) == 0.0  # frozen stage: nothing to sync


def test_step_time_takes_slowest_rank_then_sync():
    s, d, m, p = 3, 4, 5, 2
    rng = np.random.default_rng(1)
    fwd = rng.uniform(0.5, 1.5, (s, d, m, p))
    bwd = 2 * fwd
    ar = np.array([0.3, 0.7])
    out = simulate_steps(fwd, bwd, allreduce_time=ar, step_overhead=0.05)
    pipe = simulate_pipeline(fwd, bwd)
    expected = (pipe.stage_end.max(axis=1) + ar).max(axis=-1) + 0.05
    np.testing.assert_allclose(out.step_time, expected)
    assert (out.step_time >= pipe.makespan.max(axis=1)).all()
    assert (out.sync_wait >= 0).all() and (out.idle >= 0).all()
    np.testing.assert_allclose(out.sync_wait.min(axis=1), 0.0)


def test_memory_and_oom_flags():
    fwd = np.ones((1, 1, 4, 2))
    out = simulate_steps(fwd, fwd, act_bytes=np.full(fwd.shape, 10.0), static_bytes=np.array([100.0, 50.0]),
                         memory_budget=115.0)
    np.testing.assert_allclose(out.peak_memory[0, 0], [120.0, 60.0])
    np.testing.assert_array_equal(out.oom[0, 0], [True, False])


# ---------------------------------------------------------------- property tests

shapes = st.tuples(st.integers(1, 5), st.integers(1, 6))  # (P, M)


@st.composite
def pipelines(draw):
    p, m = draw(shapes)
    pp_schedule = draw(st.sampled_from(SCHEDULES + ("interleaved",)))
    chunks = 1
    if pp_schedule == "interleaved":
        chunks = draw(st.integers(2, 3))
        m = p * draw(st.integers(1, 3))
        p = p * chunks  # virtual stages
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    batch = draw(st.integers(1, 4))
    scale = rng.uniform(0.0, 3.0, size=(batch, m, p)) * (rng.random((batch, m, p)) > 0.1)
    return dict(
        fwd=scale,
        bwd=rng.uniform(0.0, 3.0, (batch, m, p)),
        recompute=rng.uniform(0.0, 1.0, (batch, m, p)) * (rng.random((batch, m, p)) > 0.5),
        p2p_fwd=rng.uniform(0.0, 0.5, (batch, m, p - 1)),
        p2p_bwd=rng.uniform(0.0, 0.5, (batch, m, p - 1)),
        pp_schedule=pp_schedule,
        num_chunks=chunks,
    )


@settings(max_examples=150, deadline=None)
@given(pipelines())
def test_makespan_bounds(case):
    out = simulate_pipeline(**case)
    f, b, r = case["fwd"], case["bwd"], case["recompute"]
    busy_v = (f + b + r).sum(axis=-2)
    busy = busy_v.reshape(busy_v.shape[:-1] + (case["num_chunks"], -1)).sum(axis=-2)  # per device
    np.testing.assert_allclose(out.busy, busy)
    assert (out.makespan >= busy.max(axis=-1) - 1e-9).all()
    # critical path of each micro-batch: forward through all stages and back, with its transfers
    chain = (f + b + r).sum(axis=-1) + case["p2p_fwd"].sum(axis=-1) + case["p2p_bwd"].sum(axis=-1)
    assert (out.makespan >= chain.max(axis=-1) - 1e-9).all()
    assert (out.bubble >= -1e-12).all() and (out.bubble <= 1).all()


@settings(max_examples=150, deadline=None)
@given(pipelines(), st.integers(0, 4), st.sampled_from(["fwd", "bwd", "recompute", "p2p_fwd", "p2p_bwd"]),
       st.floats(0.0, 5.0))
def test_makespan_is_monotone_in_every_op_time(case, which_item, key, extra):
    base = simulate_pipeline(**case)
    arr = case[key].copy()
    assume(arr.size > 0)
    idx = np.unravel_index(which_item % arr.size, arr.shape)
    arr[idx] += extra
    slower = simulate_pipeline(**{**case, key: arr})
    assert (slower.makespan >= base.makespan - 1e-9).all()
    assert (slower.stage_end >= base.stage_end - 1e-9).all()


@settings(max_examples=100, deadline=None)
@given(pipelines())
def test_vectorised_equals_per_item(case):
    act = np.arange(case["fwd"].size, dtype=float).reshape(case["fwd"].shape) % 7
    whole = simulate_pipeline(**case, act_bytes=act, transient_bytes=act / 2, keep_timeline=True)
    for i in range(case["fwd"].shape[0]):
        one = simulate_pipeline(**{k: (v[i] if isinstance(v, np.ndarray) else v) for k, v in case.items()},
                                act_bytes=act[i], transient_bytes=act[i] / 2, keep_timeline=True)
        np.testing.assert_allclose(whole.makespan[i], one.makespan)
        np.testing.assert_allclose(whole.stage_end[i], one.stage_end)
        np.testing.assert_allclose(whole.peak_act_bytes[i], one.peak_act_bytes)
        np.testing.assert_allclose(whole.bwd_end[i], one.bwd_end)
        np.testing.assert_allclose(whole.fwd_start[i], one.fwd_start)


@settings(max_examples=100, deadline=None)
@given(pipelines())
def test_timeline_is_consistent(case):
    out = simulate_pipeline(**case, keep_timeline=True)
    np.testing.assert_allclose(out.fwd_end - out.fwd_start, case["fwd"])
    np.testing.assert_allclose(out.bwd_end - out.bwd_start, case["bwd"] + case["recompute"])
    # no two ops of one device overlap
    v, m = case["num_chunks"], case["fwd"].shape[-2]
    p = case["fwd"].shape[-1] // v
    for d in range(p):
        ops = device_op_order(case["pp_schedule"], p, m, d, v)
        starts = np.stack([(out.fwd_start if k == FWD else out.bwd_start)[..., mb, vs] for k, mb, vs in ops], -1)
        ends = np.stack([(out.fwd_end if k == FWD else out.bwd_end)[..., mb, vs] for k, mb, vs in ops], -1)
        assert (starts[..., 1:] >= ends[..., :-1] - 1e-9).all()
