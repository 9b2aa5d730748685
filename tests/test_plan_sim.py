"""The planner against the simulator: planned memory bounds the simulated peak, so no plan runs out of
memory in the simulator; and the joint plan is never slower there than even split + full recompute."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal.plan.joint import JointPlanner
from omnibal.plan.partition import even_partition
from omnibal.plan.stages import StageModelConfig, layer_quantities
from omnibal.sim.costs import SimConfig
from omnibal.sim.epoch import simulate_epoch
from plan_helpers import kind_table, random_kind_coef, vlm_like_table


def random_features(rng, num_steps, dp, num_mb):
    tiles = rng.integers(1, 40, (num_steps, dp, num_mb)).astype(float)
    segs = rng.integers(1, 6, (num_steps, dp, num_mb))
    tokens = rng.integers(200, 12000, (num_steps, dp, num_mb)).astype(float)
    return np.stack([np.ones_like(tiles), tiles, tokens, tokens**2 / segs], axis=-1)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), num_layers=st.integers(2, 12), data=st.data(), num_mb=st.integers(1, 6),
       dp=st.integers(1, 3), frac=st.floats(0.0, 1.0))
def test_no_plan_exceeds_its_budget_in_the_simulator(seed, num_layers, data, num_mb, dp, frac):
    rng = np.random.default_rng(seed)
    num_stages = data.draw(st.integers(1, min(num_layers, 4)))
    pp_schedule = data.draw(st.sampled_from(["1f1b", "gpipe"]))
    kinds = [f"k{int(x)}" for x in rng.integers(0, 3, num_layers)]
    table = kind_table(kinds, random_kind_coef(rng, kinds))
    feats = random_features(rng, 5, dp, num_mb)
    base = StageModelConfig(num_stages=num_stages, num_microbatches=num_mb, dp_size=dp, pp_schedule=pp_schedule)
    q = layer_quantities(table, feats, base)
    lo = JointPlanner(q, base).min_memory_partition().bottleneck
    hi = q.static_bytes.sum() + num_stages * q.act_bytes.sum()
    budget = lo + frac * max(hi - lo, 0.0)
    cfg = StageModelConfig(num_stages=num_stages, num_microbatches=num_mb, dp_size=dp, memory_budget_bytes=budget,
                           pp_schedule=pp_schedule)
    plan = JointPlanner(q, cfg).plan()
    sim = SimConfig(dp_size=dp, memory_budget_bytes=budget * (1 + 1e-9), pp_schedule=pp_schedule)
    res = simulate_epoch(table, plan.parts, plan.recompute_mask(num_layers), feats, sim)
    peak = res.peak_memory.max(axis=(0, 1))
    planned = np.array([s.memory_bytes for s in plan.stages])
    assert np.all(peak <= planned * (1 + 1e-9) + 1.0), (peak, planned)
    assert not res.oom.any()


def test_joint_plan_beats_even_split_with_full_recompute_in_the_simulator():
    rng = np.random.default_rng(1)
    table = vlm_like_table(num_vision=10, num_llm=14)
    feats = random_features(rng, 20, 2, 8)
    base = StageModelConfig(num_stages=4, num_microbatches=8, dp_size=2)
    q = layer_quantities(table, feats, base)
    planner = JointPlanner(q, base)
    lo = planner.min_memory_partition().bottleneck
    cfg = StageModelConfig(num_stages=4, num_microbatches=8, dp_size=2, memory_budget_bytes=1.5 * lo)
    planner = JointPlanner(q, cfg)
    joint = planner.plan()
    even = planner.evaluate(even_partition(q.num_layers, 4), "full")
    sim = SimConfig(dp_size=2, memory_budget_bytes=1.5 * lo)
    t_joint = simulate_epoch(table, joint.parts, joint.recompute_mask(q.num_layers), feats, sim)
    t_even = simulate_epoch(table, even.parts, even.recompute_mask(q.num_layers), feats, sim)
    assert t_joint.total_time < t_even.total_time
    assert not t_joint.oom.any()
