"""omnibal's balancer, the Schedule format, costs, caps and oversize policies."""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from balance_helpers import assert_exactly_once, random_stats, real_stats
from omnibal.cost.table import LayerCostTable, pack_features
from omnibal.data.balance import DEFAULT_COST, BalanceConfig, BalanceCost, Schedule, balance
from omnibal.data.balance.caps import choose_caps
from omnibal.data.balance.packer import _deal
from omnibal.data.metrics import schedule_metrics
from omnibal.errors import InputError
from omnibal.stats.table import SampleStats


@pytest.mark.parametrize("dp_size", [8, 32])
def test_real_stats_meet_balance_targets(shared_stats_dir, dp_size):
    stats = real_stats(str(shared_stats_dir), "merged")
    sched = balance(stats, dp_size=dp_size)
    assert_exactly_once(sched)
    m = schedule_metrics(sched, stats)
    assert m["vision_max_mean_ranks"] <= 1.010
    assert m["llm_max_mean_ranks"] <= 1.010
    assert m["buffer_pad_tiles"] <= 0.03 and m["buffer_pad_tokens"] <= 0.03
    assert m["microbatches_over_caps"] == 0
    assert 4.0 <= m["samples_per_microbatch_mean"] <= 5.0


def test_deterministic_and_reshuffled_per_epoch():
    stats = random_stats(3000, seed=1)
    a = balance(stats, dp_size=4, num_microbatches=2, seed=7, epoch=0)
    b = balance(stats, dp_size=4, num_microbatches=2, seed=7, epoch=0)
    c = balance(stats, dp_size=4, num_microbatches=2, seed=7, epoch=1)
    assert a.equals(b) and a.to_json() == b.to_json()
    assert not a.equals(c)
    assert_exactly_once(c)
    # a new epoch builds new packs, not just a new order of the same packs
    packs_a = {tuple(sorted(a.pack(k).tolist())) for k in range(a.num_packs)}
    packs_c = {tuple(sorted(c.pack(k).tolist())) for k in range(c.num_packs)}
    assert len(packs_a & packs_c) < 0.5 * len(packs_a)


def test_json_is_the_stable_form_and_round_trips(tmp_path):
    stats = random_stats(500, seed=2)
    sched = balance(stats, dp_size=2, num_microbatches=3)
    path = tmp_path / "s.json"
    sched.to_json(path)
    d = json.loads(path.read_text())
    assert {"dp_size", "num_microbatches", "caps", "steps"} <= d.keys()
    assert set(d["caps"]) == {"tiles", "tokens"}
    assert len(d["steps"]) == sched.num_steps
    assert all(len(step) == 2 and all(len(rank) == 3 for rank in step) for step in d["steps"])
    rows = [i for step in d["steps"] for rank in step for mb in rank for i in mb]
    assert sorted(rows) == list(range(len(stats)))
    back = Schedule.from_json(path)
    assert back.equals(sched)
    assert np.allclose(back.features(stats), sched.features(stats))
    with pytest.raises(InputError):
        Schedule.from_json('{"dp_size": 2}')


def test_features_match_the_cost_contract():
    stats = random_stats(400, seed=3)
    sched = balance(stats, dp_size=2)
    f = sched.features(stats)
    assert f.shape == (sched.num_steps, 2, 1, 4)
    k = int(sched.pack_ids[0, 1, 0])
    rows = sched.pack(k)
    t = stats.tokens[rows].astype(float)
    assert f[0, 1, 0].tolist() == [1.0, float(stats.tiles[rows].sum()), t.sum(), (t * t).sum()]
    per_pack = pack_features(stats.tiles[sched.pack_samples], stats.tokens[sched.pack_samples], sched.pack_offsets)
    assert np.allclose(per_pack[sched.pack_ids], f)
    fixed = sched.features(stats, padding="fixed_buffer")
    assert (fixed[..., 2] == sched.caps.tokens).all() and (fixed[..., 1] == sched.caps.tiles).all()


