"""ZeRO-3 in the step model: weights sharded and gathered layer by layer, each layer the longer of its compute
and its collectives, recompute sharing the backward's gather, DP ranks in lockstep, and the planner's stage
model agreeing with the simulator."""

from dataclasses import replace

import numpy as np
import pytest

from omnibal.cost.analytic import analytic_cost_table, zero_sharded_bytes
from omnibal.cost.analytic import zero3_gather_reserve as _reserve
from omnibal.cost.analytic import zero3_layer_comm as _comm
from omnibal.cost.hardware import get_hardware
from omnibal.cost.presets import get_model_preset
from omnibal.errors import InputError
from omnibal.plan.stages import StageModelConfig, layer_quantities, stage_memory
from omnibal.sim.costs import SimConfig, stage_costs
from omnibal.sim.epoch import simulate_epoch

TABLE = analytic_cost_table(get_model_preset("internvl-chat-1.5"), get_hardware("a100-80g"))
L = TABLE.num_layers
CUTS = [0, L]
ALL = np.ones(L, bool)
NONE = np.zeros(L, bool)
MB = np.array([1.0, 10.0, 4000.0, 4000.0**2 / 4])  # one, tiles, tokens, sum of squared lengths


def _config(bandwidth, dp=8, **kw):
    return SimConfig(dp_size=dp, zero_stage=3, dp_bandwidth=bandwidth, dp_latency=0.0, **kw)


def zero3_layer_comm(table, dp_size, bandwidth):
    return _comm(table, zero_stage=3, dp_size=dp_size, bandwidth=bandwidth, latency=0.0)


def zero3_gather_reserve(table, dp_size=8):
    return _reserve(table, zero_stage=3, dp_size=dp_size)


def test_a_layer_takes_the_longer_of_its_compute_and_its_weights_gather():
    features = MB[None, :]
    forward, backward = zero3_layer_comm(TABLE, 8, 1e9)
    np.testing.assert_allclose(forward, 7 / 8 * TABLE.param_bytes / 1e9)  # gather the weights
    np.testing.assert_allclose(backward, 2 * 7 / 8 * TABLE.param_bytes / 1e9)  # again, + the grads' reduce-scatter
    slow = stage_costs(TABLE, CUTS, NONE, features, _config(1e6))  # collectives dominate every layer
    np.testing.assert_allclose(slow.fwd[0, 0], zero3_layer_comm(TABLE, 8, 1e6)[0].sum())
    fast = stage_costs(TABLE, CUTS, NONE, features, _config(1e18))  # compute dominates: ZeRO-1's times
    zero1 = stage_costs(TABLE, CUTS, NONE, features, SimConfig(dp_size=8, zero_stage=1))
    np.testing.assert_allclose(fast.fwd, zero1.fwd, rtol=1e-9)
    np.testing.assert_allclose(fast.bwd, zero1.bwd, rtol=1e-9)


def test_one_rank_is_zero2_and_a_frozen_layer_moves_nothing_in_the_backward():
    features = np.broadcast_to(MB, (1, 1, 2, 4))
    alone, zero2 = (stage_costs(TABLE, CUTS, ALL, features, SimConfig(dp_size=1, zero_stage=z)) for z in (3, 2))
    for name in ("fwd", "bwd", "recompute", "static_bytes", "grad_bytes"):
        np.testing.assert_array_equal(getattr(alone, name), getattr(zero2, name))
    assert zero3_gather_reserve(TABLE, dp_size=1) == 0 and not zero3_layer_comm(TABLE, 1, 1e9)[1].any()
    frozen = analytic_cost_table(replace(get_model_preset("internvl-chat-1.5"), freeze_vision=True),
                                 get_hardware("a100-80g"))
    vision = np.array([k.startswith("vision") for k in frozen.kinds])
    forward, backward = zero3_layer_comm(frozen, 8, 1e9)
    assert forward[vision].all() and not backward[vision].any() and backward[~vision].all()
    costs = stage_costs(frozen, [0, int(vision.sum()), L], NONE, MB[None, :], _config(1e6))
    assert costs.bwd[0, 0] == 0 and costs.fwd[0, 0] > 0


def test_recompute_shares_the_backwards_gather():
    features = MB[None, :]
    comm_bound = _config(1e6)
    none, full = (stage_costs(TABLE, CUTS, m, features, comm_bound) for m in (NONE, ALL))
    # when the collectives are longer than recompute + backward, checkpointing costs nothing
    np.testing.assert_allclose((full.bwd + full.recompute)[0, 0], (none.bwd + none.recompute)[0, 0])
    assert full.recompute[0, 0] > 0
    compute_bound = stage_costs(TABLE, CUTS, ALL, features, _config(1e18))
    zero1 = stage_costs(TABLE, CUTS, ALL, features, SimConfig(dp_size=8, zero_stage=1))
    np.testing.assert_allclose(compute_bound.recompute, zero1.recompute, rtol=1e-9)


