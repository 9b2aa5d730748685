"""Issue 20, cases 4 and 13: ``omnibal train`` starting its own local ranks, when one of them is stopped (SIGSTOP)
or killed (SIGKILL, what the out-of-memory killer sends).

Promises (docs/guarantees.md, "Bounded failure"): the command returns within the timeout plus a grace period,
never waits for the stopped rank to be continued, and the error names the stopped rank -- in the surviving
ranks' own messages (from the heartbeats) and in the launcher's; a rank killed by a signal is reported by the
signal's name, SIGKILL with the out-of-memory killer as its usual cause.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dist_helpers import rank_pids
from omnibal.train.distributed import describe_exit, spawn_local

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.multiprocess


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the ranks")
def test_omnibal_train_returns_when_a_local_rank_is_stopped_and_names_it(tmp_path):
    """``omnibal train`` (local ranks) hung on a SIGSTOPped rank: the other rank exited in 5.2 s but the command
    never returned, and the error named the reporting rank, never the stopped one."""
    timeout_s = 4.0
    stats = tmp_path / "s.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "omnibal", "stats", "--synthetic", "400", "--out", str(stats), "--quiet"],
                   check=True, env=env)
    log = tmp_path / "log.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "omnibal", "train", "--stats", str(stats), "--dp", "2",
                             "--microbatches", "1", "--steps", "0", "--timeout", str(timeout_s), "--quiet",
                             "--metrics-log", str(log)], env=env, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and proc.poll() is None:
            if log.exists() and len(log.read_text().splitlines()) >= 3:  # header + two steps: training runs
                break
            time.sleep(0.1)
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2 and proc.poll() is None, (ranks, proc.poll())
        os.kill(ranks[1], signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            _, err = proc.communicate(timeout=2 * timeout_s + 60)
        except subprocess.TimeoutExpired:
            pytest.fail("omnibal train still waiting for the stopped rank")
        waited = time.monotonic() - t0
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 1, err[-3000:]
    assert "rank 1 stopped (SIGSTOP" in err, err[-3000:]  # the launcher names it ...
    assert "rank 1 (dp 1/2, pp 0/1) stopped responding (no heartbeat)" in err, err[-3000:]  # ... and rank 0 too
    assert waited < 2 * timeout_s + 10 + 30, waited


def _die_by_sigkill():
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_rank_killed_by_sigkill_is_named_with_its_likely_cause():
    """A rank killed for running out of memory was reported only as "exited with code -9"."""
    results = spawn_local(_die_by_sigkill, 1, deadline_s=60, start_method="fork")
    assert results[0].exitcode == -signal.SIGKILL
    assert "SIGKILL" in results[0].error and "out-of-memory killer" in results[0].error
    assert "ran out of memory" in describe_exit(-9, oom_kills=1)
    assert describe_exit(-15) == "was killed by SIGTERM" and describe_exit(3) == "exited with code 3"

