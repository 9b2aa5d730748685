"""Planner inputs at the edges: one layer, one sample (one micro-batch), as many stages as layers, more stages
than layers, budgets that barely fit and barely do not, and degenerate feature matrices.

Promise (docs/guarantees.md, "Planner edges"): at every edge the planner either returns a plan whose stages
tile the chain and fit the budget, or raises an :class:`InputError` naming the argument (and, for an
impossible budget, the smallest budget that would fit — which then does fit).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.plan.joint import JointPlanner, plan_joint
from omnibal.plan.partition import even_partition, min_max_partition
from omnibal.plan.recompute import fits
from omnibal.plan.stages import StageModelConfig, layer_quantities, stage_memory
from plan_helpers import random_layer_table, uniform_features, vlm_like_table

EDGE = settings(max_examples=40, deadline=None)


def check_plan(result, q, cfg) -> None:
    """Stages tile [0, L) in order, each fits the budget, checkpointed layers lie inside their stage."""
    assert result.parts[0] == 0 and result.parts[-1] == q.num_layers
    assert len(result.stages) == cfg.num_stages
    for s, st_ in enumerate(result.stages):
        assert (st_.start, st_.stop) == (result.parts[s], result.parts[s + 1]) and st_.stop > st_.start
        assert all(st_.start <= c < st_.stop for c in st_.checkpointed)
        mask = np.zeros(st_.stop - st_.start, dtype=bool)
        mask[[c - st_.start for c in st_.checkpointed]] = True
        mem = stage_memory(q, st_.start, st_.stop, cfg.in_flight(s), mask)
        assert mem == pytest.approx(st_.memory_bytes, rel=1e-9)
        assert fits(mem, cfg.memory_budget_bytes)
        assert np.isfinite(st_.time) and st_.time >= 0


def _config(num_stages, num_micro=4, budget=None, dp=2):
    return StageModelConfig(num_stages=num_stages, num_microbatches=num_micro, dp_size=dp, memory_budget_bytes=budget)


# ------------------------------------------------------------------------------------ shapes
@EDGE
@given(seed=st.integers(0, 10**6), num_micro=st.integers(1, 6))
def test_one_layer_one_stage(seed, num_micro):
    table = random_layer_table(np.random.default_rng(seed), 1)
    cfg = _config(1, num_micro)
    q = layer_quantities(table, uniform_features(num=1), cfg)
    result = plan_joint(q, cfg)
    assert result.parts == (0, 1)
    check_plan(result, q, cfg)
    assert min_max_partition(q.compute_time, 1).parts == (0, 1)


@EDGE
@given(seed=st.integers(0, 10**6), num_layers=st.integers(1, 12), num_micro=st.integers(1, 16))
def test_as_many_stages_as_layers(seed, num_layers, num_micro):
    """P = L has exactly one partition: one layer per stage; with a budget the plan still fits."""
    table = random_layer_table(np.random.default_rng(seed), num_layers)
    cfg = _config(num_layers, num_micro)
    q = layer_quantities(table, uniform_features(num=3), cfg)
    result = plan_joint(q, cfg)
    assert result.parts == tuple(range(num_layers + 1))
    check_plan(result, q, cfg)
    lo = JointPlanner(q, cfg).min_memory_partition().bottleneck
    cfg_b = _config(num_layers, num_micro, budget=lo)
    result = plan_joint(layer_quantities(table, uniform_features(num=3), cfg_b), cfg_b)
    assert result.parts == tuple(range(num_layers + 1))
    check_plan(result, q, cfg_b)


@pytest.mark.parametrize("num_layers,num_stages", [(1, 2), (3, 4), (17, 18)])
def test_more_stages_than_layers_is_an_input_error(num_layers, num_stages):
    table = random_layer_table(np.random.default_rng(0), num_layers)
    cfg = _config(num_stages)
    with pytest.raises(InputError, match="num_stages|layers") as exc:
        layer_quantities(table, uniform_features(), cfg)
    assert exc.value.field == "num_stages"
    with pytest.raises(InputError, match="layers"):
        min_max_partition(np.ones(num_layers), num_stages)
    with pytest.raises(InputError, match="layers"):
        even_partition(num_layers, num_stages)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_non_positive_or_non_integer_stage_count(bad):
    table = random_layer_table(np.random.default_rng(0), 4)
    with pytest.raises(InputError) as exc:
        layer_quantities(table, uniform_features(), _config(bad))
    assert exc.value.field == "num_stages"


def test_one_sample_one_microbatch():
    """An epoch of a single micro-batch: mean == max features; the plan is the same as for many copies."""
    table = vlm_like_table()
    cfg = _config(3, num_micro=1)
    q1 = layer_quantities(table, uniform_features(num=1), cfg)
    q16 = layer_quantities(table, uniform_features(num=16), cfg)
    assert np.array_equal(q1.compute_features, q1.memory_features)
    r1, r16 = plan_joint(q1, cfg), plan_joint(q16, cfg)
    check_plan(r1, q1, cfg)
    assert r1.parts == r16.parts and r1.bottleneck == pytest.approx(r16.bottleneck)
    # M = 1 < P: every stage holds exactly one micro-batch in flight
    assert all(st_.in_flight == 1 for st_ in r1.stages)


@pytest.mark.parametrize("features", [
    np.zeros((4, 4)),  # every micro-batch empty
    np.zeros((0, 4)),  # no micro-batch at all
    np.array([[1.0, 3.0, np.nan, 9.0]]),
    np.array([[1.0, 3.0, np.inf, 9.0]]),
    np.array([[1.0, -3.0, 10.0, 100.0]]),
], ids=["all-empty", "none", "nan", "inf", "negative"])
def test_degenerate_features_are_named(features):
    with pytest.raises(InputError) as exc:
        layer_quantities(vlm_like_table(), features, _config(2))
    assert exc.value.source == "features"


# ------------------------------------------------------------------------------------ budgets
def _budget_case(seed: int, num_layers: int, num_stages: int, num_micro: int):
    table = random_layer_table(np.random.default_rng(seed), num_layers)
    feats = uniform_features(tiles=float(seed % 13 + 1), tokens=float(100 + seed % 3000))
    q = layer_quantities(table, feats, _config(num_stages, num_micro))
    smallest = JointPlanner(q, _config(num_stages, num_micro)).min_memory_partition().bottleneck
    return table, feats, smallest


@EDGE
@given(seed=st.integers(0, 10**6), num_layers=st.integers(1, 9), data=st.data(), num_micro=st.integers(1, 6))
def test_budget_that_barely_fits_and_barely_does_not(seed, num_layers, data, num_micro):
    num_stages = data.draw(st.integers(1, num_layers))
    table, feats, smallest = _budget_case(seed, num_layers, num_stages, num_micro)
    # exactly the smallest budget: a plan exists and fits it
    cfg = _config(num_stages, num_micro, budget=smallest)
    q = layer_quantities(table, feats, cfg)
    check_plan(plan_joint(q, cfg), q, cfg)
    # a hair below (well beyond the 1e-9 float slack): refused, naming the budget and the smallest that fits
    cfg_low = _config(num_stages, num_micro, budget=smallest * (1 - 1e-6))
    with pytest.raises(InputError) as exc:
        plan_joint(layer_quantities(table, feats, cfg_low), cfg_low)
    assert exc.value.source == "memory_budget" and exc.value.field == "memory_budget_bytes"
    stated = float(re.search(r"smallest budget that fits is [0-9.]+ GiB \(([0-9]+) bytes\)", str(exc.value)).group(1))
    assert stated == pytest.approx(smallest, rel=1e-9, abs=1.0)
    # the budget the message states is enough (rounded to whole bytes, so allow that one byte)
    cfg_stated = _config(num_stages, num_micro, budget=stated + 1.0)
    q_s = layer_quantities(table, feats, cfg_stated)
    check_plan(plan_joint(q_s, cfg_stated), q_s, cfg_stated)


@pytest.mark.parametrize("budget", [0.0, -1.0, float("nan")])
def test_non_positive_budget_is_an_input_error(budget):
    with pytest.raises(InputError) as exc:
        layer_quantities(vlm_like_table(), uniform_features(), _config(2, budget=budget))
    assert exc.value.field == "memory_budget_bytes"


def test_tiny_budget_names_the_smallest_that_fits():
    with pytest.raises(InputError, match=r"smallest budget that fits is .* bytes"):
        cfg = _config(3, budget=1.0)
        plan_joint(layer_quantities(vlm_like_table(), uniform_features(), cfg), cfg)


def test_huge_budget_needs_no_recompute():
    cfg = _config(3, budget=1e30)
    q = layer_quantities(vlm_like_table(), uniform_features(), cfg)
    result = plan_joint(q, cfg)
    check_plan(result, q, cfg)
    assert all(not st_.checkpointed for st_ in result.stages)
    unlimited = plan_joint(q, _config(3))
    assert result.parts == unlimited.parts
