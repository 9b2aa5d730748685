"""BalancedBatchSampler as a torch batch sampler: re-iterable, ``len()`` exact in every state, ``set_epoch``
semantics (a pending resume or reshard remainder survives ``set_epoch`` of the current epoch), one pair of
caps for the whole run (recorded in the state), cached schedules."""

from __future__ import annotations

import copy
from functools import lru_cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import omnibal.data.sampler as sampler_mod
from balance_helpers import random_stats
from omnibal.data.balance.api import BalanceConfig, balance
from omnibal.data.balance.tail import GROW_MARGIN
from omnibal.data.metrics import schedule_metrics
from omnibal.data.sampler import BalancedBatchSampler
from omnibal.errors import InputError

STATS = random_stats(240, seed=7)


def make(stats=STATS, *, rank=1, dp=2, m=2, **kw) -> BalancedBatchSampler:
    return BalancedBatchSampler(stats, dp_rank=rank, dp_size=dp, num_microbatches=m, **kw)


@lru_cache(maxsize=8)
def full_epoch(epoch: int) -> tuple:
    """Rank 1's whole epoch on STATS (dp 2 x 2), from a fresh sampler."""
    return tuple(tuple(mb) for mb in make(epoch=epoch))


def as_tuples(batches) -> tuple:
    return tuple(tuple(mb) for mb in batches)


def take(s, k: int) -> list:
    it = iter(s)
    return [next(it) for _ in range(k)]


def train(s, k: int) -> list:
    """:func:`take`, each micro-batch reported trained (what a checkpoint records)."""
    out = take(s, k)
    s.mark_trained(k)
    return out


# ------------------------------------------------------------------------------------ re-iterable, len()


def test_each_iteration_yields_the_whole_epoch_in_the_same_order():
    s = make()
    first, second = list(s), list(s)
    assert len(first) == len(full_epoch(0)) > 0 and second == first  # not an empty second pass
    assert len(s) == len(first)
    s.set_epoch(0)  # the current epoch: still the same schedule
    assert list(s) == first


def test_len_is_what_the_next_iteration_yields_in_every_state():
    full = full_epoch(0)
    s = make()
    assert len(s) == len(full) == len(list(s))  # fresh
    assert len(s) == len(full) and as_tuples(s) == full  # after exhaustion: the whole epoch again
    take(s, 5)  # left part-way by a loop that reports nothing: nothing pending
    assert len(s) == len(full) and as_tuples(s) == full
    take(s, 7)
    s.mark_trained(4)  # left part-way by a loop that reports: restart after the last trained one
    assert len(s) == len(full) - 4 and as_tuples(s) == full[4:]
    s.mark_trained(len(full) - 4)  # all trained: nothing pending any more
    assert len(s) == len(full) and as_tuples(s) == full
    resumed = make()
    # mid-resume, by a loop that reports nothing (a reporting loop's state says so: see trained_reported)
    resumed.load_state_dict({**s.state_dict(), "consumed_microbatches": 10, "trained_reported": False})
    assert len(resumed) == len(full) - 10 and as_tuples(resumed) == full[10:]
    assert len(resumed) == len(full) and as_tuples(resumed) == full  # the resume position was used up
    done = make()
    done.load_state_dict({**s.state_dict(), "consumed_microbatches": len(full)})  # state saved at the end
    assert len(done) == 0 and list(done) == []
    assert len(done) == len(full)


def test_len_after_reshard_and_after_exhausting_the_remainder():
    old = [make(rank=r, dp=2, m=2) for r in range(2)]
    for s in old:
        train(s, 6)
    new = make(rank=0, dp=3, m=1)
    new.load_state_dict(old[0].state_dict(), reshard=True)
    rest = list(copy.deepcopy(new))
    assert len(new) == len(rest) > 0
    assert list(new) == rest
    assert len(new) == len(rest) and list(new) == rest  # the remainder is the epoch's stream until set_epoch


def test_an_iterator_that_is_never_started_consumes_nothing():
    """A DataLoader with workers calls iter() on the batch sampler twice and consumes only the second."""
    s = make()
    s.load_state_dict({**make().state_dict(), "consumed_microbatches": 8})
    unused = iter(s)
    assert as_tuples(iter(s)) == full_epoch(0)[8:]
    del unused
    assert as_tuples(s) == full_epoch(0)


