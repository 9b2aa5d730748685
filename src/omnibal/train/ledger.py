"""The per-sample ledger: which samples every optimizer step trained (``omnibal train --ledger FILE``).

Opt-in evidence for the exactly-once promise, written by the trainer itself rather than reconstructed
from counts. Global rank 0 appends JSON lines, each flushed and fsynced before the step's checkpoint can
be written:

``{"event": "start", "resumed_at": S, "checkpoint": PATH | null, "world": {...}, ...}``
    when a run starts (fresh: ``resumed_at`` 0, or from the checkpoint it resumed);
``{"event": "step", "step": S, "keys": [...], "rows": [...]}``
    after step ``S``'s optimizer step: the sample keys (``stats.keys`` / the dataset's ``key(i)``) and
    dataset rows of every DP rank's micro-batches, rank after rank.

Several runs (restarts, resumes, reshards) append to one file. A run that starts at ``S`` replaces
everything earlier runs logged from step ``S`` on: those updates are not in its weights.
:func:`trained_counts` applies that rule and returns how many times each sample is in the final model.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np

from omnibal.errors import InputError
from omnibal.outputs import naming_path


class LedgerWriter:
    """Appends a run's events to the ledger file (global rank 0 only)."""

    def __init__(self, path: str | os.PathLike, header: dict) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+b")
        self._file.seek(0, os.SEEK_END)
        if self._file.tell() > 0:  # a run killed mid-line: start on a fresh line
            self._file.seek(-1, os.SEEK_END)
            last = self._file.read(1)
            self._file.seek(0, os.SEEK_END)
            if last != b"\n":
                self._file.write(b"\n")
        self._write({"event": "start", "time": time.time(), **header})

    def _write(self, record: dict) -> None:
        with naming_path(self.path):
            self._file.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
            self._file.flush()
            os.fsync(self._file.fileno())

    def step(self, step: int, keys: list[int], rows: list[int]) -> None:
        self._write({"event": "step", "step": int(step), "keys": keys, "rows": rows})

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def sample_keys(dataset, rows) -> list[int]:
    """The keys of dataset rows: the dataset's ``key(i)`` (real data) or its statistics' ``keys``."""
    if hasattr(dataset, "key"):
        return [int(dataset.key(int(i))) for i in rows]

    return np.asarray(dataset.stats.keys)[np.asarray(rows, np.int64)].tolist()


def read_ledger(path: str | os.PathLike) -> list[dict]:
    """The ledger's events in order. A line cut short by a killed writer is dropped when a later run's
    ``start`` follows it (that run replaced it) or it is the last line; anywhere else it is an InputError."""
    events: list[dict] = []
    lines = Path(path).read_bytes().split(b"\n")
    broken = None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
            if not isinstance(event, dict) or event.get("event") not in ("start", "step"):
                raise ValueError("not a ledger event")
        except ValueError:
            if broken is not None:
                raise InputError("unreadable line", source=str(path), record=f"line {broken}") from None
            broken = n
            continue
        if broken is not None and event["event"] != "start":
            raise InputError("unreadable line", source=str(path), record=f"line {broken}")
        broken = None
        events.append(event)
    return events


def final_steps(events: list[dict]) -> dict[int, dict]:
    """Step -> its ``step`` event, for the steps whose updates are in the final weights."""
    steps: dict[int, dict] = {}
    for event in events:
        if event["event"] == "start":
            start = int(event.get("resumed_at", 0))
            steps = {s: e for s, e in steps.items() if s < start}
        else:
            steps[int(event["step"])] = event
    return steps


def trained_counts(path: str | os.PathLike) -> Counter:
    """How many times each sample key is in the final model (1 everywhere for an exactly-once epoch)."""
    counts: Counter = Counter()
    for event in final_steps(read_ledger(path)).values():
        counts.update(int(k) for k in event["keys"])
    return counts
