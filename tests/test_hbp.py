"""HBP multi-level packing: the Schedule's levels, exactly once, determinism, resume/reshard, level choice."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hbp_helpers import CANDIDATES, MODEL
from omnibal.data.balance.schedule import Caps, Schedule
from omnibal.errors import InputError
from omnibal.hbp.balance import balance_hbp, level_lengths, untrained_rows
from omnibal.hbp.levels import HBPConfig, LevelCostModel, choose_levels, exhaustive_levels, levels_cost
from omnibal.stats.long_context import cpu_long_context_mixture, long_context_mixture
from omnibal.stats.table import SampleStats, index_keys


def _stats(tokens, tiles=None) -> SampleStats:
    tokens = np.asarray(tokens, np.int64)
    tiles = np.zeros(len(tokens), np.int64) if tiles is None else np.asarray(tiles, np.int64)
    return SampleStats(tiles=tiles, tokens=tokens, images=(tiles > 0).astype(np.int64),
                       keys=index_keys("test", len(tokens)), source="test-stats")


@pytest.fixture(scope="module")
def mixed():
    """A small mixture at the CPU scale: short samples, documents and videos."""
    return cpu_long_context_mixture(1500, seed=1)


def _two_level_schedule() -> Schedule:
    # step 0: level 0 (SP 1), 4 ranks own packs; step 1: level 1 (SP 2), ranks {0,1} and {2,3} share
    return Schedule(dp_size=4, num_microbatches=1, caps=Caps(tiles=1, tokens=8), pack_samples=np.arange(6),
                    pack_offsets=np.arange(7), pack_ids=np.array([[[0], [1], [2], [3]], [[4], [4], [5], [5]]]),
                    num_samples=6, levels=(0, 1), level_sp=(1, 2))


# -- the Schedule interface --------------------------------------------------------------------------
def test_levels_round_trip_json_and_count_sp_groups_once():
    sched = _two_level_schedule()
    assert sched.sample_counts().tolist() == [1] * 6
    assert sched.leader_mask().tolist() == [[True] * 4, [True, False, True, False]]
    back = Schedule.from_json(sched.to_json())
    assert back.levels == (0, 1) and back.level_sp == (1, 2) and back.equals(sched)
    assert back.sample_counts().tolist() == [1] * 6
    d = json.loads(sched.to_json())
    assert d["levels"] == [0, 1] and d["level_sp"] == [1, 2]


def test_single_level_json_has_no_level_keys_and_old_json_loads():
    sched = _two_level_schedule()
    old = Schedule(dp_size=2, num_microbatches=1, caps=Caps(tiles=1, tokens=8), pack_samples=np.arange(2),
                   pack_offsets=np.arange(3), pack_ids=np.array([[[0], [1]]]), num_samples=2)
    d = old.to_dict()
    assert "levels" not in d and "level_sp" not in d
    back = Schedule.from_dict(d)
    assert back.levels is None and back.level_sp is None and back.step_sp().tolist() == [1]
    assert not back.equals(sched)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("level_sp"), "level_sp"),
    (lambda d: d.update(level_sp=[1, 3]), "level_sp"),
    (lambda d: d.update(levels=[0, 2]), "levels"),
    (lambda d: d["steps"][1].__setitem__(1, [[0]]), "steps"),
])
def test_bad_levels_json_is_a_named_input_error(edit, field):
    d = _two_level_schedule().to_dict()
    edit(d)
    with pytest.raises(InputError) as err:
        Schedule.from_dict(d, source="sched.json")
    assert err.value.field == field


# -- multi-level balancing ---------------------------------------------------------------------------
def _config(**kw) -> HBPConfig:
    return HBPConfig(model=MODEL, **{"candidate_lengths": CANDIDATES, **kw})


def test_every_sample_exactly_once_and_sp_groups_identical(mixed):
    sched = balance_hbp(mixed, dp_size=4, num_microbatches=2, seed=3, config=_config())
    assert sched.levels is not None and len(sched.level_sp) >= 2
    assert np.all(sched.sample_counts() == 1)
    assert sched.sp_group_mismatch() is None
    lengths = level_lengths(sched)
    for step, level in enumerate(sched.levels):  # every pack of a step is under its level's length
        for r in range(4):
            for k in range(2):
                assert mixed.tokens[sched.microbatch(step, r, k)].sum() <= lengths[level]
    assert len(set(sched.levels)) == len(sched.level_sp)  # every level runs
    back = Schedule.from_json(sched.to_json())
    assert back.equals(sched) and np.all(back.sample_counts() == 1)


def test_deterministic_and_reshuffled_per_epoch(mixed):
    a = balance_hbp(mixed, dp_size=4, num_microbatches=2, seed=3, config=_config())
    b = balance_hbp(mixed, dp_size=4, num_microbatches=2, seed=3, config=_config())
    c = balance_hbp(mixed, dp_size=4, num_microbatches=2, seed=3, epoch=1, config=_config())
    assert a.equals(b) and a.levels == b.levels
    assert not a.equals(c) and np.all(c.sample_counts() == 1)
    # a level cache (the planner's SP search) gives the same schedule, from the cache the second time
    cache = {}
    d = balance_hbp(mixed, dp_size=4, num_microbatches=2, seed=3, config=_config(), cache=cache)
    entries = len(cache)
    e = balance_hbp(mixed, dp_size=4, num_microbatches=2, seed=3, config=_config(), cache=cache)
    assert d.equals(a) and e.equals(a) and entries == len(a.level_sp) == len(cache)
    f = balance_hbp(mixed, dp_size=4, num_microbatches=2, seed=3, epoch=1, config=_config(), cache=cache)
    assert f.equals(c) and len(cache) == 2 * entries


@pytest.mark.parametrize("new_dp", [4, 8])
def test_resume_and_reshard_finish_the_epoch_exactly_once(mixed, new_dp):
    sched = balance_hbp(mixed, dp_size=4, num_microbatches=2, seed=5, config=_config())
    done = sched.num_steps // 3
    trained = np.zeros(len(mixed), np.int64)
    leaders = sched.leader_mask()
    for step in range(done):
        for r in np.flatnonzero(leaders[step]):
            for k in range(2):
                trained[sched.microbatch(step, int(r), k)] += 1
    rest = untrained_rows(sched, done)
    assert np.all(trained[rest] == 0) and len(rest) + trained.sum() == len(mixed)
    again = balance_hbp(mixed, dp_size=new_dp, num_microbatches=2, seed=5, rows=rest,
                        config=_config(pack_lengths=level_lengths(sched)))
    total = trained + again.sample_counts()
    assert np.all(total == 1)
    assert set(level_lengths(again)) <= set(level_lengths(sched))


def test_oversize_is_a_named_error_or_listed_when_dropped():
    tokens = np.r_[np.full(40, 300), [9000]]  # 9000 > 2048 per rank x SP 4
    stats = _stats(tokens)
    with pytest.raises(InputError) as err:
        balance_hbp(stats, dp_size=4, num_microbatches=1, config=_config())
    assert err.value.field == "tokens" and err.value.record == "index 40" and "oversize" in str(err.value)
    sched = balance_hbp(stats, dp_size=4, num_microbatches=1, config=_config(oversize="drop"))
    assert sched.dropped.tolist() == [40]
    counts = sched.sample_counts()
    assert counts[40] == 0 and np.all(counts[:40] == 1)


def test_a_world_without_the_needed_sp_degree_makes_long_samples_oversize():
    stats = _stats(np.r_[np.full(60, 100), [5000]])  # 5000 tokens need SP 4 at 2048 per rank
    assert np.all(balance_hbp(stats, dp_size=4, num_microbatches=1, config=_config()).sample_counts() == 1)
    with pytest.raises(InputError) as err:
        balance_hbp(stats, dp_size=6, num_microbatches=1, config=_config())  # SP 4 does not divide 6
    assert err.value.field == "tokens" and err.value.record == "index 60"
    with pytest.raises(InputError) as err:
        balance_hbp(stats, dp_size=3, num_microbatches=1, config=HBPConfig(model=LevelCostModel(
            sp_degrees=(2, 4), a2a_per_token=(0.0, 0.0))))
    assert err.value.field == "sp_degrees"


# -- level choice ------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 8000), min_size=16, max_size=120), st.integers(1, 4),
       st.sampled_from([1, 2]), st.floats(0.0, 1e5), st.floats(0.0, 1.0))
def test_level_choice_equals_exhaustive_search(tokens, max_levels, micro, a2a, recompute):
    stats = _stats(tokens)
    model = LevelCostModel(sp_degrees=(1, 2, 4), a2a_per_token=(0.0, a2a, 1.5 * a2a), max_tokens_per_rank=2048,
                           recompute_tokens=(256, 1024, 2048), recompute_ratio=(0.0, recompute / 2, recompute))
    config = HBPConfig(model=model, max_levels=max_levels, candidate_lengths=(256, 512, 1024, 2048, 4096, 8192))
    best = exhaustive_levels(stats, dp_size=4, num_microbatches=micro, config=config)
    try:
        choice = choose_levels(stats, dp_size=4, num_microbatches=micro, config=config)
    except InputError:
        assert math.isinf(best)
        return
    assert choice.cost == pytest.approx(best, rel=1e-12)
    assert levels_cost(stats, choice.lengths, dp_size=4, num_microbatches=micro, config=config) == pytest.approx(best)
    assert len(choice.lengths) <= max_levels and max(choice.lengths) >= max(tokens)


def test_levels_separate_short_from_long_when_long_needs_sp():
    tokens = np.r_[np.full(400, 200), np.full(40, 6000)]
    choice = choose_levels(_stats(tokens), dp_size=4, num_microbatches=1, config=_config())
    assert len(choice.lengths) >= 2 and choice.sp[0] < choice.sp[-1]


# -- the long-context mixture ------------------------------------------------------------------------
def test_long_context_mixture_shares_and_lengths():
    stats = long_context_mixture(20_000, seed=2)
    assert len(stats) == 20_000
    docs = (stats.tokens >= 8192) & (stats.tokens <= 32768)
    videos = stats.tokens > 32768
    assert 0.13 < docs.mean() < 0.19 and 0.045 < videos.mean() < 0.055
    assert stats.tokens.max() <= 131072 and stats.equals(long_context_mixture(20_000, seed=2))
    small = cpu_long_context_mixture(2000, seed=2)
    assert small.tokens.max() <= 131072 // 16 + 1 and small.tokens.max() > 2048