def test_caps_are_respected_and_packs_fill_both_buffers():
    stats = random_stats(6000, seed=4, max_tiles=6)
    sched = balance(stats, dp_size=8)
    f = sched.features(stats)
    assert (f[..., 1] <= sched.caps.tiles).all() and (f[..., 2] <= sched.caps.tokens).all()
    m = schedule_metrics(sched, stats)
    assert m["buffer_pad_tiles"] < 0.05 and m["buffer_pad_tokens"] < 0.05
    assert m["vision_max_mean_ranks"] < 1.02 and m["llm_max_mean_ranks"] < 1.02


def test_fixed_caps_budget():
    stats = random_stats(3000, seed=5, max_tiles=4)
    cfg = BalanceConfig(max_tiles=24, max_tokens=8192)
    sched = balance(stats, dp_size=4, config=cfg)
    assert sched.caps.tiles == 24 and sched.caps.tokens == 8192
    f = sched.features(stats)
    assert (f[..., 1] <= 24).all() and (f[..., 2] <= 8192).all()
    assert_exactly_once(sched)


def test_oversize_policies():
    stats = SampleStats.from_arrays(tiles=[1] * 200 + [13, 13], tokens=[300] * 200 + [3700, 3800])
    with pytest.raises(InputError) as exc:
        balance(stats, dp_size=2, config=BalanceConfig(max_tiles=12, max_tokens=4096))
    assert "200" in str(exc.value) and "201" in str(exc.value)
    own = balance(stats, dp_size=2, config=BalanceConfig(max_tiles=12, max_tokens=4096, oversize="own_pack"))
    assert_exactly_once(own)
    alone = [k for k in range(own.num_packs) if 200 in own.pack(k).tolist() or 201 in own.pack(k).tolist()]
    assert all(len(own.pack(k)) == 1 for k in alone)
    dropped = balance(stats, dp_size=2, config=BalanceConfig(max_tiles=12, max_tokens=4096, oversize="drop"))
    assert dropped.dropped.tolist() == [200, 201]
    assert_exactly_once(dropped)
    assert schedule_metrics(dropped, stats)["coverage_dropped"] == 2


def test_bad_inputs_are_named():
    empty = SampleStats.from_arrays(tiles=np.zeros(0, int), tokens=np.zeros(0, int))
    with pytest.raises(InputError, match="empty"):
        balance(empty, dp_size=2)
    small = random_stats(10, seed=6)
    with pytest.raises(InputError, match="dp_size"):
        balance(small, dp_size=16)
    with pytest.raises(InputError, match="dp_size"):
        balance(small, dp_size=0)
    with pytest.raises(InputError, match="method"):
        BalanceConfig(method="magic")
    with pytest.raises(InputError):
        choose_caps(np.array([1, 2]), np.array([10, 20]), slots_per_step=1, max_tiles=1, max_tokens=5)
    sched = balance(random_stats(50, seed=7), dp_size=2)
    with pytest.raises(InputError, match="fingerprint|samples"):
        sched.features(random_stats(50, seed=8))


def test_cost_defaults_and_cost_table():
    vision, llm = DEFAULT_COST.vision_coef, DEFAULT_COST.llm_coef
    assert 3.4e13 < vision[1] < 3.8e13  # ~12 TFLOP forward per tile, x3 for training
    assert 1.1e11 < llm[2] < 1.2e11 and 1.7e6 < llm[3] < 1.8e6
    kinds = ("vision_embed", "vision_block", "projector", "llm_embed", "llm_block", "lm_head")
    fwd = np.arange(24, dtype=float).reshape(6, 4)
    zeros6 = np.zeros(6)
    table = LayerCostTable(names=tuple(f"l{i}" for i in range(6)), kinds=kinds, fwd_time=fwd, bwd_time=2 * fwd,
                           act_bytes=fwd, ckpt_bytes=fwd, out_bytes=fwd, param_bytes=zeros6, grad_bytes=zeros6,
                           optim_bytes=zeros6)
    cost = BalanceCost.from_cost_table(table)
    assert np.allclose(cost.vision_coef, 3 * fwd[:3].sum(0))
    assert np.allclose(cost.llm_coef, 3 * fwd[3:].sum(0))
    feats = np.array([[1.0, 2.0, 3.0, 4.0]])
    vis, llm = cost.evaluate(feats)
    assert np.allclose(vis + llm, table.evaluate("fwd_time", feats).sum(-1) * 3)
    with pytest.raises(InputError):
        BalanceCost(vision_coef=(0, -1, 0, 0), llm_coef=(0, 0, 1, 0))