def test_only_the_newest_iteration_moves_the_counters():
    s = make()
    stale = iter(s)
    next(stale)
    fresh = iter(s)
    assert [next(fresh) for _ in range(3)] == [list(mb) for mb in full_epoch(0)[:3]]
    assert [next(stale) for _ in range(5)] == [list(mb) for mb in full_epoch(0)[1:6]]  # still yields ...
    s.mark_trained(3)  # ... but only the newest iteration's 3 can be reported trained
    assert s.state_dict()["consumed_microbatches"] == 3
    with pytest.raises(InputError, match="mark_trained"):
        s.mark_trained(1)


_OPS = st.lists(st.one_of(
    st.tuples(st.just("take"), st.integers(0, 30)),
    st.tuples(st.just("mark"), st.integers(0, 8)),
    st.tuples(st.just("drain"), st.just(0)),
    st.tuples(st.just("set_epoch"), st.integers(0, 2)),
    st.tuples(st.just("reload"), st.just(0)),
), max_size=12)


@settings(max_examples=40, deadline=None)
@given(ops=_OPS)
def test_any_sequence_of_calls_keeps_len_and_the_resume_rules(ops):
    """A model of the module docstring's rules, checked after every call: where the next iteration starts,
    that ``len()`` says so, and that the iteration yields exactly the epoch's stream from there."""
    s = make()
    epoch, pending, tracking, issued, trained = 0, None, False, 0, 0

    def start() -> int:
        if pending is not None:
            return pending
        return trained if tracking and trained < len(full_epoch(epoch)) else 0

    for op, arg in ops:
        full = full_epoch(epoch)
        if op in ("take", "drain"):
            k = len(full) if op == "drain" else arg
            begin = start()
            got = as_tuples(b for _, b in zip(range(k), iter(s))) if k else ()
            if k:  # an iterator that is never started changes nothing
                assert got == full[begin:begin + k]
                pending, issued, trained = None, begin + len(got), begin
        elif op == "mark":
            n = min(arg, issued - trained)
            s.mark_trained(n)
            tracking, trained = True, trained + n
        elif op == "set_epoch":
            s.set_epoch(arg)
            if arg != epoch:
                epoch, pending, issued, trained = arg, None, 0, 0
        else:  # a checkpoint round trip into a new process
            state = s.state_dict()
            assert state["consumed_microbatches"] == trained  # handed out is not trained
            assert state["trained_reported"] == tracking
            s = make(epoch=epoch)
            s.load_state_dict(state)
            pending = issued = trained = state["consumed_microbatches"]
            # a loop that reported trained micro-batches before the checkpoint reports them after it: the
            # resumed sampler records trained ones from the start (not what a DataLoader prefetches)
        assert len(s) == len(full_epoch(epoch)) - start()
    assert as_tuples(s) == full_epoch(epoch)[start():]


# ------------------------------------------------------------------------------------ set_epoch


def test_set_epoch_of_the_current_epoch_keeps_a_pending_resume():
    state = {**make(epoch=1).state_dict(), "consumed_microbatches": 6}
    s = make()
    s.load_state_dict(state)
    s.set_epoch(1)  # the usual loop: load, then set_epoch(state's epoch)
    assert s.epoch == 1 and as_tuples(s) == full_epoch(1)[6:]
    s.load_state_dict(state)
    s.set_epoch(2)  # another epoch: from its beginning
    assert as_tuples(s) == full_epoch(2)
    s.set_epoch(1)
    assert as_tuples(s) == full_epoch(1)
    with pytest.raises(InputError) as err:
        s.set_epoch(-1)
    assert err.value.field == "epoch"