def test_dp_ranks_wait_for_the_slowest_rank_layer_by_layer():
    light, heavy = MB.copy(), MB * np.array([1, 3, 3, 9])
    features = np.stack([light, heavy])[None, :, None, :]  # [S=1, D=2, M=1, 4]
    costs = stage_costs(TABLE, CUTS, NONE, features, _config(1e18, dp=2))
    alone = stage_costs(TABLE, CUTS, NONE, heavy[None, :], _config(1e18, dp=2))
    np.testing.assert_allclose(costs.fwd[0, 0, 0], costs.fwd[0, 1, 0])
    np.testing.assert_allclose(costs.fwd[0, 0, 0], alone.fwd[0])


def test_memory_shards_the_weights_and_keeps_two_layers_gathered_and_no_step_end_sync():
    features = np.broadcast_to(MB, (2, 8, 1, 4))
    res = simulate_epoch(TABLE, CUTS, ALL, features, _config(25e9))
    sharded = sum(zero_sharded_bytes(TABLE, dp_size=8, zero_stage=3)).sum()
    assert zero3_gather_reserve(TABLE) == 2 * TABLE.param_bytes.max() + TABLE.grad_bytes.max()
    np.testing.assert_allclose(res.static_bytes, [sharded + zero3_gather_reserve(TABLE)])
    assert res.static_bytes[0] < sum(zero_sharded_bytes(TABLE, dp_size=8, zero_stage=2)).sum()
    assert np.all(res.allreduce_time == 0)
    # interleaved: two model chunks per device hold the gathered layers once, not once per chunk
    cuts = [0, 24, 48, 72, L]
    two = simulate_epoch(TABLE, cuts, ALL, features[:, :, :1].repeat(2, axis=2),
                         _config(25e9, pp_schedule="interleaved", num_chunks=2))
    layer = sum(zero_sharded_bytes(TABLE, dp_size=8, zero_stage=3))
    devices = [layer[0:24].sum() + layer[48:72].sum(), layer[24:48].sum() + layer[72:].sum()]  # chunk c*P + d
    np.testing.assert_allclose(two.static_bytes, np.array(devices) + zero3_gather_reserve(TABLE))


@pytest.mark.parametrize("bandwidth", [1e8, 25e9, 1e18])
@pytest.mark.parametrize("mask", ["none", "half", "all"])
def test_the_planners_stage_model_agrees_with_the_simulator(bandwidth, mask):
    rec = {"none": NONE, "half": np.arange(L) % 2 == 0, "all": ALL}[mask]
    features = np.broadcast_to(MB, (1, 8, 1, 4))  # identical micro-batches: the mean is exact
    stage = StageModelConfig(num_stages=1, num_microbatches=1, dp_size=8, zero_stage=3, dp_bandwidth=bandwidth,
                             dp_latency=0.0)
    q = layer_quantities(TABLE, features, stage)
    planned = q.compute_time.sum() + q.recompute_time[rec].sum()
    res = simulate_epoch(TABLE, CUTS, rec, features, _config(bandwidth))
    assert res.step_time[0] == pytest.approx(planned, rel=1e-9)
    # memory: the planner's stage memory (its budget is net of the gathered layers) + the reserve = the peak
    peak = stage_memory(q, 0, L, 1, rec) + zero3_gather_reserve(TABLE)
    assert res.peak_memory.max() == pytest.approx(peak, rel=1e-9)


def test_plan_job_under_zero3():
    from omnibal.jobs.plan_config import PlanJobConfig
    from omnibal.jobs.plan_job import run_plan_job
    from omnibal.layout import Layout
    from omnibal.plan.exports import deepspeed_fields
    from omnibal.plan.search import SearchConfig

    config = PlanJobConfig(num_gpus=128, layout=Layout(dp_size=128, pp_size=1, zero_stage=3, num_microbatches=1),
                           num_samples=20_000, balance_samples=None, search=SearchConfig(radius=1, top_k=2,
                                                                                         sample_steps=16))
    res = run_plan_job(config)
    assert res.plan.inputs.layout.zero_stage == 3
    assert all(r.paper_gpu_days is None for r in res.ablation)  # the paper's rows are a PP ablation
    assert res.ablation[-1].gpu_days < res.ablation[0].gpu_days
    zero1 = run_plan_job(replace(config, layout=replace(config.layout, zero_stage=1), memory_budget_gib=1e4))
    # weights, gradients and optimizer state sharded 128 ways: a fraction of ZeRO-1's memory
    assert max(res.ablation[0].peak_memory_bytes) < 0.25 * max(zero1.ablation[0].peak_memory_bytes)
    with pytest.raises(InputError, match="PipelineEngine"):
        deepspeed_fields(res.plan)
    with pytest.raises(InputError, match="ZeRO stage 3"):
        replace(config, engine="deepspeed").validate()
