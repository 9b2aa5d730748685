"""Measure the gloo links of this machine (CPU ranks): point-to-point and all-reduce latency/bandwidth.

Used by ``bench_sim_validation.py`` as the communication half of the simulator's calibration (the compute
half is fitted from a single-process training run). Two ranks, one torch thread each; a least-squares
line ``time = latency + bytes / bandwidth`` over several message sizes, each the median of repeats.

    PYTHONPATH=src python benchmarks/sim_links.py
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import numpy as np

SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
REPEATS = 15


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = {"p2p": [], "allreduce": []}
    for size in SIZES:
        buf = torch.zeros(size // 4, dtype=torch.float32)
        times = []
        for _ in range(REPEATS + 2):  # ping-pong: one-way time = round trip / 2
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2)
        out["p2p"].append((size, float(np.median(times[2:]))))
        times = []
        for _ in range(REPEATS + 2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        out["allreduce"].append((size, float(np.median(times[2:]))))
    dist.destroy_process_group()
    if rank == 0:
        queue.put(out)


def fit_line(points) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of ``time = latency + bytes / bandwidth``."""
    x = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    slope, intercept = np.polyfit(x, y, 1)
    return max(float(intercept), 0.0), float(1.0 / max(slope, 1e-15))


def measure_links() -> dict:
    """Measure p2p and all-reduce between two gloo ranks on this machine."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    raw = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    p2p_lat, p2p_bw = fit_line(raw["p2p"])
    # a 2-rank ring all-reduce moves 2 (d-1)/d = 1 x the bytes in 2 (d-1) = 2 latency steps
    ar_lat, ar_bw = fit_line(raw["allreduce"])
    return {"raw": raw, "p2p_latency": p2p_lat, "p2p_bandwidth": p2p_bw,
            "dp_latency": ar_lat / 2.0, "dp_bandwidth": ar_bw, "load_1min": os.getloadavg()[0]}


if __name__ == "__main__":
    res = measure_links()
    json.dump(res, sys.stdout, indent=2)
    print()
