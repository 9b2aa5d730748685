import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.plan.joint import JointPlanner
from omnibal.plan.recompute import fits
from omnibal.plan.stages import StageModelConfig, layer_quantities, stage_memory
from plan_helpers import kind_table, random_kind_coef, uniform_features, vlm_like_table


def exhaustive_joint(q, cfg):
    """min over every partition and every checkpoint mask of every stage of the largest stage time."""
    num_layers, num_stages, budget = q.num_layers, cfg.num_stages, cfg.memory_budget_bytes
    best = np.inf
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        parts = (0, *cuts, num_layers)
        worst = 0.0
        for s in range(num_stages):
            a, b = parts[s], parts[s + 1]
            base = q.compute_time[a:b].sum() + (q.boundary_time[a - 1] if a else 0) + (
                q.boundary_time[b - 1] if b < num_layers else 0)
            stage_best = np.inf
            for bits in itertools.product([False, True], repeat=b - a):
                mask = np.array(bits, dtype=bool)
                if fits(stage_memory(q, a, b, cfg.in_flight(s), mask), budget):
                    stage_best = min(stage_best, base + q.recompute_time[a:b][mask].sum())
            worst = max(worst, stage_best)
        best = min(best, worst)
    return best


def random_case(seed, num_layers, num_stages, num_micro, budget_frac):
    rng = np.random.default_rng(seed)
    kinds = [f"k{int(x)}" for x in rng.integers(0, 3, num_layers)]
    table = kind_table(kinds, random_kind_coef(rng, kinds))
    feats = uniform_features(tiles=float(rng.integers(1, 20)), tokens=float(rng.integers(100, 4000)))
    cfg = StageModelConfig(num_stages=num_stages, num_microbatches=num_micro, dp_size=2, p2p_bandwidth=1e9)
    q = layer_quantities(table, feats, cfg)
    planner = JointPlanner(q, cfg)
    lo = planner.min_memory_partition().bottleneck
    hi = max(planner.solver.memory_without_recompute(0, num_layers, min(num_stages, num_micro)), lo)
    budget = lo + budget_frac * (hi - lo)
    cfg = StageModelConfig(num_stages=num_stages, num_microbatches=num_micro, dp_size=2, p2p_bandwidth=1e9,
                           memory_budget_bytes=budget)
    return q, cfg


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), num_layers=st.integers(1, 7), data=st.data(),
       num_micro=st.integers(1, 4), budget_frac=st.floats(0.0, 1.0))
def test_joint_equals_exhaustive_search(seed, num_layers, data, num_micro, budget_frac):
    num_stages = data.draw(st.integers(1, min(num_layers, 3)))
    q, cfg = random_case(seed, num_layers, num_stages, num_micro, budget_frac)
    result = JointPlanner(q, cfg).plan()
    assert result.bottleneck == pytest.approx(exhaustive_joint(q, cfg), rel=1e-9)
    # no stage of the plan exceeds its budget, and the stages tile the chain
    assert result.fits(cfg.memory_budget_bytes)
    assert [x.start for x in result.stages] == list(result.parts[:-1])
    for stage in result.stages:
        mask = np.zeros(stage.stop - stage.start, dtype=bool)
        mask[[c - stage.start for c in stage.checkpointed]] = True
        assert stage.memory_bytes == pytest.approx(stage_memory(q, stage.start, stage.stop, stage.in_flight, mask),
                                                   rel=1e-12)


def test_budget_no_plan_fits_names_smallest_budget_and_stage():
    table = vlm_like_table()
    base = StageModelConfig(num_stages=3, num_microbatches=8, dp_size=4)
    q = layer_quantities(table, uniform_features(), base)
    smallest = JointPlanner(q, base).min_memory_partition().bottleneck
    tight = StageModelConfig(num_stages=3, num_microbatches=8, dp_size=4, memory_budget_bytes=smallest * 0.95)
    with pytest.raises(InputError, match=r"smallest budget that fits is .* GiB .* stage \d") as exc:
        JointPlanner(q, tight).plan()
    assert exc.value.field == "memory_budget_bytes" and exc.value.record.startswith("stage ")
    assert f"{smallest:.0f} bytes" in str(exc.value)
    # exactly that budget works, with heavy recompute
    exact = StageModelConfig(num_stages=3, num_microbatches=8, dp_size=4, memory_budget_bytes=smallest)
    plan = JointPlanner(q, exact).plan()
    assert plan.fits(smallest) and any(st.checkpointed for st in plan.stages)


