"""HBP level lengths searched by the simulator (``omnibal.hbp.search``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from omnibal.data.balance.api import BalanceConfig
from omnibal.hbp.balance import balance_hbp
from omnibal.hbp.levels import HBPConfig, candidate_lengths
from omnibal.hbp.planning import HBPPlanConfig, simulate_levels, simulate_schedule, stats_level_cost_model
from omnibal.hbp.search import length_moves, level_lengths_of, refine_lengths, refine_partition
from omnibal.jobs.hbp import hbp_context
from omnibal.jobs.plan_config import PlanJobConfig
from omnibal.layout import Layout
from omnibal.plan.search import SearchConfig
from omnibal.stats.long_context import long_context_mixture

CANDS = (2048, 3072, 4096, 6144, 8192)


def test_length_moves_remove_shift_or_add_one_level_and_keep_the_longest():
    moves = length_moves((3072, 6144, 8192), CANDS, max_levels=4)
    assert (6144, 8192) in moves and (3072, 8192) in moves  # removed
    assert (2048, 6144, 8192) in moves and (4096, 6144, 8192) in moves  # 3072 shifted both ways
    assert (3072, 4096, 8192) in moves  # 6144 shifted down; up would reach the longest level
    assert (2048, 3072, 6144, 8192) in moves and (3072, 4096, 6144, 8192) in moves  # added
    assert all(m[-1] == 8192 and list(m) == sorted(set(m)) and len(m) <= 4 for m in moves)
    assert len(moves) == len(set(moves)) and (3072, 6144, 8192) not in moves
    # at max_levels nothing is added; a single level can only gain one
    assert all(len(m) <= 3 for m in length_moves((3072, 6144, 8192), CANDS, max_levels=3))
    assert length_moves((8192,), CANDS, max_levels=2) == [(c, 8192) for c in CANDS[:-1]]
    assert length_moves((8192,), CANDS, max_levels=1) == []


@pytest.fixture(scope="module")
def small():
    job = PlanJobConfig(preset="internvl2-8b", layout=Layout(dp_size=8, pp_size=2, num_microbatches=2),
                        balance_samples=None)
    stats = long_context_mixture(3000, seed=4)
    ctx = hbp_context(job, num_samples=len(stats), balanced_samples=len(stats))
    hbp = HBPPlanConfig()
    model = stats_level_cost_model(ctx, hbp, stats)
    config = HBPConfig(model=model, max_levels=1, balance=BalanceConfig(cost=model.cost))
    return ctx, hbp, stats, config


def test_search_from_a_poor_level_set_reaches_a_faster_one(small):
    ctx, hbp, stats, config = small
    cands = candidate_lengths(np.asarray(stats.tokens), config)
    poor = (cands[0], cands[-1])  # every short and mid-length sample in the longest level
    sched = balance_hbp(stats, dp_size=ctx.dp_size, num_microbatches=ctx.num_microbatches, seed=ctx.seed,
                        config=replace(config, pack_lengths=poor))
    start = simulate_schedule(ctx, hbp, sched, stats, name="hbp")
    tried = {poor}
    import io

    from tqdm import tqdm

    out = io.StringIO()
    with tqdm(file=out) as bar:  # the counter `omnibal plan --hbp` shows on a terminal
        found = refine_lengths(ctx, hbp, stats, config, start, tried, cache={}, bar=bar)
    # one count per simulated set: the length moves that balanced, then the degrees tried for the set found
    assert bar.n > sum(len(lv.sp_trials) - 1 for lv in found.row.levels) and "GPU days" in out.getvalue()
    assert found.row.gpu_days < start.row.gpu_days
    lengths = level_lengths_of(found)
    assert lengths != poor and lengths[-1] == cands[-1] and len(lengths) <= hbp.max_levels
    assert set(lengths) <= set(cands) and lengths in tried and len(tried) > 1
    assert np.all(found.schedule.sample_counts() == 1) and found.row.oom_steps == 0
    # the degrees of the set found were searched by the simulator
    assert all(lv.sp_trials for lv in found.row.levels)
    # no rounds: the start comes back unchanged
    same = refine_lengths(ctx, replace(hbp, length_search_rounds=0), stats, config, start, {poor})
    assert same is start


def test_partition_search_equals_exhaustive_search_and_keeps_the_start_when_off(small):
    """With a radius over every boundary position and every neighbour simulated, ``refine_partition`` finds
    the fastest partition an exhaustive scan of the simulator finds; radius 0 keeps the joint optimum."""
    ctx, hbp, stats, config = small
    sched = balance_hbp(stats, dp_size=ctx.dp_size, num_microbatches=ctx.num_microbatches, seed=ctx.seed,
                        config=replace(config, max_levels=3))
    start = simulate_schedule(ctx, hbp, sched, stats, name="hbp")
    assert len(start.row.levels) > 1 and len(start.row.parts) == 3  # PP 2: one boundary to place
    layers = start.row.parts[-1]
    wide = replace(hbp, partition_search=SearchConfig(radius=layers, top_k=layers))
    found = refine_partition(ctx, wide, start)
    lengths = [lv.length for lv in start.row.levels]
    scan = [simulate_levels(ctx, hbp, start.level_feats, lengths, name="scan", parts=(0, cut, layers))
            for cut in range(1, layers)]
    best = min(scan, key=lambda row: row.rank)
    assert found.row.rank == best.rank and found.row.parts == best.parts
    assert found.row.parts != start.row.parts  # here the joint optimum is a layer or two off the simulator's
    assert found.row.gpu_days <= start.row.gpu_days and found.schedule is start.schedule
    assert [lv.sp_trials for lv in found.row.levels] == [lv.sp_trials for lv in start.row.levels]
    # the default search never returns a slower row; radius 0 has no neighbour to try
    assert refine_partition(ctx, hbp, start).row.gpu_days <= start.row.gpu_days
    assert refine_partition(ctx, replace(hbp, partition_search=SearchConfig(radius=0)), start) is start
