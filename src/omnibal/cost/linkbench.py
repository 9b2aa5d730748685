"""Measure the point-to-point link between two local processes (gloo over loopback on a CPU machine).

Two spawned ranks ping-pong float32 tensors of a few sizes with ``torch.distributed.send``/``recv``; the
one-way time of each size is half the fastest round trip, and ``time = latency + bytes / bandwidth`` is
fitted over the sizes (non-negative least squares). This is what a pipeline-parallel activation transfer
between two CPU stages costs here; ``measure_cpu(links=True)`` puts the figures into the ``cpu`` hardware.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

import numpy as np

from omnibal.cost.fit import nnls
from omnibal.errors import InputError

DEFAULT_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, sizes: tuple[int, ...], repeats: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        peer = 1 - rank
        one_way = []
        for num_bytes in sizes:
            buf = torch.zeros(max(1, num_bytes // 4), dtype=torch.float32)
            best = float("inf")
            for i in range(repeats + 2):  # two warm-up round trips
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
                if i >= 2:
                    best = min(best, time.perf_counter() - start)
            one_way.append(best / 2)
        if rank == 0:
            np.save(out_path, np.array(one_way))
    finally:
        dist.destroy_process_group()


def measure_gloo_link(*, sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 10,
                      timeout_s: float = 120.0) -> tuple[float, float, dict[int, float]]:
    """``(bandwidth bytes/s, latency s, {bytes: one-way seconds})`` of gloo send/recv between two local
    processes (one torch thread each). Takes a few seconds, mostly process start-up."""
    import torch.multiprocessing as mp

    if len(sizes) < 2 or any(not isinstance(s, int) or s < 4 for s in sizes):
        raise InputError(f"need at least two sizes of >= 4 bytes, got {sizes!r}", source="sizes", field="sizes")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "one_way.npy")
        ctx = mp.start_processes(_worker, args=(_free_port(), tuple(sizes), repeats, out_path), nprocs=2,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise TimeoutError(f"gloo link measurement did not finish in {timeout_s} s")
        one_way = np.load(out_path)
    num_bytes = np.array([max(1, s // 4) * 4 for s in sizes], dtype=np.float64)
    design = np.stack([np.ones_like(num_bytes), num_bytes], axis=1)
    weights = 1.0 / one_way
    latency, seconds_per_byte = nnls(design * weights[:, None], one_way * weights)
    bandwidth = 1.0 / seconds_per_byte if seconds_per_byte > 0 else float(num_bytes.max() / one_way.max())
    return float(bandwidth), float(latency), {int(b): float(t) for b, t in zip(num_bytes, one_way)}
