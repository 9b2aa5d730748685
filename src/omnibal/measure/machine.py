"""What this machine is: CPU name, memory, load average. Recorded with every measurement (profiles,
benchmark results) so a figure can be traced to the machine and the load it was taken under. Free of torch,
so that a process measuring its own memory can use it."""

from __future__ import annotations

import os
import platform


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name


def physical_memory_bytes(default: float) -> float:
    """Installed memory in bytes (``default`` where the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return default
