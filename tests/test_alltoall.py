"""The node-wise (two-level) all-to-all on gloo ranks: the same data as the flat one, both ways."""

from __future__ import annotations

import pytest

from omnibal.errors import InputError
from omnibal.train.alltoall import check_node_size
from omnibal.train.distributed import spawn_local
from online_helpers import rank_two_level_matches_flat

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(("dp", "node_sizes"), [(4, (1, 2, 4)), (3, (1, 3))])
def test_two_level_all_to_all_moves_what_the_flat_one_moves(dp, node_sizes):
    """Intra-node then inter-node, for every node size that divides the group (1: inter only; dp: intra
    only): every rank receives exactly the flat exchange's elements in the same order, the backward returns
    exactly the flat one's gradients, and bf16 travels as bf16."""
    results = spawn_local(rank_two_level_matches_flat, dp, args=(dp, node_sizes, 7), deadline_s=120,
                          start_method="fork")
    errors = [r.error for r in results if r.error]
    assert not errors, "\n".join(errors)
    for r in results:
        flat = r.value["out"][0]
        assert any(len(got) for got, _, _ in flat)
        for s in node_sizes:
            assert r.value["out"][s] == flat, (r.value["rank"], s)
        assert set(r.value["bf16"].values()) == {"torch.bfloat16"}


def test_node_size_must_divide_the_group():
    check_node_size(0, 6)
    check_node_size(3, 6)
    for bad in (4, -1):
        with pytest.raises(InputError, match="node_size"):
            check_node_size(bad, 6)


def test_nothing_off_the_diagonal_makes_no_collective():
    """Every chunk staying home (online's control run) returns the input, with no process group at all."""
    import numpy as np
    import torch

    from omnibal.train.alltoall import AllToAllGroups, exchange_raw

    x = torch.arange(3.0)
    groups = AllToAllGroups(dp_rank=0, dp_size=2, group=None)
    assert exchange_raw(x, np.diag([3, 5]), groups) is x