def test_the_resume_loop_continues_a_resharded_epoch_exactly_once():
    """``load_state_dict(state, reshard=True); for epoch in ...: set_epoch(epoch)`` keeps the remainder."""
    stats = random_stats(600, seed=3)
    old = [make(stats, rank=r, dp=4, m=1, epoch=1) for r in range(4)]
    trained = [i for s in old for mb in train(s, 5) for i in mb]
    state = old[2].state_dict()
    new = [make(stats, rank=r, dp=2, m=2) for r in range(2)]
    seen = {1: list(trained), 2: []}
    for s in new:
        s.load_state_dict(state, reshard=True)
        for epoch in (1, 2):
            s.set_epoch(epoch)
            assert len(s) == len(list(copy.deepcopy(s)))
            if epoch == 1:
                assert s.state_dict()["remainder"] is not None
            seen[epoch] += [i for mb in s for i in mb]
        assert s.state_dict()["remainder"] is None  # another epoch forgets the remainder
    assert sorted(seen[1]) == list(range(600))  # the resharded epoch: every row once
    assert sorted(seen[2]) == list(range(600))
    # the remainder was balanced under the new world's caps
    probe = make(stats, rank=0, dp=2, m=2)
    probe.load_state_dict(state, reshard=True)
    sched, rows = probe.schedule()
    feats = sched.features(stats.take(rows), padding="varlen")
    assert feats[..., 1].max() <= probe.caps[0] and feats[..., 2].max() <= probe.caps[1]
    assert (sched.caps.tiles, sched.caps.tokens) == probe.caps


# ------------------------------------------------------------------------------------ caps


@lru_cache(maxsize=1)
def synthetic_20k():
    from omnibal.stats.synthetic import synthetic_internvl_mixture

    return synthetic_internvl_mixture(20_000, seed=0)


