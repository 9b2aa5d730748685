import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.plan.partition import (
    check_parts,
    evaluate_partition,
    even_partition,
    interval_cost_matrix,
    min_max_partition,
)


def brute_force(costs, num_stages, boundary):
    num_layers = len(costs)
    best = np.inf
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        parts = (0, *cuts, num_layers)
        best = min(best, evaluate_partition(parts, costs, boundary).bottleneck)
    return best


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_min_max_partition_equals_brute_force(data):
    num_layers = data.draw(st.integers(1, 9))
    num_stages = data.draw(st.integers(1, num_layers))
    costs = np.array(data.draw(st.lists(st.floats(0, 100), min_size=num_layers, max_size=num_layers)))
    with_boundary = data.draw(st.booleans())
    boundary = (np.array(data.draw(st.lists(st.floats(0, 20), min_size=num_layers - 1, max_size=num_layers - 1)))
                if with_boundary else None)
    part = min_max_partition(costs, num_stages, boundary)
    assert part.num_stages == num_stages
    check_parts(part.parts, num_layers)
    assert part.bottleneck == pytest.approx(brute_force(costs, num_stages, boundary), rel=1e-12, abs=1e-12)
    # the reported stage costs are the costs of the reported cut points
    assert part.stage_costs == evaluate_partition(part.parts, costs, boundary).stage_costs


def test_single_stage_and_one_layer_per_stage():
    costs = np.array([3.0, 1.0, 4.0, 1.0, 5.0])
    assert min_max_partition(costs, 1).parts == (0, 5)
    assert min_max_partition(costs, 1).bottleneck == 14.0
    assert min_max_partition(costs, 5).parts == (0, 1, 2, 3, 4, 5)


def test_more_stages_than_layers_is_an_input_error():
    with pytest.raises(InputError, match="only 3 layers") as exc:
        min_max_partition(np.ones(3), 4)
    assert exc.value.field == "num_stages"
    with pytest.raises(InputError):
        even_partition(3, 4)


def test_heavy_vision_encoder_spans_several_pure_vision_stages():
    # 1 embed + 12 heavy ViT blocks + projector + 8 light LLM blocks: the ViT alone is more than a stage.
    costs = np.array([0.1] + [10.0] * 12 + [0.5] + [2.0] * 8)
    part = min_max_partition(costs, 4)
    assert part.parts[1] <= 13 and part.parts[2] <= 13  # the first two stages hold only vision layers
    assert part.bottleneck <= 40.6


def test_boundary_cost_moves_cuts_to_cheap_boundaries():
    costs = np.ones(6)
    boundary = np.array([0.0, 0.0, 9.0, 0.0, 0.0])  # cutting after layer 2 is expensive
    part = min_max_partition(costs, 2, boundary)
    assert part.parts[1] != 3
    assert part.bottleneck == pytest.approx(4.0)


def test_even_partition_matches_deepspeed_uniform():
    assert even_partition(10, 4) == (0, 3, 6, 8, 10)
    assert even_partition(97, 4) == (0, 25, 49, 73, 97)
    assert even_partition(5, 1) == (0, 5)


@pytest.mark.parametrize("parts,match", [((0, 3, 3, 6), "stage 1 is empty"), ((1, 6), "start at 0"),
                                         ((0, 5), "end at 6")])
def test_bad_cut_points_name_the_stage(parts, match):
    with pytest.raises(InputError, match=match):
        check_parts(parts, 6)


def test_interval_matrix_is_inf_below_diagonal():
    m = interval_cost_matrix(np.array([1.0, 2.0, 3.0]), np.array([0.5, 0.25]))
    assert m[0, 3] == 6.0 and m[1, 2] == pytest.approx(2.0 + 0.5 + 0.25) and np.isinf(m[2, 1]) and np.isinf(m[1, 1])