def test_roomy_budget_needs_no_recompute_and_tight_one_uses_it_on_early_stages():
    table = vlm_like_table(num_vision=6, num_llm=12)
    feats = uniform_features()
    roomy = StageModelConfig(num_stages=4, num_microbatches=8, dp_size=8, memory_budget_bytes=1e15)
    q = layer_quantities(table, feats, roomy)
    plan = JointPlanner(q, roomy).plan()
    assert all(st.recompute_time == 0 and not st.checkpointed for st in plan.stages)
    free = JointPlanner(q, StageModelConfig(num_stages=4, num_microbatches=8, dp_size=8)).plan()
    assert free.bottleneck == pytest.approx(plan.bottleneck)
    # a budget between the extremes: the joint plan fits, is no slower than even split + full recompute,
    # and stage 0 (4 micro-batches in flight) recomputes at least as much as the last stage (1 in flight)
    planner = JointPlanner(q, roomy)
    lo = planner.min_memory_partition().bottleneck
    no_ckpt = planner.evaluate(planner.plan().parts, "none")
    budget = lo + 0.3 * (max(st.memory_bytes for st in no_ckpt.stages) - lo)
    cfg = StageModelConfig(num_stages=4, num_microbatches=8, dp_size=8, memory_budget_bytes=budget)
    planner = JointPlanner(q, cfg)
    joint = planner.plan()
    assert joint.fits(budget)
    even_full = planner.evaluate((0, 6, 12, 17, 22), "full")
    assert joint.bottleneck <= even_full.bottleneck
    assert joint.stages[0].in_flight == 4 and joint.stages[-1].in_flight == 1


def test_single_stage_plan_and_too_many_stages():
    table = vlm_like_table(num_vision=2, num_llm=2)
    cfg = StageModelConfig(num_stages=1, num_microbatches=4)
    q = layer_quantities(table, uniform_features(), cfg)
    plan = JointPlanner(q, cfg).plan()
    assert plan.parts == (0, q.num_layers) and plan.stages[0].boundary_time == 0.0
    with pytest.raises(InputError, match="only 8 layers"):
        StageModelConfig(num_stages=9, num_microbatches=4).validate(q.num_layers)


def test_fixed_recompute_partition_balances_time_with_recompute_included():
    table = vlm_like_table(num_vision=8, num_llm=8)
    cfg = StageModelConfig(num_stages=4, num_microbatches=8)
    q = layer_quantities(table, uniform_features(), cfg)
    planner = JointPlanner(q, cfg)
    full = planner.plan_fixed_recompute("full")
    assert full.recompute == "full"
    # every layer that frees memory is checkpointed (embeddings keep as much as they save: left alone)
    for stage in full.stages:
        expect = tuple(i for i in range(stage.start, stage.stop) if q.saving_bytes[i] > 0)
        assert stage.checkpointed == expect
    assert sum(len(x.checkpointed) for x in full.stages) == q.num_layers - 2
    even = planner.evaluate((0, 5, 10, 15, 20), "full")
    assert full.bottleneck <= even.bottleneck


def test_gpipe_holds_every_microbatch_on_every_stage():
    cfg = StageModelConfig(num_stages=4, num_microbatches=6, pp_schedule="gpipe")
    assert [cfg.in_flight(s) for s in range(4)] == [6, 6, 6, 6]
    one_f_one_b = StageModelConfig(num_stages=4, num_microbatches=3)
    assert [one_f_one_b.in_flight(s) for s in range(4)] == [3, 3, 2, 1]
