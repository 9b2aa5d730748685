"""Issue 37: a schedule is a function of its inputs alone, the same on every machine.

Every rank of a multi-node job balances the epoch itself, so two CPUs (AVX-512 and AVX2 pick other numpy sort
and sum kernels) must deal the same packs to the same slots. Pinned here: the schedules of fixed inputs by
hash; the same schedule when numpy runs on an older CPU's kernels (``NPY_DISABLE_CPU_FEATURES``) and when every
unstable sort orders equal keys the other way round; exact pack sums whatever order they are added in; and the
cross-rank check (``Schedule.fingerprint``, ``ScheduleMismatch``, the sampler's ``exchange``) that catches ranks
that built different schedules anyway (other inputs on some node).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balance_helpers import random_stats, real_stats
from omnibal.data.balance import BalanceConfig, balance
from omnibal.data.balance.common import distinct_keys, random_ranks, sorted_order, stable_order, tie_break
from omnibal.data.balance.cost import BalanceCost, to_grid
from omnibal.data.balance.exchange import Packs
from omnibal.data.sampler import BalancedBatchSampler
from omnibal.errors import InputError, ScheduleMismatch
from omnibal.stats.synthetic import synthetic_internvl_mixture
from omnibal.stats.table import SampleStats

ROOT = Path(__file__).resolve().parents[1]

# (stats, balance keywords) of each pinned schedule: the README's failing case (the synthetic default at
# DP 32), an integer-only table whose fixed caps need the tail phase (4 x 2 micro-batches), ISF packs with
# omnibal's assignment
CASES = {
    "synthetic-dp32": ("synthetic", dict(dp_size=32)),
    "tail-4x2": ("tail", dict(dp_size=4, num_microbatches=2, seed=5, epoch=1,
                              config=BalanceConfig(max_tiles=12, max_tokens=4096))),
    "isf+assign-dp8": ("random", dict(dp_size=8, config=BalanceConfig(method="isf+assign", max_tiles=16,
                                                                     max_tokens=6144, isf_iterations=10))),
}
# (Schedule.fingerprint(), SHA-256 of Schedule.to_json()): a change here changes every rank's schedule of
# these inputs. That is allowed (a better packer), but it must be the same change on every machine: rerun
# this test with NPY_DISABLE_CPU_FEATURES (as test_the_schedule_is_the_same_on_older_cpus does) before
# pinning new values.
# Re-pinned by issue 35 (balancer round 3): the packer levels tokens by layers (``layers.level_tokens``), the
# cap search measures its counts by branch and bound with the exchange types of ``tilematch`` in its trials
# and a token check, and the tail rule puts evicted samples into packs with room first and grows the buffer
# unless new steps save more pad: every omnibal schedule changed on purpose (ISF packs with omnibal's
# assignment did not). The older-CPU and reversed-ties tests below pass with them.
# Re-pinned again (issue 35, the remaining goals): with derived caps on inputs up to FALLBACK_ROWS rows the
# packer squeezes the token buffer (``squeeze.squeeze_tokens``) and the cap search measures a third count:
# the derived-caps schedules here changed on purpose (the fixed-cap and ISF ones did not).
# Re-pinned (issue 35, pad cells): the tile repair runs up to ``TILE_REPAIR_ROUNDS`` targeted rounds, and a
# runner-up count whose least pad score beats the chosen packing's by ``FALLBACK_MARGIN`` is packed too: the
# synthetic default at DP 32 now packs 193 steps (compute pad 0.012, was 194 steps and 0.016); the others here
# did not change.
PINNED = {
    "synthetic-dp32": ("a93a1cb2d19b7bb35f01a1a67ffd1db3",
                       "b289052e8d5f2f2fd30551e29a11dc0f04709b02b4523dc0910f38791d4481e7"),
    "tail-4x2": ("f465f5618ea24db69cb59babc037fcea",
                 "c4964e870cb9d9cac47c5641cf6264e77684478477f4658ce7f15083c44e7ace"),
    "isf+assign-dp8": ("9e137c3055c5924ec91a42b019612d4b",
                       "f781685dd9158450dbe2b4598ae5ba37203bd9a5dc6cf4eee95ad1555bad06c6"),
    "ai2d-dp8": ("7d7dd1d7cf5fdc08670957d550d644f4",
                 "f8e316e71668e0e09ea267e4e9e6b63a7caefca8e29cced614a19823e405b09a"),
}
SYNTHETIC_STATS = "f71f1123aa05badd"
"""``SampleStats.fingerprint()`` of the synthetic mixture (its generator draws with np.exp, whose last bit may
differ between CPUs: if this fails, the input changed, not the balancer)."""


KINDS = ("synthetic", "tail", "random")


def _stats(kind: str) -> SampleStats:
    """The input tables; ``tail`` and ``random`` are drawn with integer operations only (the same on every
    machine): 1, 3 and 5-tile samples whose 12 / 4096 caps need new steps of packs, and a VLM-like table."""
    if kind == "synthetic":
        return synthetic_internvl_mixture(30_730, seed=0)
    if kind == "tail":
        rng = np.random.default_rng(3)
        tiles = rng.choice([1, 3, 5], 3000, p=[0.1, 0.1, 0.8])
        return SampleStats.from_arrays(tiles=tiles, tokens=tiles * 256 + rng.integers(50, 400, 3000), source="tail")
    return random_stats(6000, seed=11)


def _digests(schedule) -> tuple[str, str]:
    return schedule.fingerprint(), hashlib.sha256(schedule.to_json().encode()).hexdigest()


@pytest.mark.parametrize("case", sorted(CASES))
def test_schedules_of_fixed_inputs_are_pinned(case):
    kind, kwargs = CASES[case]
    stats = _stats(kind)
    if kind == "synthetic":
        assert stats.fingerprint() == SYNTHETIC_STATS, "the synthetic generator drew other stats here"
    assert _digests(balance(stats, **kwargs)) == PINNED[case]


def test_schedule_of_a_real_subset_is_pinned(shared_stats_dir):
    assert _digests(balance(real_stats(str(shared_stats_dir), "ai2d"), dp_size=8)) == PINNED["ai2d-dp8"]


def _older_cpus() -> list[str]:
    """``NPY_DISABLE_CPU_FEATURES`` values that make numpy run as on older CPUs than this one: each SIMD
    target numpy dispatches to and this CPU has, with every higher one."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    found = [t for t in __cpu_dispatch__ if __cpu_features__.get(t)]
    return [" ".join(found[i:]) for i in range(len(found))]