def test_token_budget_only():
    stats = random_stats(3000, seed=9, max_tiles=4)
    sched = balance(stats, dp_size=4, config=BalanceConfig(max_tokens=6000))
    f = sched.features(stats)
    assert sched.caps.tokens == 6000 and (f[..., 2] <= 6000).all() and (f[..., 1] <= sched.caps.tiles).all()
    assert_exactly_once(sched)


# ------------------------------------------------------------------------------------ termination
# A stalled dealing loop once hung balance() forever on a few hundred small samples (choose_caps ->
# _trial_pad -> _deal). These properties need no time limit in the code under test to fail rather than hang:
# _deal is checked in-process (it asserts its own round bound), balance() in a forked child with a deadline.

@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 150), p_frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**32 - 1),
       max_v=st.integers(1, 14), max_t=st.integers(1, 900), cap_v=st.integers(1, 40), cap_t=st.integers(1, 6000))
def test_deal_places_every_sample_once_under_any_caps(n, p_frac, seed, max_v, max_t, cap_v, cap_t):
    """Whatever the caps (also caps nothing fits), dealing ends and places every sample exactly once."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, max_v + 1, n).astype(np.float64)
    t = v * 4 + rng.integers(1, max_t + 1, n)
    p = 1 + int(p_frac * (n - 1))
    slots = _deal(v, t, t, p, cap_v, cap_t, np.random.default_rng(seed))
    assert slots.shape[0] == p
    placed = slots[slots < n]
    assert np.array_equal(np.sort(placed), np.arange(n))


def _balance_in_child(stats, dp, m, seed, config) -> None:
    """Runs in a forked child: exit 0 (scheduled, exactly once), 3 (a named InputError), 1 (anything else)."""
    try:
        sched = balance(stats, dp_size=dp, num_microbatches=m, seed=seed, config=config)
        assert_exactly_once(sched)
    except InputError:
        os._exit(3)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


# no shrinking: every hanging example costs the full deadline, so shrinking one would take many minutes
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(n=st.integers(1, 200), seed=st.integers(0, 10_000), dp=st.integers(1, 4), m=st.integers(1, 3),
       max_v=st.integers(1, 6), max_text=st.sampled_from([24, 400, 2000]),
       caps=st.one_of(st.none(), st.tuples(st.integers(2, 24), st.integers(64, 8000))))
def test_balance_terminates_on_small_random_stats(n, seed, dp, m, max_v, max_text, caps):
    """balance() of up to 200 samples takes well under a second; a child still running after 20 s is a hang."""
    rng = np.random.default_rng(seed)
    tiles = rng.integers(0, max_v + 1, n)
    tokens = tiles * 4 + rng.integers(5, max_text, n)
    stats = SampleStats.from_arrays(tiles=tiles, tokens=tokens, source="random")
    config = BalanceConfig() if caps is None else BalanceConfig(max_tiles=caps[0], max_tokens=caps[1],
                                                                oversize="own_pack")
    child = multiprocessing.get_context("fork").Process(target=_balance_in_child,
                                                        args=(stats, dp, m, seed, config))
    child.start()
    child.join(20)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"balance() of {n} samples at dp {dp} x {m} (caps {caps}) did not finish in 20 s")
    ok = {0} if caps is None and n >= dp * m else {0, 3}  # fixed caps or too few samples may be refused
    assert child.exitcode in ok, f"balance() failed in the child (exit {child.exitcode}); see its stderr"
