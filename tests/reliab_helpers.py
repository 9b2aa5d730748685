"""Launching the fault tests' job (``reliab_worker.py``) under torchrun or as plain processes, killing or
stopping a rank at a chosen step, and reading the ledger the ranks write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from omnibal.train.distributed import free_port

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
WORKER = TESTS / "reliab_worker.py"


def worker_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    env.update(extra or {})
    return env


def worker_args(*, dp: int, checkpoint_dir: Path, ledger: Path, pp: int = 1, every: int = 1, samples: int = 128,
                microbatches: int = 2, timeout: float = 20.0, step_sleep: float = 0.0, steps: int = 0) -> list[str]:
    return [f"--dp={dp}", f"--pp={pp}", f"--every={every}", f"--samples={samples}", f"--microbatches={microbatches}",
            f"--timeout={timeout}", f"--step-sleep={step_sleep}", f"--steps={steps}",
            f"--checkpoint-dir={checkpoint_dir}", f"--ledger={ledger}"]


def start_torchrun(nproc: int, args: list[str], *, max_restarts: int = 0, log: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "--monitor-interval=0.2", str(WORKER), *args]
    out = open(log, "wb") if log else subprocess.DEVNULL
    return subprocess.Popen(cmd, env=worker_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def start_ranks(world_size: int, args: list[str], *, attempt: int = 0,
                log_dir: Path | None = None) -> list[subprocess.Popen]:
    """The ranks as plain processes (what torchrun does, without its agent): direct control of each pid."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = worker_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                          "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
        out = open(log_dir / f"rank{rank}.attempt{attempt}.log", "wb") if log_dir else subprocess.DEVNULL
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *args, f"--attempt={attempt}"], env=env,
                                      stdout=out, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs, timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL) if p.pid == os.getpgid(p.pid) else p.kill()
            except (ProcessLookupError, PermissionError):
                pass
            p.wait(10)


def read_ledger(folder: Path) -> list[dict]:
    events = []
    for f in sorted(Path(folder).glob("rank*.attempt*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return events


def wait_for_event(folder: Path, predicate, timeout: float, procs=()) -> dict:
    """Poll the ledger until an event matches; fails when the job ends or time runs out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in read_ledger(folder):
            if predicate(ev):
                return ev
        if procs and all(p.poll() is not None for p in procs):
            raise AssertionError(f"the job ended before the awaited event; ledger: {read_ledger(folder)[-5:]}")
        time.sleep(0.02)
    raise AssertionError(f"no matching ledger event within {timeout} s; last: {read_ledger(folder)[-5:]}")


def trainer_counts(folder: Path) -> Counter:
    """Per sample key, how many times it is in the final model: from the trainer's own ledger
    (``omnibal.train.ledger``), which every attempt of the job appends to."""
    from omnibal.train.ledger import trained_counts

    return trained_counts(Path(folder) / "trainer.jsonl")


def effective_samples(events: list[dict]) -> tuple[Counter, dict]:
    """Samples whose updates are in the final model, counted per sample.

    Attempt ``a`` starts at step ``start[a]`` (where it resumed); what it trained at steps ``>= start[a+1]``
    was lost with it (the next attempt resumed from an earlier checkpoint and redid those steps).
    Returns the per-sample count and ``{attempt: start step}``.
    """
    starts = {}
    for ev in events:
        if ev["event"] == "start":
            prev = starts.setdefault(ev["attempt"], ev["step"])
            assert prev == ev["step"], f"ranks of attempt {ev['attempt']} resumed at different steps"
    attempts = sorted(starts)
    counts: Counter = Counter()
    seen_slots = set()
    for ev in events:
        if ev["event"] != "step":
            continue
        a = ev["attempt"]
        nxt = attempts.index(a) + 1
        end = starts[attempts[nxt]] if nxt < len(attempts) else float("inf")
        if starts[a] <= ev["step"] < end:
            slot = (ev["step"], ev["dp_rank"])
            assert slot not in seen_slots, f"step {slot[0]} dp rank {slot[1]} counted twice"
            seen_slots.add(slot)
            counts.update(ev["samples"])
    return counts, starts