_WORKER = """
import sys
import numpy as np
try:
    from numpy._core._multiarray_umath import __cpu_features__
except ImportError:
    from numpy.core._multiarray_umath import __cpu_features__
from omnibal.data.balance import balance
from omnibal.stats.table import SampleStats
from test_balance_determinism import CASES

off = sys.argv[2].split()
assert not any(__cpu_features__.get(t) for t in off), "numpy did not disable " + sys.argv[2]
data = np.load(sys.argv[1])
for case, (kind, kwargs) in sorted(CASES.items()):
    stats = SampleStats.from_arrays(tiles=data[kind + "_tiles"], tokens=data[kind + "_tokens"], source=kind)
    print(case, balance(stats, **kwargs).fingerprint())
"""


@pytest.mark.slow
def test_the_schedule_is_the_same_on_older_cpus(tmp_path):
    """numpy picks its sort and reduction kernels by CPU: AVX-512 and AVX2 machines ordered the balancer's
    equal keys differently, and dealt the synthetic default at DP 32 with Q_t 4288 or 4272. Here numpy runs as
    on each older CPU in turn (same input arrays, saved by this process) and must give the same schedules."""
    levels = _older_cpus()
    if not levels:
        pytest.skip("numpy dispatches to no SIMD target above its baseline on this CPU: nothing to compare")
    arrays = {}
    for kind in KINDS:
        stats = _stats(kind)
        arrays |= {kind + "_tiles": stats.tiles, kind + "_tokens": stats.tokens}
    np.savez(tmp_path / "stats.npz", **arrays)
    path = [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    runs = {}
    for off in [""] + levels:
        out = subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path / "stats.npz"), off], capture_output=True,
                             text=True, timeout=300, env={**env, "NPY_DISABLE_CPU_FEATURES": off})
        assert out.returncode == 0, out.stderr[-2000:]
        runs[off or "this CPU"] = out.stdout.split()
    assert len({tuple(v) for v in runs.values()}) == 1, runs


def _reversed_ties(real):
    """``np.argsort`` whose unstable kinds order equal keys in reverse (any order is theirs to pick)."""
    def argsort(a, axis=-1, kind=None, order=None, **kwargs):
        if kind in ("stable", "mergesort") or order is not None:
            return real(a, axis=axis, kind=kind, order=order, **kwargs)
        a = np.asarray(a)
        if axis is None:
            a, axis = a.ravel(), -1
        # a stable sort of the reversed keys takes equal ones last position first
        return a.shape[axis] - 1 - real(np.flip(a, axis), axis=axis, kind="stable")

    return argsort


