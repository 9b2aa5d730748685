import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal.plan.recompute import RecomputeSolver, fits
from omnibal.plan.stages import StageModelConfig, layer_quantities, stage_memory, stage_recompute_time
from plan_helpers import kind_table, random_kind_coef, uniform_features


def exhaustive(q, start, stop, in_flight, budget):
    """min recompute time over every checkpoint mask, or None."""
    best = None
    n = stop - start
    for bits in itertools.product([False, True], repeat=n):
        mask = np.array(bits, dtype=bool)
        mem = stage_memory(q, start, stop, in_flight, mask)
        if fits(mem, budget):
            t = float(q.recompute_time[start:stop][mask].sum())
            best = t if best is None else min(best, t)
    return best


def exhaustive_selective(q, start, stop, in_flight, budget):
    """min recompute time over every per-layer choice of none / full / selective, or None."""
    best = None
    for modes in itertools.product([0, 1, 2], repeat=stop - start):
        modes = np.array(modes, dtype=np.int8)
        if fits(stage_memory(q, start, stop, in_flight, modes), budget):
            t = stage_recompute_time(q, start, stop, modes)
            best = t if best is None else min(best, t)
    return best


def quantities(seed, num_layers, num_kinds, dp=4, selective=False):
    rng = np.random.default_rng(seed)
    kinds = [f"k{int(x)}" for x in rng.integers(0, num_kinds, num_layers)]
    table = kind_table(kinds, random_kind_coef(rng, kinds, selective=selective))
    feats = np.column_stack([np.ones(8), rng.integers(1, 20, 8), rng.integers(100, 5000, 8), np.zeros(8)])
    feats[:, 3] = feats[:, 2] ** 2 / 3
    cfg = StageModelConfig(num_stages=1, num_microbatches=8, dp_size=dp)
    return layer_quantities(table, feats, cfg)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10**6), num_layers=st.integers(1, 9), num_kinds=st.integers(1, 9),
       in_flight=st.integers(1, 6), frac=st.floats(0.0, 1.2))
def test_solver_equals_exhaustive_search(seed, num_layers, num_kinds, in_flight, frac):
    q = quantities(seed, num_layers, num_kinds)
    solver = RecomputeSolver(q)
    start, stop = 0, num_layers
    lo, hi = solver.min_memory(start, stop, in_flight), solver.memory_without_recompute(start, stop, in_flight)
    budget = lo + frac * (hi - lo)
    expect = exhaustive(q, start, stop, in_flight, budget)
    got = solver.solve(start, stop, in_flight, budget)
    if expect is None:
        assert got is None
        return
    assert got is not None
    assert got.recompute_time == pytest.approx(expect, rel=1e-9, abs=1e-15)
    mask = np.zeros(num_layers, dtype=bool)
    mask[list(got.checkpointed)] = True
    # the reported memory is the memory of the reported checkpoint set, and it fits
    assert got.memory_bytes == pytest.approx(stage_memory(q, start, stop, in_flight, mask), rel=1e-12)
    assert fits(got.memory_bytes, budget)
    assert got.recompute_time == pytest.approx(float(q.recompute_time[mask].sum()), rel=1e-12, abs=1e-18)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10**6), num_layers=st.integers(1, 7), num_kinds=st.integers(1, 7),
       in_flight=st.integers(1, 6), frac=st.floats(0.0, 1.2))
