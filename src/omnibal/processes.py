"""How omnibal starts worker processes: the start method and the cores a pool may use, decided here for the
annotation readers, the chunked balancer and the trainer's local ranks."""

from __future__ import annotations

import multiprocessing
import os


def available_cores() -> int:
    """Cores this process may run on (its affinity where the OS tells it, else the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def start_method(device: str = "cpu") -> str:
    """``fork`` where the platform has it and the children use the CPU only: a child inherits what the parent
    imported instead of importing it again (seconds for torch), and a user's script needs no ``if __name__ ==
    "__main__"`` guard. ``spawn`` otherwise, and for CUDA, which a forked child cannot use once the parent has
    touched it. The parent must not hold a process group or threads a child relies on."""
    return "fork" if device == "cpu" and "fork" in multiprocessing.get_all_start_methods() else "spawn"
