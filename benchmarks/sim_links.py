"""Measure the gloo links of this machine (CPU ranks): point-to-point and all-reduce latency/bandwidth.

Used by ``bench_sim_validation.py`` as the communication half of the simulator's calibration (the compute
half is fitted from a single-process training run). Two ranks, one torch thread each; a least-squares
line ``time = latency + bytes / bandwidth`` over several message sizes, each the median of repeats.
On a machine shared with other jobs every time is divided by the slowdown a compute probe sees at that
moment (wall / own CPU time), as the validation does with step times; the raw wall-clock fit is kept too.

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


def _probe_slowdown(torch) -> float:
    """Wall time / own CPU time of a short compute loop: how much other jobs slow this process down now."""
    a = torch.randn(192, 192)
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(30):
        a = torch.tanh(a @ a)
    return (time.perf_counter() - t0) / max(time.thread_time() - c0, 1e-9)


def _rank(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = {"p2p": [], "allreduce": [], "slowdown": []}
    for size in SIZES:
        buf = torch.zeros(size // 4, dtype=torch.float32)
        out["slowdown"].append(_probe_slowdown(torch))
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
        out["slowdown"].append(_probe_slowdown(torch))
    dist.destroy_process_group()
    queue.put((rank, out))


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
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    raw = got[0]
    # other jobs slow the copies down as they slow compute; the probes (both ranks, before and after each
    # size) give the factor, so the figures below are for uncontended cores, like the normalised steps
    slow = np.mean([got[0]["slowdown"], got[1]["slowdown"]], axis=0).reshape(len(SIZES), 2).mean(axis=1)
    norm = {k: [(size, t / f) for (size, t), f in zip(raw[k], slow)] for k in ("p2p", "allreduce")}
    p2p_lat, p2p_bw = fit_line(norm["p2p"])
    # a 2-rank ring all-reduce moves 2 (d-1)/d = 1 x the bytes in 2 (d-1) = 2 latency steps
    ar_lat, ar_bw = fit_line(norm["allreduce"])
    wall_p2p = fit_line(raw["p2p"])
    wall_ar = fit_line(raw["allreduce"])
    return {"raw": raw, "slowdown": slow.tolist(), "p2p_latency": p2p_lat, "p2p_bandwidth": p2p_bw,
            "dp_latency": ar_lat / 2.0, "dp_bandwidth": ar_bw,
            "wall_clock": {"p2p_latency": wall_p2p[0], "p2p_bandwidth": wall_p2p[1], "dp_latency": wall_ar[0] / 2.0,
                           "dp_bandwidth": wall_ar[1]},
            "load_1min": os.getloadavg()[0]}


if __name__ == "__main__":
    res = measure_links()
    json.dump(res, sys.stdout, indent=2)
    print()
