"""Heartbeats: which peer stopped, so that a failure names it rather than only the rank that noticed.

A collective that times out tells a rank *that* a peer is missing, not *which*. Every rank of a multi-process
world therefore bumps a counter in the rendezvous store (``MASTER_ADDR:MASTER_PORT``: the store rank 0 or
torchrun's agent hosts) from a daemon thread every ``interval_s``. A rank that is stopped (SIGSTOP), hung in
native code with the GIL held, or dead stops bumping. When a collective fails, :meth:`Heartbeat.silent_ranks`
reads every counter twice, a few intervals apart, and returns the ranks whose counter did not move; when the
store itself does not answer, the rank hosting it is the one that stopped (rank 0, unless torchrun's agent
hosts the store).

Counters, not clocks: hosts need not agree on the time. Keys carry torchrun's restart count, so a restarted
job does not read its previous attempt's counters.
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import torch.distributed as dist

PREFIX = "omnibal/heartbeat"


def _client(timeout_s: float):
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                         datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


class Heartbeat:
    """This rank's heartbeat thread, and the reader that finds the silent peers."""

    def __init__(self, rank: int, world_size: int, *, interval_s: float = 0.25, read_timeout_s: float = 3.0):
        self.rank, self.world_size = rank, world_size
        self.interval_s, self.read_timeout_s = interval_s, read_timeout_s
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._keys = [f"{PREFIX}/{attempt}/{r}" for r in range(world_size)]
        self._stop = threading.Event()
        self._beat_store = _client(max(read_timeout_s, interval_s * 4))
        self._beat_store.add(self._keys[rank], 1)
        self._thread = threading.Thread(target=self._run, name="omnibal-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat_store.add(self._keys[self.rank], 1)
            except Exception:  # the store is gone (its host died): nothing left to tell
                return

    def stop(self) -> None:
        self._stop.set()

    def silent_ranks(self, window_s: float | None = None) -> list[int] | None:
        """Peers whose heartbeat did not move during ``window_s`` (default 6 intervals); None when the store
        does not answer (then the rank hosting it is the silent one)."""
        window_s = self.interval_s * 6 if window_s is None else window_s
        try:
            store = _client(self.read_timeout_s)
            before = [store.add(k, 0) for k in self._keys]
            time.sleep(window_s)
            after = [store.add(k, 0) for k in self._keys]
        except Exception:
            return None
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]
