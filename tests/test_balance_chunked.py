"""Very large inputs are packed in chunks (``omnibal.data.balance.chunked``) by a pool of worker processes:
the schedule must not depend on how many, every sample still runs exactly once under the caps, and inputs
under the cutover keep the plain packer's schedules. Small inputs with a small ``chunk_rows`` stand in for
the 10M rows the chunks are for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balance_helpers import assert_exactly_once, random_stats
from omnibal.data.balance import BalanceConfig, balance
from omnibal.data.balance.api import CHUNK_ROWS
from omnibal.data.balance.chunked import num_chunks, shave_tokens, size_order, split_packs, split_rows
from omnibal.errors import InputError

SMALL = 1024
"""``chunk_rows`` of the tests: 6000 rows make 6 chunks."""


def _caps_held(sched, stats) -> None:
    f = sched.features(stats)
    assert (f[..., 1] <= sched.caps.tiles).all() and (f[..., 2] <= sched.caps.tokens).all()


@pytest.mark.parametrize("layout, caps", [((8, 1), {}), ((4, 2), {"max_tiles": 14, "max_tokens": 4096})])
def test_the_schedule_is_the_same_for_one_worker_and_two(layout, caps):
    stats = random_stats(6000, seed=3, max_tiles=6)
    dp, micro = layout
    one, two, every = (balance(stats, dp_size=dp, num_microbatches=micro, seed=2, epoch=1,
                               config=BalanceConfig(chunk_rows=SMALL, workers=w, **caps)) for w in (1, 2, 0))
    assert one.meta["chunks"] == 6
    assert np.array_equal(one.pack_ids, two.pack_ids) and np.array_equal(one.pack_samples, two.pack_samples)
    assert one.to_json() == two.to_json() == every.to_json()
    for sched in (one, two):
        assert_exactly_once(sched)
        _caps_held(sched, stats)
    if caps:
        assert (one.caps.tiles, one.caps.tokens) == (14, 4096)


def test_own_packs_and_chunks_fill_whole_steps():
    stats = random_stats(6000, seed=5, max_tiles=8)
    config = BalanceConfig(chunk_rows=SMALL, max_tiles=7, max_tokens=3000, oversize="own_pack")
    sched = balance(stats, dp_size=8, num_microbatches=2, config=config)
    over = (stats.tiles > 7) | (stats.tokens > 3000)
    assert sched.meta["chunks"] == 6 and sorted(sched.meta["own_packs"]) == np.flatnonzero(over).tolist()
    assert_exactly_once(sched)  # a whole number of steps of 8 x 2 micro-batches, none empty
    for k in range(len(sched.pack_offsets) - 1):
        rows = sched.pack(k)
        if len(rows) > 1 or not over[rows].all():
            assert stats.tiles[rows].sum() <= 7 and stats.tokens[rows].sum() <= 3000


def test_chunked_packs_stay_balanced_and_level():
    stats = random_stats(6000, seed=4, max_tiles=6)
    plain = balance(stats, dp_size=8, config=BalanceConfig(chunk_rows=None))
    chunked = balance(stats, dp_size=8, config=BalanceConfig(chunk_rows=SMALL))
    from omnibal.data.metrics import schedule_metrics

    m_plain, m_chunked = schedule_metrics(plain, stats), schedule_metrics(chunked, stats)
    assert m_chunked["buffer_pad_compute"] < m_plain["buffer_pad_compute"] + 0.005
    assert m_chunked["vision_max_mean_ranks"] < 1.002 and m_chunked["llm_max_mean_ranks"] < 1.002
    config = BalanceConfig()
    per_pack = len(stats) / (chunked.num_steps * 8)
    assert abs(per_pack / config.target_samples - 1) <= config.samples_tolerance


def test_inputs_under_the_cutover_keep_the_plain_schedule():
    stats = random_stats(6000, seed=6, max_tiles=6)
    default = balance(stats, dp_size=8)
    unchunked = balance(stats, dp_size=8, config=BalanceConfig(chunk_rows=None))
    at_cutover = balance(stats, dp_size=8, config=BalanceConfig(chunk_rows=3000, workers=2))  # 6000 = 2 x 3000
    for sched in (unchunked, at_cutover):
        assert np.array_equal(sched.pack_ids, default.pack_ids)
        assert np.array_equal(sched.pack_samples, default.pack_samples)
        assert "chunks" not in sched.meta
    assert "chunk_rows" not in default.meta["config"] and "workers" not in default.meta["config"]
    assert num_chunks(2 * CHUNK_ROWS, 10**6, CHUNK_ROWS) == 1 and num_chunks(10**7, 10**6, CHUNK_ROWS) == 10


def test_a_chosen_chunk_rows_is_recorded_and_read_back():
    config = BalanceConfig(chunk_rows=SMALL, workers=2)
    d = config.to_dict()
    assert d["chunk_rows"] == SMALL and "workers" not in d
    again = BalanceConfig(**{**d, "cost": config.cost})
    assert again.chunk_rows == SMALL and again.workers == 1


@pytest.mark.parametrize("field, value", [("workers", -1), ("workers", 1.5), ("chunk_rows", 10),
                                          ("chunk_rows", 0)])
def test_bad_workers_and_chunk_rows_are_named(field, value):
    with pytest.raises(InputError, match=field):
        BalanceConfig(**{field: value})


@settings(max_examples=60, deadline=None)
@given(count=st.integers(2, 9), base=st.integers(50, 400), extra=st.integers(0, 8), per_row=st.floats(0.05, 0.5),
       step=st.integers(1, 16), spare=st.integers(0, 400))
def test_pack_split_keeps_whole_steps_and_never_more_packs_than_rows(count, base, extra, per_row, step, spare):
    sizes = [base + (i < extra % count) for i in range(count)]  # as ``split_rows`` makes them: within one
    rows = sum(sizes)
    num_packs = max(count, int(rows * per_row) // step * step)
    max_packs = min(rows, num_packs + spare)
    split = split_packs(num_packs, max_packs, sizes, step)
    packs = [p for p, _ in split]
    assert sum(packs) == num_packs
    assert all(1 <= p <= most <= n and (most - p) % step == 0 for (p, most), n in zip(split, sizes))
    assert sum(most for _, most in split) <= max(max_packs, num_packs)
    share = np.array(sizes) * num_packs / rows
    assert (np.abs(np.array(packs) - share) < 1).all()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(10, 3000), count=st.integers(2, 9), seed=st.integers(0, 2**32 - 1))
def test_row_split_is_a_size_stratified_partition(n, count, seed):
    stats = random_stats(n, seed=seed % 1000)
    parts = split_rows(size_order(stats.tiles, stats.tokens)[1], count, np.random.default_rng(seed))
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))
    assert all((np.diff(p) > 0).all() for p in parts)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    tiles = [int(stats.tiles[p].sum()) for p in parts if len(p) == n // count]
    # one sample of each block of ``count`` rows in size order: the totals differ by at most the sum of the
    # blocks' spreads, which is at most the spread of all the rows
    assert max(tiles) - min(tiles) <= int(stats.tiles.max()) - int(stats.tiles.min())


def test_shaving_brings_the_packs_under_the_next_token_multiple_or_leaves_them():
    # packs of two samples each (tiles 1, 1, 2, 2): pack 0 is 3 tokens over 96, the multiple under its 104
    tiles = np.array([1, 1, 1, 1, 2, 2, 2, 2])
    tokens = np.array([50, 49, 40, 41, 30, 30, 20, 21])
    pack_of = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    pack_tokens = np.bincount(pack_of, weights=tokens).astype(float)
    assert pack_tokens.tolist() == [99, 81, 60, 41]
    keys, by_size = size_order(tiles, tokens)
    assert shave_tokens(pack_of, pack_tokens, tokens, keys, by_size, multiple=8)
    assert pack_tokens.max() <= 96 and np.array_equal(pack_tokens, np.bincount(pack_of, weights=tokens))
    assert np.array_equal(np.bincount(pack_of, weights=tiles), [2, 2, 4, 4])  # tile counts kept
    # the least change: 50 (or 49) for 41 -> pack 0 at 90 or 91, pack 1 at 90 or 89
    assert sorted(np.bincount(pack_of, weights=tokens)[:2].tolist()) in ([89, 91], [90, 90])
    # all or none: pack 0 (99) can swap 49 for 46 into pack 2, which leaves no room for pack 1 (100)
    tokens = np.array([50, 49, 50, 50, 46, 45])
    pack_of = np.array([0, 0, 1, 1, 2, 2])
    pack_tokens = np.bincount(pack_of, weights=tokens).astype(float)
    keys, by_size = size_order(np.ones(6, np.int64), tokens)
    assert not shave_tokens(pack_of, pack_tokens, tokens, keys, by_size, multiple=8)
    assert np.array_equal(pack_of, [0, 0, 1, 1, 2, 2]) and pack_tokens.tolist() == [99, 100, 91]
