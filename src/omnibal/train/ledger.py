"""The per-sample ledger: which samples every optimizer step trained (``omnibal train --ledger FILE``,
``OmnibalTrainer(ledger_path=...)``). The one ledger format: both trainers write it with :class:`LedgerWriter`
and it is read with :func:`read_ledger`.

Opt-in evidence for the exactly-once promise, written by the trainer itself rather than reconstructed
from counts. The writer appends JSON lines, each flushed and fsynced before the step's checkpoint can
be written:

``{"event": "start", "format": "omnibal.ledger", "resumed_at": S, ...}``
    when a run starts (fresh: ``resumed_at`` 0, or the step it resumed at), with what the writer says about
    the run (the reference trainer: ``checkpoint``, ``world``, ...; the Hugging Face trainer: ``rank``);
``{"event": "step", "step": S, "keys": [...], "rows": [...]}``
    step ``S``'s samples: their keys (``stats.keys`` / the dataset's ``key(i)``) and dataset rows. The reference
    trainer's global rank 0 writes one per optimizer step, every DP rank's micro-batches rank after rank; the
    Hugging Face trainer writes one per micro-batch into each process's own file, with ``rank``, ``micro``
    and ``epoch`` beside them.

Several runs (restarts, resumes, reshards) append to one file. A run that starts at ``S`` replaces
everything earlier runs logged from step ``S`` on: those updates are not in its weights.
:func:`trained_counts` applies that rule and returns how many times each sample is in the final model.

Ledgers of the Hugging Face trainer of omnibal before this format (one ``{"rank", "epoch", "step", "micro",
"indices"}`` line per micro-batch, no events) are refused by :func:`read_ledger` and :class:`LedgerWriter`
with an InputError naming the file: a resume never appends one format to the other.
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

LEDGER_FORMAT = "omnibal.ledger"
"""The ``format`` of a start event (absent in the reference trainer's older ledgers, which read the same)."""


class LedgerWriter:
    """Appends a run's events to the ledger file (global rank 0 only)."""

    def __init__(self, path: str | os.PathLike, header: dict) -> None:
        self.path = Path(path)
        if self.path.is_file() and self.path.stat().st_size:
            read_ledger(self.path)  # appending to a file of another format would corrupt both: refused here
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+b")
        self._file.seek(0, os.SEEK_END)
        if self._file.tell() > 0:  # a run killed mid-line: start on a fresh line
            self._file.seek(-1, os.SEEK_END)
            last = self._file.read(1)
            self._file.seek(0, os.SEEK_END)
            if last != b"\n":
                self._file.write(b"\n")
        self._write({"event": "start", "format": LEDGER_FORMAT, "time": time.time(), **header})

    def _write(self, record: dict) -> None:
        with naming_path(self.path):
            self._file.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
            self._file.flush()
            os.fsync(self._file.fileno())

    def step(self, step: int, keys: list[int], rows: list[int], **where) -> None:
        """Step ``step``'s samples; ``where``: which part of the step they are (``rank``, ``micro``, ``epoch``)
        when the writer logs a rank's micro-batches one by one."""
        self._write({"event": "step", "step": int(step), "keys": keys, "rows": rows, **where})

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
        except ValueError:
            event = None
        if isinstance(event, dict) and "event" not in event and "indices" in event:
            raise InputError("a ledger of an older omnibal Hugging Face trainer (one {rank, epoch, step, micro, "
                             "indices} line per micro-batch); this omnibal writes and reads the format of "
                             "omnibal.train.ledger: give another ledger_path (or move this one away)",
                             source=str(path), record=f"line {n}")
        if not isinstance(event, dict) or event.get("event") not in ("start", "step"):
            if broken is not None:
                raise InputError("unreadable line", source=str(path), record=f"line {broken}") from None
            broken = n
            continue
        if broken is not None and event["event"] != "start":
            raise InputError("unreadable line", source=str(path), record=f"line {broken}")
        broken = None
        events.append(event)
    return events


def final_steps(events: list[dict]) -> dict[int, list[dict]]:
    """Step -> its ``step`` events (one per optimizer step, or one per rank and micro-batch), for the steps
    whose updates are in the final weights."""
    steps: dict[int, dict[tuple, dict]] = {}
    for event in events:
        if event["event"] == "start":
            start = int(event.get("resumed_at", 0))
            steps = {s: e for s, e in steps.items() if s < start}
        else:  # a step logged again (a run that died after logging it) replaces the earlier record
            steps.setdefault(int(event["step"]), {})[(event.get("rank"), event.get("micro"))] = event
    return {s: list(parts.values()) for s, parts in steps.items()}


def trained_counts(path: str | os.PathLike) -> Counter:
    """How many times each sample key is in the final model (1 everywhere for an exactly-once epoch)."""
    counts: Counter = Counter()
    for events in final_steps(read_ledger(path)).values():
        for event in events:
            counts.update(int(k) for k in event["keys"])
    return counts