def test_solver_with_selective_equals_exhaustive_search(seed, num_layers, num_kinds, in_flight, frac):
    """Three choices per layer (none, full, selective): the class solver finds the exhaustive optimum, and
    the memory and time it reports are those of the layers it names."""
    q = quantities(seed, num_layers, num_kinds, selective=True)
    solver = RecomputeSolver(q, selective=True)
    lo, hi = solver.min_memory(0, num_layers, in_flight), solver.memory_without_recompute(0, num_layers, in_flight)
    budget = lo + frac * (hi - lo)
    expect = exhaustive_selective(q, 0, num_layers, in_flight, budget)
    got = solver.solve(0, num_layers, in_flight, budget)
    if expect is None:
        assert got is None
        return
    assert got is not None and not set(got.checkpointed) & set(got.selective)
    assert got.recompute_time == pytest.approx(expect, rel=1e-9, abs=1e-15)
    modes = np.zeros(num_layers, dtype=np.int8)
    modes[list(got.checkpointed)], modes[list(got.selective)] = 1, 2
    assert got.memory_bytes == pytest.approx(stage_memory(q, 0, num_layers, in_flight, modes), rel=1e-12)
    assert fits(got.memory_bytes, budget)
    assert got.recompute_time == pytest.approx(stage_recompute_time(q, 0, num_layers, modes), rel=1e-12, abs=1e-18)
    full_only = RecomputeSolver(q).solve(0, num_layers, in_flight, budget)
    assert full_only is None or got.recompute_time <= full_only.recompute_time * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), num_layers=st.integers(1, 8), in_flight=st.integers(1, 5))
def test_min_memory_is_the_smallest_over_all_masks(seed, num_layers, in_flight):
    q = quantities(seed, num_layers, 4)
    solver = RecomputeSolver(q)
    every = min(stage_memory(q, 0, num_layers, in_flight, np.array(bits, dtype=bool))
                for bits in itertools.product([False, True], repeat=num_layers))
    assert solver.min_memory(0, num_layers, in_flight) == pytest.approx(every, rel=1e-12)


def test_no_recompute_when_memory_allows_and_none_when_nothing_fits():
    q = quantities(3, 6, 2)
    solver = RecomputeSolver(q)
    roomy = solver.memory_without_recompute(0, 6, 3)
    assert solver.solve(0, 6, 3, roomy).checkpointed == ()
    assert solver.solve(0, 6, 3, None).recompute_time == 0.0
    assert solver.solve(0, 6, 3, solver.min_memory(0, 6, 3) * 0.99) is None


def test_many_identical_blocks_are_solved_by_counting():
    # 48 identical LLM blocks + head: the solver checkpoints exactly as many blocks as the budget needs.
    coef = random_kind_coef(np.random.default_rng(0), ["blk", "head"])
    table = kind_table(["blk"] * 48 + ["head"], coef)
    q = layer_quantities(table, uniform_features(), StageModelConfig(num_stages=1, num_microbatches=4))
    solver = RecomputeSolver(q)
    full = solver.memory_without_recompute(0, 49, 4)
    per_block = 4 * q.saving_bytes[0]
    budget = full - 10.5 * per_block + q.saving_bytes[0]  # needs 11 blocks (10.5 rounded up) incl. working set
    got = solver.solve(0, 49, 4, budget)
    assert fits(got.memory_bytes, budget)
    blocks = [i for i in got.checkpointed if i < 48]
    assert got.checkpointed[: len(blocks)] == tuple(range(len(blocks)))  # the first blocks of the stage
    assert got.recompute_time <= 11 * q.recompute_time[0] + q.recompute_time[48] + 1e-15


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=40))
def test_a_pruned_front_keeps_exactly_the_points_no_point_of_its_transient_beats(points):
    """The front's pruning against a plain reference: a point goes when another of the same transient saves at
    least as much in less time, or as much in the same time and comes first (one of equal points stays)."""
    from omnibal.plan.recompute import _Frontier

    trans, save, time = (np.array(col, float) for col in zip(*points))
    time = time / 4  # ties, and times that are not integers
    counts = np.arange(len(points), dtype=np.int64).reshape(-1, 1)
    got = _Frontier(trans, save, time, counts).pruned()
    order = np.lexsort((time, -save, trans))  # the reference walks the points in the same order
    kept = [int(i) for n, i in enumerate(order)
            if not any(trans[j] == trans[i] and time[j] <= time[i] for j in order[:n])]
    kept.sort(key=lambda i: (trans[i], save[i]))
    assert got.counts[:, 0].tolist() == kept
