"""Measure the gloo links between two local processes (loopback TCP on a CPU machine): point-to-point and,
optionally, all-reduce. The one owner of link measurements (``measure_cpu(links=True)``, the simulator and
trainer benchmarks all call it).

Two spawned ranks, one torch thread each, exchange float32 tensors of a few sizes: a ping-pong
(``send``/``recv``; one-way time = round trip / 2) and an ``all_reduce``, ``repeats`` timed runs after two
warm-ups. :func:`measure_gloo_link` fits ``time = latency + bytes / bandwidth`` to the fastest one-way time of
each size (non-negative least squares): what a pipeline-parallel activation transfer between two CPU
stages costs. :func:`measure_links` fits medians to both operations and, on a machine shared with other
jobs, divides every time by the slowdown a compute probe sees at that moment (wall / own CPU time); the
raw wall-clock fit is kept too.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omnibal.cost.fit import nnls
from omnibal.errors import InputError
from omnibal.outputs import write_text
from omnibal.train.distributed import free_port

DEFAULT_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)
"""Message sizes (bytes) of :func:`measure_gloo_link`."""
LINK_SIZES = (16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
"""Message sizes (bytes) of :func:`measure_links`."""
WARMUP = 2

__all__ = ["DEFAULT_SIZES", "LINK_SIZES", "fit_line", "measure_gloo_link", "measure_links"]


def _probe_slowdown() -> float:
    """Wall time / own CPU time of a short compute loop: how much other jobs slow this process down now."""
    a = torch.randn(192, 192)
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(30):
        a = torch.tanh(a @ a)
    return (time.perf_counter() - t0) / max(time.thread_time() - c0, 1e-9)


def _ping_pong(buf: torch.Tensor, rank: int, repeats: int) -> list[float]:
    """One-way seconds (round trip / 2) of ``repeats`` ping-pongs after the warm-ups."""
    peer = 1 - rank
    times = []
    for _ in range(repeats + WARMUP):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
        times.append((time.perf_counter() - start) / 2)
    return times[WARMUP:]


def _all_reduce(buf: torch.Tensor, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats + WARMUP):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


def _worker(rank: int, port: int, sizes: tuple[int, ...], repeats: int, all_reduce: bool, probe: bool,
            out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out: dict[str, list] = {"p2p": [], "allreduce": [], "slowdown": []}
        for num_bytes in sizes:
            buf = torch.zeros(max(1, num_bytes // 4), dtype=torch.float32)
            if probe:
                out["slowdown"].append(_probe_slowdown())
            out["p2p"].append(_ping_pong(buf, rank, repeats))
            if all_reduce:
                out["allreduce"].append(_all_reduce(buf, repeats))
            if probe:
                out["slowdown"].append(_probe_slowdown())
        write_text(Path(out_dir, f"rank{rank}.json"), json.dumps(out))
    finally:
        dist.destroy_process_group()


def _run_ranks(sizes: tuple[int, ...], repeats: int, *, all_reduce: bool, probe: bool,
               timeout_s: float) -> list[dict[str, list]]:
    """Both ranks' raw times: ``{"p2p": [[s per repeat] per size], "allreduce": ..., "slowdown": [...]}``."""
    if len(sizes) < 2 or any(not isinstance(s, int) or s < 4 for s in sizes):
        raise InputError(f"need at least two sizes of >= 4 bytes, got {sizes!r}", source="sizes", field="sizes")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(free_port(), tuple(sizes), repeats, all_reduce, probe, tmp),
                                 nprocs=2, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise TimeoutError(f"gloo link measurement did not finish in {timeout_s} s")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]


def _message_bytes(sizes: tuple[int, ...]) -> np.ndarray:
    """Bytes actually sent for each requested size (whole float32 elements)."""
    return np.array([max(1, s // 4) * 4 for s in sizes], dtype=np.float64)


def measure_gloo_link(*, sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 10,
                      timeout_s: float = 120.0) -> tuple[float, float, dict[int, float]]:
    """``(bandwidth bytes/s, latency s, {bytes: one-way seconds})`` of gloo send/recv between two local
    processes (one torch thread each), from the fastest round trip of each size. Takes a few seconds, mostly
    process start-up."""
    raw = _run_ranks(tuple(sizes), repeats, all_reduce=False, probe=False, timeout_s=timeout_s)[0]
    one_way = np.array([min(times) for times in raw["p2p"]])
    num_bytes = _message_bytes(tuple(sizes))
    design = np.stack([np.ones_like(num_bytes), num_bytes], axis=1)
    weights = 1.0 / one_way
    latency, seconds_per_byte = nnls(design * weights[:, None], one_way * weights)
    bandwidth = 1.0 / seconds_per_byte if seconds_per_byte > 0 else float(num_bytes.max() / one_way.max())
    return float(bandwidth), float(latency), {int(b): float(t) for b, t in zip(num_bytes, one_way)}


def fit_line(points) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of ``time = latency + bytes / bandwidth`` (least squares over
    ``(bytes, seconds)`` points; a negative intercept is clipped to 0)."""
    x = np.array([p[0] for p in points], dtype=np.float64)
    y = np.array([p[1] for p in points], dtype=np.float64)
    slope, intercept = np.polyfit(x, y, 1)
    return max(float(intercept), 0.0), float(1.0 / max(slope, 1e-15))


def measure_links(*, sizes: tuple[int, ...] = LINK_SIZES, repeats: int = 15, timeout_s: float = 300.0) -> dict:
    """p2p and all-reduce between two gloo ranks on this machine: medians per size, load-normalised fits
    (``p2p_latency``/``p2p_bandwidth``, ``dp_latency``/``dp_bandwidth``), the raw wall-clock fits under
    ``wall_clock``, the raw medians under ``raw`` and the 1-minute load average."""
    ranks = _run_ranks(tuple(sizes), repeats, all_reduce=True, probe=True, timeout_s=timeout_s)
    raw = {op: [(size, float(np.median(times))) for size, times in zip(sizes, ranks[0][op])]
           for op in ("p2p", "allreduce")}
    raw["slowdown"] = ranks[0]["slowdown"]
    # other jobs slow the copies down as they slow compute; the probes (both ranks, before and after each
    # size) give the factor, so the figures below are for uncontended cores, like the normalised steps
    slow = np.mean([ranks[0]["slowdown"], ranks[1]["slowdown"]], axis=0).reshape(len(sizes), 2).mean(axis=1)
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