def test_no_schedule_turns_on_how_an_unstable_sort_orders_ties(monkeypatch):
    """Every sort the balancer runs either has distinct keys or is stable: with ties reversed the schedules of
    the cases above do not move."""
    stats = {kind: _stats(kind) for kind in KINDS}
    before = {case: balance(stats[kind], **kw).fingerprint() for case, (kind, kw) in CASES.items()}
    monkeypatch.setattr(np, "argsort", _reversed_ties(np.argsort))
    assert np.argsort(np.array([1.0, 0.0, 1.0, 0.0])).tolist() == [3, 1, 2, 0]
    assert np.argsort(np.array([[1, 1, 0], [0, 2, 0]]), axis=1).tolist() == [[2, 1, 0], [2, 0, 1]]
    after = {case: balance(stats[kind], **kw).fingerprint() for case, (kind, kw) in CASES.items()}
    assert after == before


def test_pack_sums_do_not_depend_on_the_order_of_the_samples():
    """LLM costs go on an integer grid (``to_grid``), so a pack's sum is exact whatever order its samples are
    added in; float costs (seconds of a calibrated table) are not: their sums over the same samples in another
    order differ in the last bits."""
    stats = synthetic_internvl_mixture(20_000, seed=3)
    cost = BalanceCost(vision_coef=(0.0, 1.3e-3, 0.0, 0.0), llm_coef=(0.0, 0.0, 2.1e-5, 3.7e-10), name="seconds")
    raw = cost.sample_costs(stats.tiles, stats.tokens)[1]
    grid = to_grid(raw)
    assert np.array_equal(grid, np.rint(grid)) and grid.sum() < 2.0**52
    assert np.allclose(grid / grid.max(), raw / raw.max(), rtol=0, atol=2.0**-30)
    rng = np.random.default_rng(0)
    slots = rng.permutation(len(raw))[:19_998].reshape(-1, 6)
    shuffled = np.take_along_axis(slots, rng.permuted(np.tile(np.arange(6), (len(slots), 1)), axis=1), axis=1)
    v, t = stats.tiles.astype(float), stats.tokens.astype(float)
    assert np.array_equal(Packs(slots, v, t, grid).pl, Packs(shuffled, v, t, grid).pl)
    orders = {float(np.sum(raw[p])) for p in (rng.permutation(len(raw)) for _ in range(20))}
    assert len(orders) > 1  # what the grid is for
    assert len({float(np.sum(grid[rng.permutation(len(grid))])) for _ in range(20)}) == 1


