"""Issue 31 item 3: the balancer's cost is bounded on every input.

``omnibal balance --dp 8`` on 1,000 rows (950 x {13 tiles, 3,400 tokens}, 50 x {1 tile, 16,000 tokens}) once ran
past 900 s in 3.6-4.6 GB: the cap search left its window for counts of one or two steps (packs of 125
samples), and one pair of such packs cost width**4 candidate exchanges. Now the search never leaves the
window, an exchange weighs at most a fixed number of slots per pack, and every exchange phase has a work
budget (``phases.WorkBudget``) with a fall-back that always terminates (the tail rule). Checked here in a
forked child under a CPU and an address-space limit: the reproduction, and adversarial bimodal mixtures
(hypothesis).
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import time
import traceback

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from balance_helpers import assert_exactly_once
from omnibal.data.balance import BalanceConfig, balance
from omnibal.errors import InputError
from omnibal.stats.table import SampleStats

MEMORY_BUDGET_MIB = 1024
"""Address space the child may add to what it inherits."""


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _child(stats, dp, m, config, cpu_budget, conn) -> None:
    """In a forked child: balance under an address-space limit; report (status, CPU seconds, detail)."""
    try:
        limit = _vm_bytes() + MEMORY_BUDGET_MIB * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        start = time.process_time()
        sched = balance(stats, dp_size=dp, num_microbatches=m, config=config)
        cpu = time.process_time() - start
        assert_exactly_once(sched)
        f = sched.features(stats)
        own = set(sched.meta.get("own_packs", []))
        over = (f[..., 1] > sched.caps.tiles) | (f[..., 2] > sched.caps.tokens)
        bad = [i for i in zip(*np.nonzero(over)) if not set(sched.microbatch(*i).tolist()) <= own]
        conn.send(("ok" if not bad else f"{len(bad)} micro-batches over the caps", cpu, str(sched.caps)))
    except InputError as exc:
        conn.send(("input-error", 0.0, str(exc)[:200]))
    except MemoryError:
        conn.send(("memory", 0.0, f"over {MEMORY_BUDGET_MIB} MiB"))
    except BaseException:
        conn.send(("error", 0.0, traceback.format_exc()[-800:]))
    finally:
        conn.close()
        os._exit(0)


def run_bounded(stats, dp, m=1, config=None, cpu_budget=20.0, wall=120.0):
    """(status, CPU seconds, detail) of balance() in a forked child; 'hang' when it outlives ``wall``."""
    ctx = multiprocessing.get_context("fork")
    parent, child_end = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(stats, dp, m, config or BalanceConfig(), cpu_budget, child_end))
    child.start()
    child_end.close()
    got = parent.recv() if parent.poll(wall) else ("hang", wall, f"still running after {wall} s")
    if child.is_alive():
        child.kill()
    child.join()
    return got


def test_the_issue_31_bimodal_input_balances_in_bounded_time_and_memory():
    tiles = np.array([13] * 950 + [1] * 50)
    tokens = np.array([3400] * 950 + [16000] * 50)
    stats = SampleStats.from_arrays(tiles=tiles, tokens=tokens, source="issue-31.3")
    status, cpu, detail = run_bounded(stats, dp=8)
    assert status == "ok", detail
    assert cpu <= 20.0, f"{cpu:.1f} CPU s"


# no shrinking: a failing example costs its whole budget, so shrinking one would take many minutes
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(n=st.integers(40, 2500), share=st.floats(0.01, 0.5), seed=st.integers(0, 10_000),
       dp=st.sampled_from([1, 2, 8, 16]), m=st.sampled_from([1, 2, 4]),
       big=st.tuples(st.integers(0, 40), st.integers(1, 20_000)),
       small=st.tuples(st.integers(0, 13), st.integers(1, 4_000)),
       caps=st.one_of(st.none(), st.tuples(st.integers(8, 48), st.integers(4096, 24_000))))
def test_adversarial_bimodal_mixtures_stay_within_budget(n, share, seed, dp, m, big, small, caps):
    """Two modes of (tiles, text) far apart in either size, any share of the rarer one: every sample once,
    every micro-batch under the caps, within 20 CPU s and 1 GiB (a few hundred to a few thousand rows take a
    fraction of a second)."""
    rng = np.random.default_rng(seed)
    rare = rng.random(n) < share
    tiles = np.where(rare, big[0], small[0]) + rng.integers(0, 2, n)
    tokens = 256 * tiles + np.where(rare, big[1], small[1]) + rng.integers(0, 64, n)
    stats = SampleStats.from_arrays(tiles=tiles, tokens=tokens, source="bimodal")
    config = BalanceConfig() if caps is None else BalanceConfig(max_tiles=caps[0], max_tokens=caps[1],
                                                                oversize="own_pack")
    status, cpu, detail = run_bounded(stats, dp=dp, m=m, config=config)
    if n < dp * m:
        assert status == "input-error", detail
        return
    assert status in ({"ok"} if caps is None else {"ok", "input-error"}), detail
    assert cpu <= 20.0, f"{cpu:.1f} CPU s"
