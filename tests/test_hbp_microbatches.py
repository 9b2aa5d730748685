"""HBP levels with their own micro-batch count: the rule, the Schedule form, exactly-once, resume/reshard."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hbp_helpers import CANDIDATES, MODEL
from omnibal.data.balance.schedule import Caps, Schedule
from omnibal.errors import InputError
from omnibal.hbp.balance import balance_hbp, level_lengths, level_microbatch_counts, untrained_rows
from omnibal.hbp.levels import HBPConfig
from omnibal.stats.long_context import cpu_long_context_mixture


@pytest.fixture(scope="module")
def mixed():
    return cpu_long_context_mixture(1500, seed=1)


def _config(**kw) -> HBPConfig:
    return HBPConfig(model=MODEL, **{"candidate_lengths": CANDIDATES, "microbatches": "tokens", **kw})


# -- the rule -----------------------------------------------------------------------------------------
def test_counts_same_and_by_tokens():
    assert level_microbatch_counts((3072, 32768, 131072), (1, 8, 8), 8, "same") == (8, 8, 8)
    # per SP rank 3,072 / 4,096 / 16,384 tokens: 8 x 16,384 / x
    assert level_microbatch_counts((3072, 32768, 131072), (1, 8, 8), 8, "tokens") == (43, 32, 8)
    # a step budget of the plain plan's 8 x 4,544 tokens: the 6k level runs fewer micro-batches than the job's
    assert level_microbatch_counts((2048, 6144), (2, 1), 8, "tokens", step_tokens=8 * 4544) == (36, 6)
    # a 1F1B pipeline of 8 stages: no level runs fewer than 8
    assert level_microbatch_counts((2048, 6144), (2, 1), 8, "tokens", step_tokens=8 * 4544, least=8) == (36, 8)
    with pytest.raises(InputError) as err:
        level_microbatch_counts((1024,), (1,), 2, "fewest")
    assert err.value.field == "microbatches"
    with pytest.raises(InputError):
        HBPConfig(microbatches="fewest")
    with pytest.raises(InputError) as err:
        HBPConfig(step_tokens=0)
    assert err.value.field == "step_tokens"
    with pytest.raises(InputError) as err:
        HBPConfig(min_microbatches=0)
    assert err.value.field == "min_microbatches"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1 << 17), st.sampled_from((1, 2, 4, 8))), min_size=1, max_size=5),
       st.integers(1, 16))
def test_every_step_holds_about_the_top_levels_tokens_per_rank(levels, m):
    lengths, sp = zip(*levels)
    counts = level_microbatch_counts(lengths, sp, m, "tokens")
    per_rank = [n / d for n, d in zip(lengths, sp)]
    top = max(per_rank)
    assert counts[per_rank.index(top)] == m and min(counts) >= m
    for c, x in zip(counts, per_rank):  # rounded to the nearest count: within half a micro-batch
        assert abs(c * x - m * top) <= x / 2 + 1e-6
    budget = m * 1000
    for c, x in zip(level_microbatch_counts(lengths, sp, m, "tokens", step_tokens=budget), per_rank):
        assert c >= 1 and (abs(c * x - budget) <= x / 2 + 1e-6 or c == 1)


# -- the Schedule form --------------------------------------------------------------------------------
def _ragged() -> Schedule:
    # level 0 (SP 1) runs 2 micro-batches per rank, level 1 (SP 2) one; pack 6 is the empty filler
    return Schedule(dp_size=2, num_microbatches=2, caps=Caps(tiles=1, tokens=8), pack_samples=np.arange(6),
                    pack_offsets=np.array([0, 1, 2, 3, 4, 5, 6, 6]),
                    pack_ids=np.array([[[0, 1], [2, 3]], [[4, 6], [4, 6]], [[5, 6], [5, 6]]]), num_samples=6,
                    levels=(0, 1, 1), level_sp=(1, 2), level_microbatches=(2, 1))


def test_ragged_schedule_counts_runs_and_round_trips():
    sched = _ragged()
    assert sched.step_microbatches().tolist() == [2, 1, 1]
    assert sched.slot_mask().tolist() == [[True, True], [True, False], [True, False]]
    assert sched.sample_counts().tolist() == [1] * 6
    d = json.loads(sched.to_json())
    assert d["level_microbatches"] == [2, 1] and [len(r) for s in d["steps"] for r in s] == [2, 2, 1, 1, 1, 1]
    back = Schedule.from_json(sched.to_json())
    assert back.equals(sched) and back.level_microbatches == (2, 1) and back.sample_counts().tolist() == [1] * 6
    tiles, tokens = np.ones(6, np.int64), np.full(6, 3, np.int64)

    class Stats:
        def __len__(self):
            return 6

    stats = Stats()
    stats.tiles, stats.tokens = tiles, tokens
    feats = sched.features(stats)
    assert feats[1, :, 1].sum() == 0 and feats[0, :, :, 0].sum() == 4  # the filler slots cost nothing


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(level_microbatches=[2]), "level_microbatches"),
    (lambda d: d.update(level_microbatches=[1, 1]), "level_microbatches"),  # the largest must be num_microbatches
    (lambda d: d.update(level_microbatches=[3, 1]), "level_microbatches"),
    (lambda d: d["steps"][1][0].append([0]), "steps"),  # a level-1 step lists 2 micro-batches
    (lambda d: [d.pop("levels"), d.pop("level_sp")], "levels"),
])
def test_bad_level_microbatches_json_is_a_named_error(edit, field):
    d = _ragged().to_dict()
    edit(d)
    with pytest.raises(InputError) as err:
        Schedule.from_dict(d, source="sched.json")
    assert err.value.field == field and err.value.source == "sched.json"


# -- balancing ----------------------------------------------------------------------------------------
def test_balanced_levels_get_their_counts_and_every_sample_once(mixed):
    sched = balance_hbp(mixed, dp_size=4, num_microbatches=2, seed=3, config=_config())
    lengths = level_lengths(sched)
    expect = level_microbatch_counts(lengths, sched.level_sp, 2, "tokens")
    assert sched.level_microbatches == expect and max(expect) > 2  # the short levels run more micro-batches
    assert sched.meta["hbp"]["level_microbatches"] == list(expect)
    assert np.all(sched.sample_counts() == 1) and sched.sp_group_mismatch() is None
    sizes = sched.pack_sizes()[sched.pack_ids]  # [S, D, M]
    runs = np.broadcast_to(sched.slot_mask()[:, None, :], sizes.shape)
    assert np.all(sizes[runs] > 0) and not sizes[~runs].any()  # no empty micro-batch runs, no filler holds rows
    for step, level in enumerate(sched.levels):
        for r in range(4):
            for k in range(expect[level]):
                assert mixed.tokens[sched.microbatch(step, r, k)].sum() <= lengths[level]
    back = Schedule.from_json(sched.to_json())
    assert back.equals(sched) and np.all(back.sample_counts() == 1)
    same = balance_hbp(mixed, dp_size=4, num_microbatches=2, seed=3, config=_config(microbatches="same"))
    assert same.level_microbatches is None and same.num_steps > sched.num_steps


@pytest.mark.parametrize("new_dp", [4, 8])
def test_resume_and_reshard_exactly_once(mixed, new_dp):
    sched = balance_hbp(mixed, dp_size=4, num_microbatches=2, seed=5, config=_config())
    done = sched.num_steps // 3
    trained = np.zeros(len(mixed), np.int64)
    counts, leaders = sched.step_microbatches(), sched.leader_mask()
    for step in range(done):
        for r in np.flatnonzero(leaders[step]):
            for k in range(counts[step]):
                trained[sched.microbatch(step, int(r), k)] += 1
    rest = untrained_rows(sched, done)
    assert np.all(trained[rest] == 0) and len(rest) + trained.sum() == len(mixed)
    again = balance_hbp(mixed, dp_size=new_dp, num_microbatches=2, seed=5, rows=rest,
                        config=_config(pack_lengths=level_lengths(sched)))
    assert np.all(trained + again.sample_counts() == 1)


def test_metrics_count_only_the_micro_batches_a_step_runs(mixed):
    from omnibal.data.metrics import schedule_metrics

    sched = balance_hbp(mixed, dp_size=4, num_microbatches=2, seed=3, config=_config())
    assert sched.level_microbatches is not None
    m = schedule_metrics(sched, mixed)
    runs = np.broadcast_to(sched.slot_mask()[:, None, :], sched.pack_ids.shape)
    sizes = sched.pack_sizes()[sched.pack_ids[runs]]
    # the filler slots are neither empty micro-batches nor steps left out of the averages
    assert m["steps_with_empty_microbatches"] == 0 and m["empty_microbatches"] == 0
    assert m["samples_per_microbatch_mean"] == pytest.approx(sizes.mean()) and m["samples_per_microbatch_min"] >= 1
    assert m["coverage_ok"] and 1.0 <= m["llm_max_mean_microbatches"] < 3.0