def test_distinct_keys_sort_like_their_values_and_break_ties_by_the_ranks():
    rng = np.random.default_rng(1)
    for m in (1, 2, 3, 1000, 1 << 16):
        ranks = random_ranks(m, rng)
        assert len(np.unique(ranks)) == m and ranks.min() >= 0 and ranks.max() < 2 ** max((m - 1).bit_length(), 1)
    values = rng.integers(0, 5, 5000).astype(float) * 0.37
    ranks = random_ranks(5000, rng)
    keys = distinct_keys(values, ranks)
    assert len(np.unique(keys)) == 5000
    order = np.argsort(keys)
    assert np.array_equal(order, np.lexsort((ranks, values)))
    assert np.array_equal(np.argsort(keys, kind="heapsort"), order)  # any algorithm: one order


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 2**31 - 1), st.integers(1, 50))
def test_the_sort_based_orders_equal_the_argsorts_they_replace(m, seed, spread):
    """``sorted_order`` inverts the tie-break in the keys' low bits instead of running an argsort, and
    ``stable_order`` sorts keys with their positions packed in: the same orders, for any values."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, spread, m) * 0.61
    ties = tie_break(m, np.random.default_rng(seed))
    assert np.array_equal(ties.ranks, random_ranks(m, np.random.default_rng(seed)))
    assert np.array_equal(ties.positions(ties.ranks), np.arange(m))
    keys = distinct_keys(values, ties.ranks)
    assert np.array_equal(sorted_order(values, ties), np.argsort(keys))
    assert np.array_equal(sorted_order(values, ties, descending=True), np.argsort(-keys))
    small = rng.integers(0, spread, m)
    assert np.array_equal(stable_order(small), np.argsort(small, kind="stable"))
    assert np.array_equal(stable_order(small + (1 << 62)), np.argsort(small + (1 << 62), kind="stable"))


# ------------------------------------------------------------------------------------ the cross-rank check


def test_schedule_mismatch_names_the_ranks_that_differ_and_survives_pickling():
    ScheduleMismatch.check(["a", "a", "a"], source="test")
    with pytest.raises(ScheduleMismatch) as err:
        ScheduleMismatch.check(["a", "a", "b", "a", "c"], source="test")
    assert err.value.ranks == (2, 4) and "rank 2 has b, rank 4 has c, the other 3 of 5 ranks a" in str(err.value)
    assert isinstance(err.value, InputError) and err.value.field == "schedule_fingerprint"
    copy = pickle.loads(pickle.dumps(err.value))  # crosses from a spawned rank to its parent
    assert type(copy) is ScheduleMismatch and copy.ranks == (2, 4) and str(copy) == str(err.value)
    with pytest.raises(ScheduleMismatch) as err:
        ScheduleMismatch.check(["a", "b"], source="test")  # a tie: rank 0's is the reference
    assert err.value.ranks == (1,)


def test_every_rank_of_a_sampler_has_the_same_fingerprint_and_an_exchange_checks_it():
    stats = random_stats(400, seed=2)
    samplers = [BalancedBatchSampler(stats, dp_rank=r, dp_size=4, num_microbatches=2, seed=3) for r in range(4)]
    prints = [s.schedule_fingerprint() for s in samplers]
    assert len(set(prints)) == 1 and prints[0] == samplers[0].schedule()[0].fingerprint()
    other = BalancedBatchSampler(stats, dp_rank=1, dp_size=4, num_microbatches=2, seed=4)
    assert other.schedule_fingerprint() != prints[0]
    calls = []

    def exchange(mine):  # what fingerprint_exchange returns on a world whose rank 1 has another seed
        calls.append(mine)
        return [prints[0], other.schedule_fingerprint(), prints[0], prints[0]]

    sampler = BalancedBatchSampler(stats, dp_rank=0, dp_size=4, num_microbatches=2, seed=3, exchange=exchange)
    with pytest.raises(ScheduleMismatch) as err:
        next(iter(sampler))
    assert err.value.ranks == (1,) and "epoch 0" in err.value.source
    agreed = BalancedBatchSampler(stats, dp_rank=0, dp_size=4, num_microbatches=2, seed=3,
                                  exchange=lambda mine: [mine] * 4)
    assert list(agreed) == list(samplers[0])
    assert len(list(agreed)) == len(agreed)  # once per schedule: a second iteration asks nobody again


def test_a_resharded_remainder_has_its_own_fingerprint():
    stats = random_stats(600, seed=5)
    old = BalancedBatchSampler(stats, dp_rank=0, dp_size=4, num_microbatches=1, seed=0)
    it = iter(old)
    for _ in range(5):
        next(it)
    old.mark_trained(5)
    state = old.state_dict()
    new = [BalancedBatchSampler(stats, dp_rank=r, dp_size=2, num_microbatches=1, seed=0) for r in range(2)]
    for s in new:
        s.load_state_dict(state, reshard=True)
    assert new[0].schedule_fingerprint() == new[1].schedule_fingerprint() != old.schedule_fingerprint()
    assert new[0].schedule()[1] is not None


@pytest.mark.multiprocess
def test_ranks_that_built_different_schedules_refuse_to_train_naming_the_odd_rank():
    """Two gloo ranks; rank 1 balances with another seed (as a node with other inputs would). The trainer's
    first step and the sampler's first micro-batch (its exchange over the DP group) both raise ScheduleMismatch
    naming rank 1, on both ranks, before anything is trained."""
    from dist_helpers import rank_schedule_mismatch
    from omnibal.train.distributed import spawn_local

    results = spawn_local(rank_schedule_mismatch, 2, args=(1,), deadline_s=120, start_method="fork")
    for r in results:
        assert r.error is None, r.error
        trainer, sampler = r.value["trainer"], r.value["sampler"]
        assert trainer[:2] == ("ScheduleMismatch", (1,)) and "rank 1 (dp 1/2, pp 0/1) has " in trainer[2], trainer
        assert sampler[:2] == ("ScheduleMismatch", (1,)) and "rank 1 has " in sampler[2], sampler
        assert r.value["steps"] == 0


def test_a_single_process_trainer_agrees_with_itself():
    from dist_helpers import make_trainer
    from omnibal.train.distributed import local_world

    trainer = make_trainer(local_world(), num_microbatches=2, num_steps=2)
    trainer.train_step()
    assert trainer._agreed_id == trainer.schedule_id


def test_fingerprint_is_the_checkpoints_schedule_fingerprint():
    """One definition: a checkpoint written before this change still names the same schedule."""
    from omnibal.train.feed import schedule_fingerprint

    sched = balance(random_stats(500, seed=1), dp_size=4, num_microbatches=2)
    assert schedule_fingerprint(sched) == sched.fingerprint()
    h = hashlib.sha256(f"{sched.dp_size},{sched.num_microbatches},{sched.num_steps}".encode())
    for arr in (sched.pack_samples, sched.pack_offsets, sched.pack_ids):
        h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    assert sched.fingerprint() == h.hexdigest()[:32]
    assert json.loads(sched.to_json())["dp_size"] == 4
