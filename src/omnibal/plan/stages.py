"""Per-layer quantities the planner works with, derived once from a :class:`LayerCostTable`.

The planner reduces the epoch's micro-batches to two feature vectors:

* ``compute_features``: the **mean** micro-batch. Every time in the cost contract is linear in the
  features, so the mean time per micro-batch of any set of layers is exactly the time of the mean features.
  Pipeline throughput over an epoch is governed by these averages (the simulator later scores candidates
  on the real per-micro-batch distribution).
* ``memory_features``: a **high quantile (default: the maximum), taken per feature**, of the micro-batches.
  Memory is a hard limit: the step that holds the largest micro-batches in flight decides whether the job
  runs out of memory, and the allocator keeps that peak for the rest of the run. Sizing by the mean would
  run out of memory on about half the steps. All activation coefficients are non-negative, so the
  per-feature maximum bounds every micro-batch; for balanced packs it is the pack caps (the fixed buffer
  shapes a pipeline allocates anyway), so the bound is tight.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from omnibal.cost.analytic import zero3_active, zero3_layer_comm, zero_sharded_bytes
from omnibal.cost.table import (
    NUM_FEATURES,
    RECOMPUTE_FULL,
    RECOMPUTE_SELECTIVE,
    LayerCostTable,
    recompute_codes,
)
from omnibal.errors import InputError
from omnibal.layout import PLANNER_PP_SCHEDULES, PipelineSchedule, check_choice, check_layout_fields


@dataclass(frozen=True, kw_only=True)
class StageModelConfig:
    """How stages run and what they may hold: everything of the cluster the partition depends on."""

    num_stages: int
    """Pipeline stages (PP size)."""
    num_microbatches: int
    """Micro-batches per step on each DP rank (1F1B keeps min(P - s, M) of them in flight on stage s)."""
    dp_size: int = 1
    """Data-parallel size (ZeRO shards optimizer state, and with stage 2 gradients, over it)."""
    zero_stage: int = 1
    """0: nothing sharded; 1: optimizer state sharded over DP; 2: optimizer state and gradients; 3: also the
    weights (gathered per layer; the budget given here is then net of the gathered layers,
    ``omnibal.cost.analytic.zero3_gather_reserve``)."""
    memory_budget_bytes: float | None = None
    """Bytes one device may use for parameters, gradients, optimizer state and activations (None: no limit)."""
    p2p_bandwidth: float = 25e9
    """Bytes/s of the point-to-point link between neighbouring stages."""
    p2p_latency: float = 20e-6
    """Seconds of fixed cost per point-to-point transfer."""
    dp_bandwidth: float = 25e9
    """Bytes/s per rank of the data-parallel ring (ZeRO-3's per-layer all-gather and reduce-scatter)."""
    dp_latency: float = 20e-6
    """Seconds of latency per ring step."""
    memory_quantile: float = 1.0
    """Per-feature quantile of the micro-batches used to size activation memory (1.0: the maximum)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: ``1f1b`` (stage s holds min(P - s, M) micro-batches), ``gpipe`` (all M) or
    ``interleaved`` (Megatron's interleaved 1F1B; ``num_stages`` then counts virtual stages)."""
    num_chunks: int = 1
    """Model chunks per device (``interleaved`` only, >= 2): the ``num_stages`` virtual stages are
    ``num_chunks`` per device, virtual stage ``c * P + d`` being chunk ``c`` of device ``d``."""
    budget_shares: tuple[float, ...] | None = None
    """Per (virtual) stage, the share of ``memory_budget_bytes`` it may use (None: all of it). Interleaved
    chunks share one device's memory: shares that sum to at most 1 per device keep the device within it."""
    selective_recompute: bool = False
    """Whether adaptive recompute may run transformer blocks selectively (keep the matrix products' and
    attention's outputs, recompute the element-wise ops) besides whole layers; False: whole layers only, as
    the OmniBal paper (and an engine that cannot express selective recompute)."""

    def validate(self, num_layers: int) -> None:
        check_layout_fields({"num_stages": self.num_stages, "num_microbatches": self.num_microbatches,
                             "dp_size": self.dp_size, "zero_stage": self.zero_stage})
        if self.num_stages > num_layers:
            raise InputError(f"{self.num_stages} pipeline stages but the model has only {num_layers} layers "
                             "(each stage needs at least one)", source="num_stages", field="num_stages")
        if self.memory_budget_bytes is not None and not self.memory_budget_bytes > 0:
            raise InputError(f"must be positive, got {self.memory_budget_bytes!r}", source="memory_budget",
                             field="memory_budget_bytes")
        if not self.p2p_bandwidth > 0 or not self.p2p_latency >= 0:
            raise InputError("p2p bandwidth must be positive and latency non-negative", source="hardware",
                             field="p2p_bandwidth")
        check_choice(self.pp_schedule, (*PLANNER_PP_SCHEDULES, PipelineSchedule.INTERLEAVED), source="pp_schedule",
                     field="pp_schedule")
        if (self.pp_schedule == PipelineSchedule.INTERLEAVED) != (self.num_chunks > 1) \
                or self.num_stages % self.num_chunks:
            raise InputError(f"{self.num_stages} stages in {self.num_chunks} chunks per device with pp_schedule "
                             f"{self.pp_schedule!r}: only interleaved runs (and needs) several chunks, and the virtual "
                             "stages must split evenly over the devices", source="num_chunks", field="num_chunks")
        if self.budget_shares is not None and (len(self.budget_shares) != self.num_stages
                                               or not all(0 < w <= 1 for w in self.budget_shares)):
            raise InputError(f"need one share in (0, 1] per stage, got {self.budget_shares!r}",
                             source="budget_shares", field="budget_shares")
        if not 0.0 < self.memory_quantile <= 1.0:
            raise InputError(f"must be in (0, 1], got {self.memory_quantile!r}", source="memory_quantile",
                             field="memory_quantile")

    @property
    def num_devices(self) -> int:
        """Pipeline devices (``num_stages`` over the chunks per device)."""
        return self.num_stages // self.num_chunks

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations stage ``stage`` holds at its peak (1F1B: min(P - s, M); GPipe: M;
        interleaved: the most the schedule's op order ever holds of that chunk, ``chunk_in_flight``)."""
        if self.pp_schedule == "gpipe":
            return self.num_microbatches
        if self.pp_schedule == PipelineSchedule.INTERLEAVED:
            return chunk_in_flight(self.num_devices, self.num_microbatches, self.num_chunks)[stage]
        return min(self.num_stages - stage, self.num_microbatches)

    def stage_budget(self, stage: int) -> float | None:
        """Bytes stage ``stage`` may use: the budget, times its share when shares are set."""
        if self.memory_budget_bytes is None or self.budget_shares is None:
            return self.memory_budget_bytes
        return self.memory_budget_bytes * self.budget_shares[stage]


@lru_cache(maxsize=64)
def chunk_in_flight(num_devices: int, num_microbatches: int, num_chunks: int) -> tuple[int, ...]:
    """Per virtual stage ``c * P + d`` of interleaved 1F1B, the most micro-batches whose activations chunk
    ``c`` of device ``d`` holds at once, read off the schedule's own op order
    (:func:`omnibal.sim.pipeline_order.inflight_masks`). Summed over a device's chunks it bounds the device's
    peak from above (the chunks' peaks need not coincide)."""
    from omnibal.sim.pipeline_order import inflight_masks

    masks = inflight_masks("interleaved", num_devices, num_microbatches, num_chunks)
    out = [0] * (num_devices * num_chunks)
    for d, mask in enumerate(masks):
        per_chunk = mask.reshape(len(mask), num_microbatches, num_chunks).sum(axis=1).max(axis=0)
        for c in range(num_chunks):
            out[c * num_devices + d] = int(per_chunk[c])
    return tuple(out)


@dataclass(frozen=True, eq=False)
class LayerQuantities:
    """Per-layer numbers for one (table, features, config): what partition and recompute optimise."""

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    compute_time: np.ndarray
    """``[L]`` forward + backward (+ tensor-parallel collectives) seconds of the mean micro-batch."""
    recompute_time: np.ndarray
    """``[L]`` seconds to recompute the layer's forward when it is checkpointed."""
    act_bytes: np.ndarray
    """``[L]`` activation bytes kept for backward per in-flight micro-batch (memory features)."""
    ckpt_bytes: np.ndarray
    """``[L]`` bytes kept per in-flight micro-batch when the layer is checkpointed."""
    sel_act_bytes: np.ndarray
    """``[L]`` bytes kept per in-flight micro-batch under selective recompute."""
    sel_recompute_time: np.ndarray
    """``[L]`` seconds selective recompute adds to the backward (the element-wise forward ops)."""
    static_bytes: np.ndarray
    """``[L]`` parameters + gradients + optimizer state per device after ZeRO sharding."""
    boundary_time: np.ndarray
    """``[L - 1]`` seconds a stage spends per micro-batch on a boundary placed after layer ``l``:
    sending/receiving the activation forward and its gradient backward."""
    compute_features: np.ndarray
    """``[4]`` the mean micro-batch."""
    memory_features: np.ndarray
    """``[4]`` the per-feature quantile micro-batch."""

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @property
    def saving_bytes(self) -> np.ndarray:
        """``[L]`` bytes per in-flight micro-batch that checkpointing a layer frees (never negative)."""
        return np.maximum(self.act_bytes - self.ckpt_bytes, 0.0)

    @property
    def sel_saving_bytes(self) -> np.ndarray:
        """``[L]`` bytes per in-flight micro-batch that selective recompute frees (never more than full)."""
        return np.minimum(np.maximum(self.act_bytes - self.sel_act_bytes, 0.0), self.saving_bytes)


def representative_features(features: np.ndarray, memory_quantile: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``(mean, quantile)`` feature vectors of micro-batch features of any shape ``[..., 4]``.

    Empty micro-batches (all-zero rows, e.g. padding slots of a schedule) are left out: they cost nothing
    and would bias the mean down.
    """
    flat = np.asarray(features, dtype=np.float64).reshape(-1, NUM_FEATURES)
    flat = flat[np.any(flat[:, 1:] > 0, axis=1)]
    if len(flat) == 0:
        raise InputError("no non-empty micro-batch in the features", source="features")
    if not np.all(np.isfinite(flat)) or np.any(flat < 0):
        raise InputError("micro-batch features must be finite and non-negative", source="features")
    mean = flat.mean(axis=0)
    mem = flat.max(axis=0) if memory_quantile >= 1.0 else np.quantile(flat, memory_quantile, axis=0)
    return mean, mem


def layer_quantities(table: LayerCostTable, features: np.ndarray, config: StageModelConfig) -> LayerQuantities:
    """Reduce a cost table and the epoch's micro-batch features ``[..., 4]`` to per-layer numbers."""
    config.validate(table.num_layers)
    mean, mem = representative_features(features, config.memory_quantile)
    fwd, bwd = table.evaluate("fwd_time", mean), table.evaluate("bwd_time", mean)
    if table.tp_comm_time is not None:  # half of the collectives are in the forward, which recompute repeats
        tp_half = 0.5 * table.evaluate("tp_comm_time", mean)
        fwd, bwd = fwd + tp_half, bwd + tp_half
    compute, recompute = fwd + bwd, fwd
    if zero3_active(config.zero_stage, config.dp_size):
        # as the simulator (sim.costs): a layer's forward takes the longer of its compute and its weights'
        # all-gather; its backward phase (recompute + backward share one gather) the longer of that compute
        # and the gather + the gradients' reduce-scatter; checkpointing adds only what exceeds the collectives
        comm_fwd, comm_bwd = zero3_layer_comm(table, zero_stage=config.zero_stage, dp_size=config.dp_size,
                                              bandwidth=config.dp_bandwidth, latency=config.dp_latency)
        back = np.maximum(bwd, comm_bwd)
        compute = np.maximum(fwd, comm_fwd) + back
        recompute = np.maximum(bwd + fwd, comm_bwd) - back
    static = sum(zero_sharded_bytes(table, dp_size=config.dp_size, zero_stage=config.zero_stage))
    out = table.evaluate("out_bytes", mean)[:-1]
    boundary = 2.0 * (config.p2p_latency + out / config.p2p_bandwidth)
    return LayerQuantities(
        names=tuple(table.names), kinds=tuple(table.kinds),
        compute_time=compute, recompute_time=recompute,
        act_bytes=table.evaluate("act_bytes", mem), ckpt_bytes=table.evaluate("ckpt_bytes", mem),
        sel_act_bytes=table.evaluate("sel_act_bytes", mem), sel_recompute_time=table.evaluate("sel_fwd_time", mean),
        static_bytes=static, boundary_time=boundary,
        compute_features=mean, memory_features=mem,
    )


def stage_boundary_time(q: LayerQuantities, start: int, stop: int) -> float:
    """Per-micro-batch p2p seconds of the stage holding layers ``[start, stop)`` (its two boundaries)."""
    left = q.boundary_time[start - 1] if start > 0 else 0.0
    right = q.boundary_time[stop - 1] if stop < q.num_layers else 0.0
    return float(left + right)


def stage_saving(q: LayerQuantities, start: int, stop: int, modes: np.ndarray) -> np.ndarray:
    """``[stop - start]`` bytes per in-flight micro-batch each layer frees at its recompute mode
    (:mod:`omnibal.cost.table` codes: none, full, selective)."""
    modes = recompute_codes(modes)
    assert modes.shape == (stop - start,)
    return np.select([modes == RECOMPUTE_FULL, modes == RECOMPUTE_SELECTIVE],
                     [q.saving_bytes[start:stop], q.sel_saving_bytes[start:stop]], 0.0)


def stage_recompute_time(q: LayerQuantities, start: int, stop: int, modes: np.ndarray) -> float:
    """Seconds per micro-batch the stage's recompute adds at the given modes."""
    modes = recompute_codes(modes)
    return float(np.select([modes == RECOMPUTE_FULL, modes == RECOMPUTE_SELECTIVE],
                           [q.recompute_time[start:stop], q.sel_recompute_time[start:stop]], 0.0).sum())


def stage_memory(q: LayerQuantities, start: int, stop: int, in_flight: int, checkpointed: np.ndarray) -> float:
    """Peak bytes of the stage ``[start, stop)`` holding ``in_flight`` micro-batches, each layer recomputed as
    ``checkpointed`` says (a bool mask over the stage's layers: full recompute where true; or recompute codes,
    :func:`omnibal.cost.table.recompute_codes`).

    Peak = static + in_flight * (kept activations) + the working set of recomputing one layer (what it freed
    exists again for one micro-batch while its backward runs).
    """
    saving = stage_saving(q, start, stop, checkpointed)
    kept = q.act_bytes[start:stop] - saving
    working = float(saving.max(initial=0.0))
    return float(q.static_bytes[start:stop].sum() + in_flight * kept.sum() + working)
