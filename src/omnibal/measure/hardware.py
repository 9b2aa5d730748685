"""Measure this CPU as a :class:`omnibal.cost.hardware.HardwareSpec`: matmul rates, copy bandwidth, and
(optionally) the gloo link between two local processes. The cost layer's presets are datasheet figures; a
``cpu`` spec only exists as a measurement, made here on request (``get_hardware`` never measures)."""

from __future__ import annotations

import math
import time

import torch

from omnibal.cost.hardware import GiB, HardwareSpec, get_hardware
from omnibal.measure.links import measure_gloo_link
from omnibal.measure.machine import physical_memory_bytes
from omnibal.validate import check_positive_int

__all__ = ["hardware_by_name", "measure_cpu"]


def hardware_by_name(name: str, *, threads: int = 1) -> HardwareSpec:
    """A preset by name, or for ``cpu`` a measurement of this machine with ``threads`` torch threads (what
    ``--hardware cpu`` means on the command line)."""
    if name == "cpu":
        return measure_cpu(threads=threads)
    return get_hardware(name)


def measure_cpu(*, threads: int = 1, repeats: int = 5, links: bool = False) -> HardwareSpec:
    """Measure this CPU: fp32 and bf16 matmul rates (512^3 and 2048x256x512 GEMMs) and the copy bandwidth
    of a 64 MiB tensor, with ``threads`` torch threads (restored afterwards); the best of ``repeats`` runs, on
    the process CPU clock when ``threads == 1`` (robust to other jobs), else the wall clock. Takes well
    under a second once torch is imported; nothing is cached between calls.

    CPU "links" are gloo over loopback TCP. With ``links=True`` they are measured too (two spawned processes
    ping-pong tensors, :func:`omnibal.measure.links.measure_gloo_link`; several seconds of process start-up);
    otherwise the defaults are what a pipeline transfer costs on this project's 2-core machine: 1.6 GB/s
    (raw gloo send/recv) and 1 ms per transfer (what a micro-batch costs through torch.distributed.pipelining,
    well above raw gloo's own latency).
    """
    check_positive_int(threads, "threads")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rates = {}
        for dtype in (torch.float32, torch.bfloat16):
            best = 0.0
            for m, k, n in ((512, 512, 512), (2048, 256, 512)):
                a = torch.randn(m, k, dtype=dtype)
                b = torch.randn(k, n, dtype=dtype)
                seconds = _best_time(lambda a=a, b=b: a @ b, repeats, cpu_clock=threads == 1)
                best = max(best, 2.0 * m * k * n / seconds)
            rates[dtype] = best
        src = torch.empty(8 << 20, dtype=torch.float64).fill_(1.0)  # 64 MiB
        dst = torch.empty_like(src)
        seconds = _best_time(lambda: dst.copy_(src), repeats, cpu_clock=threads == 1)
        bandwidth = 2.0 * src.numel() * src.element_size() / seconds  # read + write
    finally:
        torch.set_num_threads(old_threads)
    link_bandwidth, link_latency = 1.6e9, 1e-3
    if links:
        link_bandwidth, link_latency, _ = measure_gloo_link()
    return HardwareSpec(
        name=f"cpu-{threads}t", peak_bf16_flops=rates[torch.bfloat16], peak_fp32_flops=rates[torch.float32],
        memory_bytes=physical_memory_bytes(8.0 * GiB), memory_bandwidth=bandwidth,
        intra_node_bandwidth=link_bandwidth, intra_node_latency=link_latency,
        inter_node_bandwidth=link_bandwidth, inter_node_latency=link_latency, gpus_per_node=1,
        # The rates above are achieved GEMM rates, so matmul efficiency is relative to them.
        eff_matmul=0.8, eff_attention=0.4, eff_memory=0.5, eff_comm=1.0, layer_overhead_s=1e-4,
    )


def _best_time(fn, repeats: int, *, cpu_clock: bool = False) -> float:
    """Fastest of ``repeats`` runs after one warm-up. With ``cpu_clock`` (one thread) the process CPU time
    is used: on a machine shared with other jobs it excludes the time they took the core away."""
    clock = time.process_time if cpu_clock else time.perf_counter
    fn()
    best = math.inf
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return max(best, 1e-9)
