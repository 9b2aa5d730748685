"""Hardware specs: peak math rates, memory, links, and the efficiency per op kind that calibration sets.

Presets carry published datasheet figures (dense, no sparsity; SXM parts, NVLink inside a node, one
InfiniBand NIC per GPU between nodes). ``cpu`` is measured on the machine it runs on: a few matmuls and a
large copy, timed with the requested thread count (nothing is cached between calls).

A modelled time is ``work / (peak * efficiency[kind])``: ``matmul`` (GEMMs), ``attention`` (the attention
core: QK^T, softmax, AV), ``memory`` (element-wise / memory-bound ops, against ``memory_bandwidth``) and
``comm`` (collectives and point-to-point transfers, against the link bandwidths). Defaults are typical
achieved fractions; :func:`omnibal.cost.calibrate` fits them to measurements.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from omnibal.errors import InputError

GiB = 1 << 30
EFFICIENCY_KINDS = ("matmul", "attention", "memory", "comm")


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One accelerator (or CPU) and its links."""

    name: str
    """Preset name or a user label; recorded in plans and reports."""
    peak_bf16_flops: float
    """Dense bf16 math rate, FLOP/s."""
    peak_fp32_flops: float
    """Dense fp32 math rate, FLOP/s (no TF32)."""
    memory_bytes: float
    """Device memory, bytes."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    intra_node_bandwidth: float
    """Per-device link bandwidth inside a node (NVLink), bytes/s in one direction."""
    intra_node_latency: float
    """Latency of one transfer inside a node, s."""
    inter_node_bandwidth: float
    """Per-device bandwidth between nodes (InfiniBand / RoCE), bytes/s in one direction."""
    inter_node_latency: float
    """Latency of one transfer between nodes, s."""
    gpus_per_node: int = 8
    """Devices sharing the fast intra-node links."""
    eff_matmul: float = 0.6
    """Achieved fraction of the peak for GEMMs."""
    eff_attention: float = 0.45
    """Achieved fraction of the peak for the attention core (flash attention)."""
    eff_memory: float = 0.7
    """Achieved fraction of the memory bandwidth for element-wise ops."""
    eff_comm: float = 0.75
    """Achieved fraction of the link bandwidths for communication."""
    layer_overhead_s: float = 3e-5
    """Fixed time per layer and pass (kernel launches, small tensors), s."""

    def __post_init__(self) -> None:
        for key in ("peak_bf16_flops", "peak_fp32_flops", "memory_bytes", "memory_bandwidth",
                    "intra_node_bandwidth", "inter_node_bandwidth", "eff_matmul", "eff_attention",
                    "eff_memory", "eff_comm"):
            _check_positive(self.name, key, getattr(self, key))
        for key in ("intra_node_latency", "inter_node_latency", "layer_overhead_s"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InputError(f"must be a finite number >= 0, got {value!r}", source=self.name, field=key)
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise InputError(f"must be a positive integer, got {self.gpus_per_node!r}", source=self.name,
                             field="gpus_per_node")

    def peak_flops(self, dtype: str) -> float:
        """Peak math rate for the training dtype (``bf16``/``fp16`` or ``fp32``)."""
        if dtype in ("bf16", "fp16"):
            return self.peak_bf16_flops
        if dtype == "fp32":
            return self.peak_fp32_flops
        raise InputError(f"unknown dtype {dtype!r}; use bf16, fp16 or fp32", source="dtype", field="dtype")

    def efficiency(self, kind: str) -> float:
        if kind not in EFFICIENCY_KINDS:
            raise InputError(f"unknown op kind {kind!r}; known: {', '.join(EFFICIENCY_KINDS)}",
                             source="efficiency", field="kind")
        return getattr(self, f"eff_{kind}")

    def with_efficiency(self, **factors: float) -> HardwareSpec:
        """A copy with some efficiency factors replaced: ``with_efficiency(matmul=0.55, comm=0.6)``."""
        for kind in factors:
            self.efficiency(kind)  # validates the name
        return replace(self, **{f"eff_{k}": float(v) for k, v in factors.items()})

    def link(self, *, inter_node: bool) -> tuple[float, float]:
        """(bandwidth * eff_comm, latency) of the link a transfer uses."""
        if inter_node:
            return self.inter_node_bandwidth * self.eff_comm, self.inter_node_latency
        return self.intra_node_bandwidth * self.eff_comm, self.intra_node_latency

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "hardware spec") -> HardwareSpec:
        try:
            return cls(**data)
        except TypeError as exc:
            raise InputError(f"not a hardware spec: {exc}", source=source, field="hardware") from exc


def _check_positive(where: str, key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InputError(f"must be a finite number > 0, got {value!r}", source=where, field=key)


# Datasheet figures (dense). Memory as nvidia-smi reports it. Links: NVLink per direction (A100: 600 GB/s
# bidirectional, H100/H200: 900 GB/s); between nodes one HDR 200 Gb/s (A100) or NDR 400 Gb/s (H100/H200)
# NIC per GPU. Latencies: typical NCCL small-message figures.
_PRESETS: dict[str, HardwareSpec] = {
    "a100-40g": HardwareSpec(name="a100-40g", peak_bf16_flops=312e12, peak_fp32_flops=19.5e12,
                             memory_bytes=40 * GiB, memory_bandwidth=1555e9, intra_node_bandwidth=300e9,
                             intra_node_latency=8e-6, inter_node_bandwidth=25e9, inter_node_latency=2e-5),
    "a100-80g": HardwareSpec(name="a100-80g", peak_bf16_flops=312e12, peak_fp32_flops=19.5e12,
                             memory_bytes=80 * GiB, memory_bandwidth=2039e9, intra_node_bandwidth=300e9,
                             intra_node_latency=8e-6, inter_node_bandwidth=25e9, inter_node_latency=2e-5),
    "h100": HardwareSpec(name="h100", peak_bf16_flops=989e12, peak_fp32_flops=67e12, memory_bytes=81559 * 2**20,
                         memory_bandwidth=3350e9, intra_node_bandwidth=450e9, intra_node_latency=6e-6,
                         inter_node_bandwidth=50e9, inter_node_latency=1.5e-5, layer_overhead_s=2e-5),
    "h200": HardwareSpec(name="h200", peak_bf16_flops=989e12, peak_fp32_flops=67e12,
                         memory_bytes=143771 * 2**20, memory_bandwidth=4800e9, intra_node_bandwidth=450e9,
                         intra_node_latency=6e-6, inter_node_bandwidth=50e9, inter_node_latency=1.5e-5,
                         layer_overhead_s=2e-5),
}


def hardware_names() -> tuple[str, ...]:
    return tuple(_PRESETS) + ("cpu",)


def get_hardware(name: str, *, threads: int = 1) -> HardwareSpec:
    """A preset by name; ``cpu`` measures this machine with ``threads`` torch threads."""
    if name == "cpu":
        return measure_cpu(threads=threads)
    try:
        return _PRESETS[name]
    except (KeyError, TypeError):
        raise InputError(f"unknown hardware {name!r}; known: {', '.join(hardware_names())}",
                         source="hardware", field="name") from None


def measure_cpu(*, threads: int = 1, repeats: int = 5, links: bool = False) -> HardwareSpec:
    """Measure this CPU: fp32 and bf16 matmul rates (512^3 and 2048x256x512 GEMMs) and the copy bandwidth
    of a 64 MiB tensor, with ``threads`` torch threads (restored afterwards); the best of ``repeats`` runs, on
    the process CPU clock when ``threads == 1`` (robust to other jobs), else the wall clock. Takes well
    under a second once torch is imported.

    CPU "links" are gloo over loopback TCP. With ``links=True`` they are measured too (two spawned processes
    ping-pong tensors, :func:`omnibal.cost.linkbench.measure_gloo_link`; several seconds of process start-up);
    otherwise the defaults are what a pipeline transfer costs on this project's 2-core machine: 1.6 GB/s
    (raw gloo send/recv, measured) and 1 ms per transfer (``facts.md``: ~1-2.5 ms per micro-batch through
    torch.distributed.pipelining; raw gloo alone is ~0.07 ms).
    """
    import torch

    if not isinstance(threads, int) or threads < 1:
        raise InputError(f"must be a positive integer, got {threads!r}", source="threads", field="threads")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rates = {}
        for dtype in (torch.float32, torch.bfloat16):
            best = 0.0
            for m, k, n in ((512, 512, 512), (2048, 256, 512)):
                a = torch.randn(m, k, dtype=dtype)
                b = torch.randn(k, n, dtype=dtype)
                seconds = _best_time(lambda: a @ b, repeats, cpu_clock=threads == 1)
                best = max(best, 2.0 * m * k * n / seconds)
            rates[dtype] = best
        src = torch.empty(8 << 20, dtype=torch.float64).fill_(1.0)  # 64 MiB
        dst = torch.empty_like(src)
        seconds = _best_time(lambda: dst.copy_(src), repeats, cpu_clock=threads == 1)
        bandwidth = 2.0 * src.numel() * src.element_size() / seconds  # read + write
    finally:
        torch.set_num_threads(old_threads)
    try:
        import os

        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        memory = 8.0 * GiB
    link_bandwidth, link_latency = 1.6e9, 1e-3
    if links:
        from omnibal.cost.linkbench import measure_gloo_link

        link_bandwidth, link_latency, _ = measure_gloo_link()
    return HardwareSpec(
        name=f"cpu-{threads}t", peak_bf16_flops=rates[torch.bfloat16], peak_fp32_flops=rates[torch.float32],
        memory_bytes=memory, memory_bandwidth=bandwidth, intra_node_bandwidth=link_bandwidth,
        intra_node_latency=link_latency, inter_node_bandwidth=link_bandwidth, inter_node_latency=link_latency,
        gpus_per_node=1,
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
