"""Per-phase accounting of the balancer: work bounds that hold on every input, and CPU time for benchmarks.

**Work.** The exchange phases weigh candidate exchanges (``Packs.best_moves``: pairs x subsets x subsets),
and how many they weigh depends on the input: wide packs (many small samples in few packs) once made one
pair of packs cost ``width**4`` candidates and ran for 15 minutes in 4 GB. Each phase therefore gets a
:class:`WorkBudget` of candidates proportional to its rows, and stops where the budget ends (what is still
off goes to the next phase, and the tail rule always terminates). The budget counts candidates, not
seconds, so where it stops is the same on every machine.

**Time.** ``with record_phases() as seconds: balance(...)`` fills ``seconds`` with the CPU seconds each
phase took (``process_time``), for the benchmark's per-phase rows. Off by default; no decision reads it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

_RECORDERS: list[dict[str, float]] = []


@contextmanager
def record_phases():
    """Collect ``{phase: CPU seconds}`` of every balancer phase run inside the block (summed over calls)."""
    seconds: dict[str, float] = {}
    _RECORDERS.append(seconds)
    try:
        yield seconds
    finally:
        _RECORDERS.remove(seconds)


@contextmanager
def phase(name: str):
    """Time the block as phase ``name`` for every active :func:`record_phases` (nothing when none is)."""
    if not _RECORDERS:
        yield
        return
    start = time.process_time()
    try:
        yield
    finally:
        spent = time.process_time() - start
        for seconds in _RECORDERS:
            seconds[name] = seconds.get(name, 0.0) + spent


class WorkBudget:
    """Candidate exchanges a phase may still weigh. ``allows(k)`` charges ``k`` and says whether they fit;
    once one request does not fit the budget is spent (the phase stops: later requests are refused too)."""

    def __init__(self, limit: float) -> None:
        self.limit = float(limit)
        self.used = 0.0
        self.exhausted = False

    @classmethod
    def per_row(cls, rows: int, per_row: float, floor: float = float(1 << 21)) -> WorkBudget:
        """``per_row`` candidates for each of ``rows`` rows, and at least ``floor`` (small inputs)."""
        return cls(max(floor, per_row * max(rows, 1)))

    def allows(self, candidates: float) -> bool:
        if self.exhausted or self.used + candidates > self.limit:
            self.exhausted = True
            return False
        self.used += candidates
        return True


UNLIMITED = None
"""Pass as a budget to weigh without a bound (tests and small helpers)."""


def add_phase_seconds(seconds: dict[str, float]) -> None:
    """Add phase seconds recorded elsewhere (a worker process's) to every active :func:`record_phases`."""
    for recorder in _RECORDERS:
        for name, spent in seconds.items():
            recorder[name] = recorder.get(name, 0.0) + spent
