"""One even split: the planner's baseline, the simulator and the trainer agree layer for layer (they rounded
differently: 97 layers in 4 stages were 25/24/24/24 in plan and train but 24/24/25/24 in the simulator)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnibal.cost.spec import even_cuts
from omnibal.errors import InputError
from omnibal.plan.partition import even_partition
from omnibal.sim.costs import even_cuts as sim_even_cuts
from omnibal.train.stage_layout import even_split


def test_97_layers_in_4_stages_is_one_split_everywhere():
    assert even_cuts(97, 4) == (0, 25, 49, 73, 97)
    assert even_partition(97, 4) == (0, 25, 49, 73, 97)
    assert sim_even_cuts(97, 4).tolist() == [0, 25, 49, 73, 97]
    assert even_split(97, 4) == ((0, 25), (25, 49), (49, 73), (73, 97))


@given(layers=st.integers(1, 400), stages=st.integers(1, 64))
def test_plan_sim_and_train_split_alike(layers, stages):
    if stages > layers:
        for fn in (even_cuts, even_partition, sim_even_cuts, even_split):
            with pytest.raises(InputError):
                fn(layers, stages)
        return
    cuts = even_cuts(layers, stages)
    sizes = [b - a for a, b in zip(cuts[:-1], cuts[1:])]
    assert cuts[0] == 0 and cuts[-1] == layers and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert even_partition(layers, stages) == cuts
    assert tuple(sim_even_cuts(layers, stages).tolist()) == cuts
    assert even_split(layers, stages) == tuple(zip(cuts[:-1], cuts[1:]))
