"""BalancedBatchSampler: per-rank streams, resume, reshard, DataLoader workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from balance_helpers import random_stats
from omnibal.data.sampler import BalancedBatchSampler
from omnibal.errors import InputError


def _streams(stats, dp, m=1, **kw):
    return [list(BalancedBatchSampler(stats, dp_rank=r, dp_size=dp, num_microbatches=m, **kw)) for r in range(dp)]


def test_ranks_cover_the_epoch_once_with_equal_lengths():
    stats = random_stats(1200, seed=0)
    streams = _streams(stats, 4, 2)
    assert len({len(s) for s in streams}) == 1
    assert len(streams[0]) % 2 == 0
    rows = sorted(i for s in streams for mb in s for i in mb)
    assert rows == list(range(1200))
    assert all(isinstance(i, int) for i in streams[0][0])
    sampler = BalancedBatchSampler(stats, dp_rank=0, dp_size=4, num_microbatches=2)
    assert len(sampler) == len(streams[0])


def test_set_epoch_reshuffles():
    stats = random_stats(600, seed=1)
    s = BalancedBatchSampler(stats, dp_rank=1, dp_size=2)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    s.set_epoch(0)
    assert list(s) == e0 and e0 != e1


@settings(max_examples=15, deadline=None)
@given(n=st.integers(8, 300), dp=st.integers(1, 4), m=st.integers(1, 2), k=st.integers(0, 40), seed=st.integers(0, 99))
def test_resume_after_k_reproduces_the_rest_on_every_rank(n, dp, m, k, seed):
    assume(n >= dp * m)
    stats = random_stats(n, seed=seed)
    for rank in range(dp):
        full = list(BalancedBatchSampler(stats, dp_rank=rank, dp_size=dp, num_microbatches=m, seed=seed))
        first = BalancedBatchSampler(stats, dp_rank=rank, dp_size=dp, num_microbatches=m, seed=seed)
        it = iter(first)
        head = [next(it) for _ in range(min(k, len(full)))]
        first.mark_trained(len(head))
        state = first.state_dict()
        second = BalancedBatchSampler(stats, dp_rank=rank, dp_size=dp, num_microbatches=m, seed=seed)
        second.load_state_dict(state)
        assert head + list(second) == full


def test_state_from_other_stats_or_world_is_refused():
    stats = random_stats(500, seed=2)
    s = BalancedBatchSampler(stats, dp_rank=0, dp_size=4)
    next(iter(s))
    state = s.state_dict()
    with pytest.raises(InputError, match="fingerprint"):
        BalancedBatchSampler(random_stats(500, seed=3), dp_rank=0, dp_size=4).load_state_dict(state)
    with pytest.raises(InputError, match="dp_size"):
        BalancedBatchSampler(stats, dp_rank=0, dp_size=2).load_state_dict(state)
    with pytest.raises(InputError, match="seed"):
        BalancedBatchSampler(stats, dp_rank=0, dp_size=4, seed=9).load_state_dict(state)
    with pytest.raises(InputError, match="dp_rank"):
        BalancedBatchSampler(stats, dp_rank=4, dp_size=4)


@pytest.mark.parametrize("old_m,new_dp,new_m", [(1, 3, 1), (2, 2, 3)])
def test_reshard_finishes_the_epoch_exactly_once(old_m, new_dp, new_m):
    stats = random_stats(900, seed=4)
    old = [BalancedBatchSampler(stats, dp_rank=r, dp_size=4, num_microbatches=old_m) for r in range(4)]
    its = [iter(s) for s in old]
    consumed = [i for it in its for _ in range(5) for i in next(it)]  # 5 micro-batches on every rank
    old[0].mark_trained(5)
    state = old[0].state_dict()
    new = [BalancedBatchSampler(stats, dp_rank=r, dp_size=new_dp, num_microbatches=new_m) for r in range(new_dp)]
    for s in new:
        s.load_state_dict(state, reshard=True)
    rest = [list(s) for s in new]
    assert len({len(r) for r in rest}) == 1
    rows = consumed + [i for r in rest for mb in r for i in mb]
    assert sorted(rows) == list(range(900))
    # same remainder on every rank, and resumable itself
    assert new[0].state_dict()["remainder"] == new[1].state_dict()["remainder"]


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


def test_dataloader_with_two_workers():
    stats = random_stats(256, seed=5)
    sampler = BalancedBatchSampler(stats, dp_rank=1, dp_size=2, num_microbatches=2)
    expected = list(BalancedBatchSampler(stats, dp_rank=1, dp_size=2, num_microbatches=2))
    loader = torch.utils.data.DataLoader(_Indexed(256), batch_sampler=sampler, num_workers=2,
                                         collate_fn=lambda items: [int(x) for x in items])
    got = list(loader)
    assert got == expected
    assert np.isin(np.concatenate([np.array(g) for g in got]), np.arange(256)).all()


def test_state_counts_trained_microbatches_not_prefetched_ones():
    """mark_trained: the state records what the loop trained; a new iteration hands out the rest again."""
    stats = random_stats(400, seed=4)
    s = BalancedBatchSampler(stats, dp_rank=0, dp_size=2, num_microbatches=2)
    full = list(BalancedBatchSampler(stats, dp_rank=0, dp_size=2, num_microbatches=2))
    it = iter(s)
    pulled = [next(it) for _ in range(7)]  # what a DataLoader with workers pulls ahead
    assert s.state_dict()["consumed_microbatches"] == 0  # nothing reported: handed out is not trained
    s.mark_trained(2)  # one step of two micro-batches trained
    s.mark_trained(2)
    assert s.trained_microbatches == 4 and s.state_dict()["consumed_microbatches"] == 4
    with pytest.raises(InputError, match="mark_trained"):
        s.mark_trained(4)  # only 3 more were handed out
    with pytest.raises(InputError, match="mark_trained"):
        s.mark_trained(-1)
    assert pulled == full[:7]
    assert list(s) == full[4:]  # the 3 prefetched but untrained micro-batches come again
    resumed = BalancedBatchSampler(stats, dp_rank=0, dp_size=2, num_microbatches=2)
    resumed.load_state_dict({**s.state_dict(), "consumed_microbatches": 4})
    assert list(resumed) == full[4:]