def test_caps_hold_for_every_epoch_of_a_20k_synthetic_mixture():
    stats = synthetic_20k()
    s = make(stats, rank=0, dp=4, m=4)
    q_v, q_t = s.caps
    steps0 = s.schedule()[0].num_steps
    free_t = set()
    for epoch in range(5):
        s.set_epoch(epoch)
        sched, _ = s.schedule()
        feats = sched.features(stats, padding="varlen")
        assert feats[..., 1].max() <= q_v and feats[..., 2].max() <= q_t, epoch  # every pack fits the buffer
        assert (sched.caps.tiles, sched.caps.tokens) == (q_v, q_t) == s.caps
        assert (sched.sample_counts() == 1).all()  # exactly once, nothing dropped
        free = balance(stats, dp_size=4, num_microbatches=4, seed=0, epoch=epoch)
        free_t.add(free.caps.tokens)
        if epoch:  # as balanced as with free caps, and about as many steps
            fixed_m, free_m = schedule_metrics(sched, stats), schedule_metrics(free, stats)
            for key in ("vision_max_mean_ranks", "llm_max_mean_ranks", "llm_max_mean_microbatches"):
                assert fixed_m[key] <= free_m[key] + 0.002, (epoch, key, fixed_m[key], free_m[key])
        # epoch 0's pack count (the cap search's target_samples) holds: the same steps per epoch, give or
        # take the 1% of room a retry adds
        assert abs(sched.num_steps - steps0) <= 0.015 * steps0, (epoch, sched.num_steps, steps0)
    # free caps come from the body of the distribution, not its tail: the cap search's Q_t is the same every
    # epoch, and the packer grows it only to packs a little over (by what a step of new packs would save, 2 / steps
    # relative, plus ``tail.GROW_MARGIN``: new steps must save more than that to be worth a second levelling), so
    # no epoch's free Q_t outgrows the run's by more than that, rounded up to the token multiple. Which epoch's is
    # the largest is down to the epoch's draw (4232-4304 here).
    assert max(free_t) <= -(-int(q_t * (1 + 2 / steps0 + GROW_MARGIN)) // 8) * 8, (sorted(free_t), q_t, steps0)


def test_user_caps_are_the_run_caps():
    config = BalanceConfig(max_tiles=60, max_tokens=20_000)
    s = make(random_stats(400, seed=2), config=config)
    assert s.caps == (60, 20_000)
    for epoch in range(3):
        s.set_epoch(epoch)
        sched, _ = s.schedule()
        assert (sched.caps.tiles, sched.caps.tokens) == (60, 20_000)
        assert sched.meta["config"] == config.to_dict()  # used as given


def test_methods_that_cannot_pack_under_caps_are_refused():
    with pytest.raises(InputError) as err:
        make(config=BalanceConfig(method="random"))
    assert err.value.field == "method"


def test_state_records_the_caps_and_other_caps_are_refused():
    s = make()
    take(s, 3)
    state = s.state_dict()
    assert state["caps"] == {"tiles": s.caps[0], "tokens": s.caps[1]}
    other = {**state, "caps": {"tiles": s.caps[0], "tokens": s.caps[1] + 8}}
    with pytest.raises(InputError, match="reshard=True"):
        make().load_state_dict(other)
    for bad, field in ((other, "caps"), ({k: v for k, v in state.items() if k != "caps"}, "caps"),
                       ({**state, "remainder": {"rows": [0, 0]}}, "remainder"),
                       ({**state, "consumed_microbatches": 10_000}, "consumed_microbatches")):
        with pytest.raises(InputError) as err:
            make().load_state_dict(bad)
        assert err.value.field == field
    with pytest.raises(InputError) as err:  # same world, other caps: its stream cannot be rebuilt
        make().load_state_dict(other, reshard=True)
    assert err.value.field == "caps"


def test_reshard_accepts_the_other_worlds_caps_and_keeps_its_own():
    stats = random_stats(900, seed=5)
    old = make(stats, rank=0, dp=4, m=1)
    new = make(stats, rank=0, dp=5, m=1)
    # 4 vs 5 micro-batches per step: other pack counts, other caps (3 x 2 gives the same 27/8352 since the
    # cap search's window is samples_tolerance wide)
    assert old.caps != new.caps
    take(old, 4)
    with pytest.raises(InputError) as err:
        new.load_state_dict(old.state_dict())
    assert err.value.field == "dp_size"
    new.load_state_dict(old.state_dict(), reshard=True)
    assert new.state_dict()["caps"] == {"tiles": new.caps[0], "tokens": new.caps[1]}


# ------------------------------------------------------------------------------------ fixed-cap retries


def test_a_failed_fixed_cap_epoch_is_retried_with_more_room(monkeypatch):
    calls = []

    def flaky(stats, **kw):
        calls.append(kw["config"].token_slack)
        if len(calls) == 1:
            raise InputError("could not pack under the fixed caps", source="caps", field="max_tokens")
        return balance(stats, **kw)

    monkeypatch.setattr(sampler_mod, "balance", flaky)
    config = BalanceConfig(max_tiles=60, max_tokens=20_000)
    sched = sampler_mod.balance_under_caps(STATS, dp_size=2, num_microbatches=2, seed=0, epoch=1, config=config)
    assert calls == [config.token_slack, pytest.approx(config.token_slack + sampler_mod.SLACK_STEP)]
    assert (sched.sample_counts() == 1).all()


def test_an_epoch_that_never_fits_raises_naming_the_cap(monkeypatch):
    def never(stats, **kw):
        raise InputError("could not pack under the fixed caps", source="caps", field="max_tokens")

    monkeypatch.setattr(sampler_mod, "balance", never)
    with pytest.raises(InputError, match="does not pack under the caps") as err:
        sampler_mod.balance_under_caps(STATS, dp_size=2, num_microbatches=2, seed=0, epoch=1,
                                       config=BalanceConfig(max_tiles=60, max_tokens=20_000))
    assert err.value.field == "max_tokens"


# ------------------------------------------------------------------------------------ caching


def test_len_and_schedule_do_not_rebalance(monkeypatch):
    calls = []

    def counting(stats, **kw):
        calls.append(kw["epoch"])
        return balance(stats, **kw)

    monkeypatch.setattr(sampler_mod, "balance", counting)
    s = make(synthetic_20k(), rank=0, dp=4, m=4)
    n = len(s)
    assert calls == [0]  # epoch 0 is the schedule the caps come from: one balance
    for _ in range(200):
        assert len(s) == n
        s.schedule()
    assert len(list(s)) == n and s.caps and calls == [0]
    s.set_epoch(1)
    len(s), len(s), s.schedule(), list(s)
    assert calls == [0, 1]


def test_a_remainder_that_does_not_fit_the_caps_is_refused_and_the_sampler_is_unchanged(monkeypatch):
    old = make(rank=0, dp=2, m=2)
    train(old, 4)
    state = old.state_dict()
    new = make(rank=0, dp=3, m=1)
    before = list(copy.deepcopy(new))
    real = sampler_mod.balance_under_caps

    def no_room(stats, **kw):
        if len(stats) < len(STATS):  # the remainder
            raise InputError("could not pack under the fixed caps", source="caps", field="max_tokens")
        return real(stats, **kw)

    monkeypatch.setattr(sampler_mod, "balance_under_caps", no_room)
    with pytest.raises(InputError, match="left in the epoch do not pack") as err:
        new.load_state_dict(state, reshard=True)
    assert err.value.field == "caps"
    assert new.state_dict()["remainder"] is None and list(new) == before
