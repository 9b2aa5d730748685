"""Hardware specs: peak math rates, memory, links, and the efficiency per op kind that calibration sets.

Presets carry published datasheet figures (dense, no sparsity; SXM parts, NVLink inside a node, one
InfiniBand NIC per GPU between nodes). A ``cpu`` spec is measured on the machine it runs on
(:func:`omnibal.measure.hardware.measure_cpu`); this module only holds specs, it never measures.

A modelled time is ``work / (peak * efficiency[kind])``: ``matmul`` (GEMMs), ``attention`` (the attention
core: QK^T, softmax, AV), ``memory`` (element-wise / memory-bound ops, against ``memory_bandwidth``) and
``comm`` (collectives and point-to-point transfers, against the link bandwidths). Defaults are typical
achieved fractions; :func:`omnibal.cost.calibrate` fits them to measurements.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from omnibal.errors import InputError
from omnibal.validate import check_non_negative_number, check_positive_int, check_positive_number

GiB = 1 << 30
EFFICIENCY_KINDS = ("matmul", "attention", "memory", "comm")
DEFAULT_MEMORY_HEADROOM = 0.05
"""Share of a device's memory a plan leaves for what the memory model does not count: the caching
allocator's reserve beyond the live tensors (with expandable segments, the trainer's CUDA default), the CUDA
context and the communication buffers. docs/gpu.md has the measurement it rests on."""


def memory_budget(device_bytes: float, headroom: float = DEFAULT_MEMORY_HEADROOM) -> float:
    """Bytes a plan may use on a device of ``device_bytes``: less ``headroom``, a share of it when below 1,
    else GiB. The one place the headroom is applied (the planner and the simulator both call it)."""
    check_non_negative_number(headroom, "memory_headroom", source="--memory-headroom")
    reserve = headroom * device_bytes if headroom < 1 else headroom * GiB
    if reserve >= device_bytes:
        raise InputError(f"a headroom of {headroom:g} leaves nothing of the {device_bytes / GiB:.1f} GiB device",
                         source="--memory-headroom", field="memory_headroom")
    return float(device_bytes - reserve)


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
    """Achieved fraction of the peak for GEMMs. Source of the default: Megatron-LM's whole training steps reach
    ~52% of A100 peak (Narayanan et al., SC'21: 163 of 312 TFLOP/s), which includes non-GEMM work, so the GEMMs
    alone run somewhat higher. :func:`omnibal.cost.calibrate` replaces it with a measured value."""
    eff_attention: float = 0.45
    """Achieved fraction of the peak for the attention core (flash attention). Source of the default:
    FlashAttention-2 (Dao, 2023) reaches 50-73% of A100 peak in the forward pass and less in the backward; the
    varlen (packed) kernels of short samples run lower. Calibration replaces it."""
    eff_memory: float = 0.7
    """Achieved fraction of the memory bandwidth for element-wise ops (a typical fraction for fused
    element-wise kernels; unfused PyTorch ops reach less). Calibration replaces it."""
    eff_comm: float = 0.75
    """Achieved fraction of the link bandwidths for communication (NCCL rings do not reach the datasheet link
    rate: protocol overhead and the ring's 2(n-1)/n factor counted separately). Calibration replaces it."""
    layer_overhead_s: float = 3e-5
    """Fixed time per layer and pass (kernel launches, small tensors), s."""

    def __post_init__(self) -> None:
        for key in ("peak_bf16_flops", "peak_fp32_flops", "memory_bytes", "memory_bandwidth",
                    "intra_node_bandwidth", "inter_node_bandwidth", "eff_matmul", "eff_attention",
                    "eff_memory", "eff_comm"):
            check_positive_number(getattr(self, key), key, source=self.name)
        for key in ("intra_node_latency", "inter_node_latency", "layer_overhead_s"):
            check_non_negative_number(getattr(self, key), key, source=self.name)
        check_positive_int(self.gpus_per_node, "gpus_per_node", source=self.name)

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
    """Preset names, and ``cpu`` (measured by :mod:`omnibal.measure.hardware`, not by :func:`get_hardware`)."""
    return tuple(_PRESETS) + ("cpu",)


def get_hardware(name: str) -> HardwareSpec:
    """A preset by name. Pure: ``cpu`` is not a preset but a measurement of the machine, made by
    :func:`omnibal.measure.hardware.measure_cpu` (:func:`omnibal.measure.hardware.hardware_by_name` takes
    either); asking for it here raises an InputError that says so."""
    if name == "cpu":
        raise InputError("'cpu' is measured on this machine, not a preset: call "
                         "omnibal.measure.hardware.measure_cpu() (or hardware_by_name)", source="hardware",
                         field="name")
    try:
        return _PRESETS[name]
    except (KeyError, TypeError):
        raise InputError(f"unknown hardware {name!r}; known: {', '.join(hardware_names())}",
                         source="hardware", field="name") from None
