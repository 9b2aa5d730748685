"""The glue from a LayerCostTable + plan to the schedule engine, and epoch totals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.sim.costs import (
    SimConfig,
    cuts_from_starts,
    even_cuts,
    recompute_mask_from_counts,
    stage_costs,
    validate_cuts,
)
from omnibal.sim.epoch import score_plan, simulate_epoch, simulate_one_step
from omnibal.sim.pipeline_order import simulate_pipeline
from sim_helpers import random_features, random_table


def test_stage_sums_match_per_layer_evaluation():
    table = random_table(12, tp=True)
    feats = random_features(3, 2, 4)
    cuts = np.array([0, 3, 7, 12])
    rec = np.zeros(12, bool)
    rec[[1, 2, 8]] = True
    c = stage_costs(table, cuts, rec, feats, SimConfig(dp_size=2, p2p_bandwidth=1e9, p2p_latency=1e-4))
    fwd_l = table.evaluate("fwd_time", feats) + 0.5 * table.evaluate("tp_comm_time", feats)
    bwd_l = table.evaluate("bwd_time", feats) + 0.5 * table.evaluate("tp_comm_time", feats)
    act_l = np.where(rec, table.evaluate("ckpt_bytes", feats), table.evaluate("act_bytes", feats))
    extra_l = (table.evaluate("act_bytes", feats) - table.evaluate("ckpt_bytes", feats)) * rec
    for s in range(3):
        sl = slice(cuts[s], cuts[s + 1])
        np.testing.assert_allclose(c.fwd[..., s], fwd_l[..., sl].sum(-1))
        np.testing.assert_allclose(c.bwd[..., s], bwd_l[..., sl].sum(-1))
        np.testing.assert_allclose(c.recompute[..., s], (fwd_l * rec)[..., sl].sum(-1))
        np.testing.assert_allclose(c.act_bytes[..., s], act_l[..., sl].sum(-1))
        np.testing.assert_allclose(c.transient_bytes[..., s], extra_l[..., sl].max(-1))
    for s in range(2):
        np.testing.assert_allclose(c.p2p[..., s], table.evaluate("out_bytes", feats)[..., cuts[s + 1] - 1] / 1e9 + 1e-4)
    np.testing.assert_allclose(c.grad_bytes, [table.grad_bytes[cuts[s]:cuts[s + 1]].sum() for s in range(3)])


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_static_memory_follows_zero_stage(zero_stage):
    table = random_table(6)
    cuts = np.array([0, 2, 6])
    c = stage_costs(table, cuts, None, random_features(1, 4, 2), SimConfig(dp_size=4, zero_stage=zero_stage))
    for s in range(2):
        sl = slice(cuts[s], cuts[s + 1])
        p, g, o = table.param_bytes[sl].sum(), table.grad_bytes[sl].sum(), table.optim_bytes[sl].sum()
        expected = p + (g / 4 if zero_stage >= 2 else g) + (o / 4 if zero_stage >= 1 else o)
        assert c.static_bytes[s] == pytest.approx(expected)


def test_recompute_trades_memory_for_time():
    table = random_table(9)
    feats = random_features(4, 2, 6)
    cfg = SimConfig(dp_size=2)
    cuts = even_cuts(9, 3)
    none = simulate_epoch(table, cuts, np.zeros(9, bool), feats, cfg)
    full = simulate_epoch(table, cuts, np.ones(9, bool), feats, cfg)
    assert (full.step_time > none.step_time).all()
    assert (full.peak_memory < none.peak_memory).all()


def test_one_stage_epoch_is_sum_of_work_plus_overhead():
    table = random_table(5)
    feats = random_features(3, 1, 4)
    res = simulate_epoch(table, [0, 5], None, feats, SimConfig(step_overhead=0.25))
    work = table.evaluate("fwd_time", feats).sum(axis=(-1, -2)) + table.evaluate("bwd_time", feats).sum(axis=(-1, -2))
    np.testing.assert_allclose(res.step_time, work[:, 0] + 0.25)
    np.testing.assert_allclose(res.bubble, 0.0, atol=1e-12)
    assert res.gpu_days == pytest.approx(res.total_time / 86400)


def test_gpu_days_count_every_device():
    table = random_table(8)
    res = simulate_epoch(table, even_cuts(8, 4), None, random_features(2, 3, 4), SimConfig(dp_size=3, tp_size=2))
    assert res.num_gpus == 24
    assert res.gpu_days == pytest.approx(res.step_time.sum() * 24 / 86400)


def test_dp_allreduce_and_slowest_rank_set_step_time():
    table = random_table(8)
    feats = random_features(5, 4, 3)
    cfg = SimConfig(dp_size=4, dp_bandwidth=1e8, dp_latency=1e-3)
    res = simulate_epoch(table, even_cuts(8, 2), None, feats, cfg)
    costs = stage_costs(table, even_cuts(8, 2), None, feats, cfg)
    pipe = simulate_pipeline(costs.fwd, costs.bwd, costs.recompute, costs.p2p)
    ar = 2 * 3 / 4 * costs.grad_bytes / 1e8 + 6 * 1e-3
    np.testing.assert_allclose(res.allreduce_time, ar)
    np.testing.assert_allclose(res.step_time, (pipe.stage_end.max(axis=1) + ar).max(axis=-1))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.integers(1, 5), st.sampled_from(["gpipe", "1f1b"]), st.integers(0, 10_000))
def test_chunking_does_not_change_results(num_steps, num_mb, pp_schedule, seed):
    table = random_table(7, seed=seed % 5)
    feats = random_features(num_steps, 2, num_mb, seed=seed)
    cfg = SimConfig(dp_size=2, pp_schedule=pp_schedule, memory_budget_bytes=5e9)
    rec = np.arange(7) % 2 == 0
    whole = simulate_epoch(table, [0, 2, 5, 7], rec, feats, cfg)
    chunked = simulate_epoch(table, [0, 2, 5, 7], rec, feats, cfg, max_chunk_microbatches=2 * num_mb)
    np.testing.assert_allclose(whole.step_time, chunked.step_time)
    np.testing.assert_allclose(whole.peak_memory, chunked.peak_memory)
    np.testing.assert_array_equal(whole.oom, chunked.oom)
    score = score_plan(table, [0, 2, 5, 7], rec, feats, cfg)
    assert score.total_time == pytest.approx(whole.total_time)
    np.testing.assert_allclose(score.peak_memory, whole.peak_memory.max(axis=(0, 1)))
    assert score.oom == bool(whole.oom.any())


def test_one_step_timeline_matches_epoch_step():
    table = random_table(8)
    feats = random_features(3, 2, 4)
    cfg = SimConfig(dp_size=2)
    res = simulate_epoch(table, even_cuts(8, 4), None, feats, cfg)
    costs, step = simulate_one_step(table, even_cuts(8, 4), None, feats[1], cfg)
    assert step.step_time[0] == pytest.approx(res.step_time[1])
    assert step.pipeline.fwd_start.shape == (1, 2, 4, 4)


def test_summary_is_json_ready():
    import json

    table = random_table(8)
    res = simulate_epoch(table, even_cuts(8, 2), None, random_features(2, 2, 3),
                         SimConfig(dp_size=2, memory_budget_bytes=1.0))
    summary = json.loads(json.dumps(res.summary()))
    assert summary["oom_steps"] == 2 and len(summary["stages"]) == 2


def test_partition_helpers():
    np.testing.assert_array_equal(even_cuts(10, 3), [0, 4, 7, 10])  # the one even split: the extra layer goes first
    np.testing.assert_array_equal(cuts_from_starts([0, 4, 6], 10), [0, 4, 6, 10])
    np.testing.assert_array_equal(recompute_mask_from_counts([0, 3, 5], [2, 0]), [1, 1, 0, 0, 0])


@pytest.mark.parametrize("cuts,match", [([1, 5, 10], "start at 0"), ([0, 5, 9], "end at"), ([0, 5, 5, 10], "stage 1"),
                                        ([0.0, 10.0], "integers")])
def test_bad_cuts_are_named(cuts, match):
    with pytest.raises(InputError, match=match):
        validate_cuts(np.asarray(cuts), 10)


def test_bad_inputs_are_named():
    table = random_table(6)
    with pytest.raises(InputError, match="stage 1 has 3 layers"):
        recompute_mask_from_counts([0, 3, 6], [1, 4])
    with pytest.raises(InputError, match="dp_size"):
        simulate_epoch(table, [0, 6], None, random_features(1, 2, 2), SimConfig(dp_size=4))
    with pytest.raises(InputError, match="p2p_bandwidth"):
        simulate_epoch(table, [0, 6], None, random_features(1, 1, 2), SimConfig(p2p_bandwidth=0.0))
    with pytest.raises(InputError, match="recompute"):
        stage_costs(table, [0, 6], np.ones(5, bool), random_features(1, 1, 2), SimConfig())
    with pytest.raises(ValueError, match="pp_size"):
        even_cuts(3, 4)


def test_p2p_occupancy_keeps_both_ends_busy():
    table = random_table(6)
    feats = random_features(2, 1, 3)
    cuts = [0, 2, 4, 6]
    base = stage_costs(table, cuts, None, feats, SimConfig(p2p_bandwidth=1e8))
    occ = stage_costs(table, cuts, None, feats, SimConfig(p2p_bandwidth=1e8, p2p_occupancy=0.5))
    np.testing.assert_allclose(occ.fwd[..., 0] - base.fwd[..., 0], 0.5 * base.p2p[..., 0])
    np.testing.assert_allclose(occ.bwd[..., 1] - base.bwd[..., 1], 0.5 * (base.p2p[..., 0] + base.p2p[..., 1]))
    np.testing.assert_allclose(occ.fwd[..., 2] - base.fwd[..., 2], 0.5 * base.p2p[..., 1])
    with pytest.raises(InputError, match="p2p_occupancy"):
        SimConfig(p2p_occupancy=1.5).validate()


def test_config_for_hardware_picks_links_by_rank_layout():
    from omnibal.cost.hardware import get_hardware
    from omnibal.sim.costs import config_for_hardware

    hw = get_hardware("a100-80g")
    intra_bw, intra_lat = hw.link(inter_node=False)
    inter_bw, inter_lat = hw.link(inter_node=True)
    small = config_for_hardware(hw, dp_size=2, pp_size=4)  # 8 GPUs: one node
    assert (small.p2p_bandwidth, small.dp_bandwidth) == (intra_bw, intra_bw)
    big = config_for_hardware(hw, dp_size=128, pp_size=4, tp_size=1)
    assert (big.p2p_bandwidth, big.p2p_latency) == (inter_bw, inter_lat)
    assert big.dp_bandwidth == inter_bw
    assert big.memory_budget_bytes == pytest.approx(0.95 * hw.memory_bytes)
    assert big.p2p_occupancy == 0.0
    with pytest.raises(InputError, match="dp_size"):
        config_for_hardware(hw, dp_size=0, pp_size=4)


def test_buffer_features_set_only_the_transfer_bytes():
    table = random_table(6)
    feats = random_features(2, 2, 3)
    buf = np.broadcast_to(feats.max(axis=(0, 1, 2)), feats.shape)
    cfg = SimConfig(dp_size=2, p2p_bandwidth=1e8)
    plain = stage_costs(table, [0, 3, 6], None, feats, cfg)
    fixed = stage_costs(table, [0, 3, 6], None, feats, cfg, buffer_features=buf)
    np.testing.assert_allclose(fixed.fwd, plain.fwd)
    np.testing.assert_allclose(fixed.act_bytes, plain.act_bytes)
    np.testing.assert_allclose(fixed.p2p[..., 0], table.evaluate("out_bytes", buf)[..., 2] / 1e8 + cfg.p2p_latency)
    assert (fixed.p2p >= plain.p2p).all()
    a = simulate_epoch(table, [0, 3, 6], None, feats, cfg, buffer_features=buf)
    b = simulate_epoch(table, [0, 3, 6], None, feats, cfg, buffer_features=buf, max_chunk_microbatches=6)
    np.testing.assert_allclose(a.step_time, b.step_time)
    assert (a.step_time >= simulate_epoch(table, [0, 3, 6], None, feats, cfg).step_time - 1e-12).all()


def test_interleaved_epoch_counts_devices_and_chunk_memory():
    table = random_table(16)
    feats = random_features(3, 2, 4)
    cuts = even_cuts(16, 8)  # 4 devices x 2 chunks
    cfg = SimConfig(dp_size=2, pp_schedule="interleaved", num_chunks=2)
    res = simulate_epoch(table, cuts, None, feats, cfg)
    assert res.num_stages == 4 and res.num_gpus == 8
    assert res.busy.shape == (3, 2, 4) and res.peak_memory.shape == (3, 2, 4)
    costs = stage_costs(table, cuts, None, feats, cfg)
    np.testing.assert_allclose(res.static_bytes, costs.static_bytes[:4] + costs.static_bytes[4:])
    np.testing.assert_allclose(res.busy.sum(-1), (costs.fwd + costs.bwd).sum(axis=(-1, -2)))
    assert res.summary()["stages"][1]["layers"] == [[int(cuts[1]), int(cuts[2])], [int(cuts[5]), int(cuts[6])]]
    # interleaving shrinks the bubble against plain 1F1B on the same 4 devices
    plain = simulate_epoch(table, even_cuts(16, 4), None, feats, SimConfig(dp_size=2))
    assert res.bubble.mean() < plain.bubble.mean()
    with pytest.raises(InputError, match="num_chunks"):
        SimConfig(pp_schedule="interleaved").validate()
    with pytest.raises(InputError, match="chunks per pipeline"):
        simulate_epoch(table, even_cuts(16, 7), None, feats, cfg)
