"""The real trainer under process faults, multi-process on gloo: a rank SIGKILLed at a random step and the job
restarted by torchrun from the last checkpoint; a rank that hangs (SIGSTOP) or dies; a resume on another DP
size.

Promises (docs/guarantees.md):

* exactly once: after a crash and a restart from the last good checkpoint, every sample of the epoch is in
  the final model exactly once (counted from the ranks' ledgers), and the final weights are bit-identical
  to an uninterrupted run;
* bounded failure: when a peer dies or stops responding, the other ranks exit within the configured timeout
  with a message that names the rank, the step and the cause; never an endless hang;
* resume on another world: refused with a clear error (the trainer's schedule is per world), unless the
  trainer re-shards (``maybe_resume(reshard=True)``): then the rest of the epoch is trained exactly once.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from reliab_helpers import (
    effective_samples,
    kill_all,
    read_ledger,
    start_ranks,
    start_torchrun,
    trainer_counts,
    wait_all,
    wait_for_event,
    worker_args,
)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.multiprocess
NUM_SAMPLES = 128
LAUNCH_S = 150  # start-up of a few torch processes on a busy 2-core machine dominates


def _all_samples() -> set[int]:
    """The sample keys of the epoch (what the trainer's ledger records)."""
    from reliab_worker import epoch_schedule, tiny_stats

    stats = tiny_stats(NUM_SAMPLES)
    sched = epoch_schedule(stats, dp_size=2, num_microbatches=2)
    return set(int(stats.keys[i]) for i in (sched.sample_counts() > 0).nonzero()[0])


def _final_params(events) -> dict[int, dict]:
    out = {}
    for ev in events:
        if ev["event"] == "done" and ev.get("params"):
            out[ev["stage"]] = torch.load(ev["params"], weights_only=True)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-rank run: the weights every resumed run must reproduce."""
    root = tmp_path_factory.mktemp("reference")
    args = worker_args(dp=2, checkpoint_dir=root / "ckpt", ledger=root / "ledger")
    procs = start_ranks(2, args, log_dir=root)
    codes = wait_all(procs, LAUNCH_S)
    kill_all(procs)
    assert codes == [0, 0], (codes, [(root / f"rank{r}.attempt0.log").read_text()[-2000:] for r in range(2)])
    events = read_ledger(root / "ledger")
    counts = trainer_counts(root / "ledger")
    assert set(counts) == _all_samples() and set(counts.values()) == {1}
    return {"events": events, "params": _final_params(events),
            "num_steps": next(e["num_steps"] for e in events if e["event"] == "start")}


def _assert_same_weights(params: dict, ref: dict) -> None:
    assert params.keys() == ref.keys()
    for stage in ref:
        for name, tensor in ref[stage].items():
            assert torch.equal(params[stage][name], tensor), f"stage {stage} {name} differs from the uninterrupted run"


@pytest.mark.parametrize("seed", [7])
def test_sigkill_at_a_random_step_then_torchrun_restart_trains_each_sample_once(tmp_path, reference, seed):
    rng = random.Random(seed)
    num_steps = reference["num_steps"]
    kill_after = rng.randrange(0, num_steps - 2)  # the step after which the victim dies
    victim = rng.randrange(2)
    ledger = tmp_path / "ledger"
    args = worker_args(dp=2, checkpoint_dir=tmp_path / "ckpt", ledger=ledger, step_sleep=0.05)
    # first job: torchrun ends the whole job when a rank dies (that is the crash)
    job = start_torchrun(2, args + ["--attempt=0"], log=tmp_path / "torchrun0.log")
    try:
        start = wait_for_event(ledger, lambda e: e["event"] == "start" and e["rank"] == victim and e["attempt"] == 0,
                               LAUNCH_S, [job])
        wait_for_event(ledger, lambda e: e["event"] == "step" and e["rank"] == victim and e["attempt"] == 0
                       and e["step"] == kill_after, LAUNCH_S, [job])
        time.sleep(rng.uniform(0.0, 0.08))  # somewhere in the checkpoint write or the next step
        os.kill(start["pid"], signal.SIGKILL)
        first = wait_all([job], LAUNCH_S)
    finally:
        kill_all([job])
    assert first[0] not in (0, None), "torchrun should fail the job when a rank is killed"
    # second job: all ranks restarted by torchrun, resuming from the last good checkpoint
    job = start_torchrun(2, args + ["--attempt=1"], log=tmp_path / "torchrun1.log")
    try:
        codes = wait_all([job], LAUNCH_S)
    finally:
        kill_all([job])
    log = (tmp_path / "torchrun1.log").read_text(errors="replace")
    assert codes == [0], f"torchrun exit {codes}; log tail:\n{log[-3000:]}"
    events = read_ledger(ledger)
    _, starts = effective_samples(events)
    counts = trainer_counts(ledger)  # the trainer's own per-sample ledger, both attempts appended
    assert sorted(starts) == [0, 1], f"expected one restart, got attempts {starts}"
    saved = [e["step"] for e in events if e["event"] == "checkpoint" and e["attempt"] == 0 and e["rank"] == 0]
    last_logged = max(saved, default=0)
    # resumed from the newest complete checkpoint: the last one logged, or one that completed just before the
    # kill and was not logged yet; never later than what attempt 0 reached
    assert starts[1] in (last_logged, last_logged + 1) and starts[1] <= kill_after + 2, (starts, saved, kill_after)
    twice = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(_all_samples() - set(counts))
    assert not twice and not missing, f"trained twice: {twice}, never: {missing} (kill after step {kill_after})"
    _assert_same_weights(_final_params(events), reference["params"])


def _two_rank_failure(tmp_path, how: str, timeout_s: float):
    ledger = tmp_path / "ledger"
    args = worker_args(dp=2, checkpoint_dir=tmp_path / "ckpt", ledger=ledger, timeout=timeout_s, step_sleep=0.05)
    procs = start_ranks(2, args, log_dir=tmp_path)
    try:
        wait_for_event(ledger, lambda e: e["event"] == "step" and e["rank"] == 1 and e["step"] == 1, LAUNCH_S, procs)
        os.kill(procs[1].pid, signal.SIGSTOP if how == "hang" else signal.SIGKILL)
        t0 = time.monotonic()
        code0 = wait_all(procs[:1], timeout_s + 60)[0]
        waited = time.monotonic() - t0
    finally:
        if how == "hang":
            os.kill(procs[1].pid, signal.SIGCONT)
        kill_all(procs)
    error = next((e for e in read_ledger(ledger) if e["event"] == "error" and e["rank"] == 0), None)
    return code0, waited, error


def test_hung_peer_fails_the_others_within_the_timeout(tmp_path):
    timeout_s = 4.0
    code, waited, error = _two_rank_failure(tmp_path, "hang", timeout_s)
    assert code is not None and code != 0, "rank 0 still running: a hung peer made it hang too"
    assert error is not None, (tmp_path / "rank0.attempt0.log").read_text()[-2000:]
    assert error["type"] == "PeerFailure"
    assert "rank 0" in error["message"] and ("step" in error["message"] or "checkpoint" in error["message"])
    assert "stopped responding" in error["message"] and f"{timeout_s:g} s" in error["message"]
    # issue 20, case 4: the message names the stopped peer (from the heartbeats), not only the reporting rank
    assert "rank 1 (dp 1/2, pp 0/1) stopped responding (no heartbeat)" in error["message"], error["message"]
    assert error["elapsed"] < timeout_s + 10, error  # the configured timeout, plus start-up slack
    assert waited < timeout_s + 30


def test_dead_peer_fails_the_others_fast(tmp_path):
    code, waited, error = _two_rank_failure(tmp_path, "kill", 20.0)
    assert code is not None and code != 0
    assert error is not None and error["type"] == "PeerFailure", error
    assert "died" in error["message"]
    assert error["elapsed"] < 20.0, "a dead peer's closed sockets should fail the step well before the timeout"


def test_resume_on_another_dp_size_is_refused_with_a_clear_error(tmp_path):
    """Checkpoint with dp 2, resume with dp 1: the trainer's schedule is per world, so it must refuse (not train
    a different sample stream from the old step number)."""
    ledger = tmp_path / "ledger"
    procs = start_ranks(2, worker_args(dp=2, checkpoint_dir=tmp_path / "ckpt", ledger=ledger, steps=2),
                        log_dir=tmp_path)
    assert wait_all(procs, LAUNCH_S) == [0, 0]
    procs = start_ranks(1, worker_args(dp=1, checkpoint_dir=tmp_path / "ckpt", ledger=ledger), attempt=1,
                        log_dir=tmp_path)
    codes = wait_all(procs, LAUNCH_S)
    kill_all(procs)
    log = (tmp_path / "rank0.attempt1.log").read_text(errors="replace")
    assert codes[0] not in (0, None), log[-2000:]
    assert "InputError" in log and "world" in log and "step_00000002" in log, log[-2000:]
    assert not [e for e in read_ledger(ledger) if e["attempt"] == 1 and e["event"] == "step"]


@pytest.mark.parametrize("dp_old,dp_new", [(2, 1), (1, 2)])
def test_resume_on_another_dp_size_reshards_the_rest_of_the_epoch(tmp_path, dp_old, dp_new):
    """Also to a larger DP size (issue 20, case 2): the worker stopped at the new world's *fresh* epoch length,
    shorter than the old steps plus the re-balanced rest, and missed 36 of 128 samples with exit 0."""
    ledger = tmp_path / "ledger"
    procs = start_ranks(dp_old, worker_args(dp=dp_old, checkpoint_dir=tmp_path / "ckpt", ledger=ledger, steps=2),
                        log_dir=tmp_path)
    assert wait_all(procs, LAUNCH_S) == [0] * dp_old
    procs = start_ranks(dp_new, worker_args(dp=dp_new, checkpoint_dir=tmp_path / "ckpt", ledger=ledger)
                        + ["--reshard"], attempt=1, log_dir=tmp_path)
    codes = wait_all(procs, LAUNCH_S)
    kill_all(procs)
    assert codes == [0] * dp_new, (tmp_path / "rank0.attempt1.log").read_text(errors="replace")[-2000:]
    counts = trainer_counts(ledger)
    assert set(counts) == _all_samples() and set(counts.values()) == {1}
