"""Glue from the cost contract to the schedule engine: per-micro-batch, per-stage op times and bytes.

Given a :class:`~omnibal.cost.table.LayerCostTable`, a partition (cut points), a per-layer recompute mask
and micro-batch features ``[..., M, 4]``, every per-stage quantity is a sum of layer coefficient rows, so
all of them come out of one matrix product ``features @ C`` with ``C`` the stacked per-stage coefficients.
Inputs are plain arrays and one small config, so the planner can call this thousands of times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal.cost.analytic import zero3_active, zero3_gather_reserve, zero3_layer_comm, zero_sharded_bytes
from omnibal.cost.hardware import DEFAULT_MEMORY_HEADROOM, memory_budget
from omnibal.cost.spec import even_cuts as _even_cuts
from omnibal.cost.table import NUM_FEATURES, RECOMPUTE_FULL, RECOMPUTE_SELECTIVE, LayerCostTable, recompute_codes
from omnibal.errors import InputError
from omnibal.layout import PipelineSchedule, check_choice, check_layout_fields
from omnibal.validate import is_int


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """How the cluster runs a step (everything but the partition, the recompute set and the data)."""

    pp_schedule: str = "1f1b"
    """Pipeline schedule: ``gpipe``, ``1f1b`` or ``interleaved`` (Megatron's interleaved 1F1B)."""
    num_chunks: int = 1
    """Model chunks per pipeline device (``interleaved`` only, >= 2): the cut points then describe
    ``P * num_chunks`` virtual stages, virtual stage ``c * P + d`` living on device ``d``."""
    dp_size: int = 1
    """Data-parallel size (the features' DP axis must match; ZeRO shards over it)."""
    tp_size: int = 1
    """Tensor-parallel size (the cost table is already per device after the TP split; counts GPUs)."""
    zero_stage: int = 1
    """0: nothing sharded; 1: optimizer state sharded over DP; 2: optimizer state and gradients; 3: also the
    weights, gathered layer by layer in every forward, recompute and backward (``zero3_layer_comm``)."""
    p2p_bandwidth: float = 25e9
    """Bytes/s of the point-to-point link between neighbouring stages."""
    p2p_latency: float = 20e-6
    """Seconds of fixed cost per point-to-point transfer."""
    dp_bandwidth: float = 25e9
    """Bytes/s per rank of the data-parallel gradient all-reduce (ring bus bandwidth)."""
    dp_latency: float = 20e-6
    """Seconds of latency per ring step of the all-reduce."""
    memory_budget_bytes: float | None = None
    """Bytes one device may use (OOM flags); None: no limit."""
    step_overhead: float = 0.0
    """Fixed seconds per step outside the pipeline (optimizer step, launch; set by calibration)."""
    p2p_occupancy: float = 0.0
    """Share of a transfer's time that also keeps the sending and the receiving device busy: 0 for
    asynchronous copies (GPU with NCCL), up to 1 where the host CPU moves the bytes itself (gloo on CPU)."""
    compute_jitter: float = 0.0
    """Relative standard deviation of a device's compute time per step that the cost table does not
    predict, independent across DP ranks (``omnibal.sim.calibrate.rank_jitter`` measures it). The gradient
    sync waits for the slowest DP rank, so with jitter more DP ranks mean longer waits (stragglers)."""

    def validate(self) -> None:
        check_choice(self.pp_schedule, PipelineSchedule, source="pp_schedule", field="pp_schedule")
        check_layout_fields({"dp_size": self.dp_size, "tp_size": self.tp_size, "zero_stage": self.zero_stage})
        if not is_int(self.num_chunks) \
                or self.num_chunks < 1:
            raise InputError(f"must be a positive integer, got {self.num_chunks!r}", source="num_chunks",
                             field="num_chunks")
        if (self.pp_schedule == "interleaved") != (self.num_chunks > 1):
            raise InputError(f"pp_schedule {self.pp_schedule!r} with {self.num_chunks} model chunks per device: only "
                             "'interleaved' runs (and needs) more than one", source="num_chunks", field="num_chunks")
        for name in ("p2p_bandwidth", "dp_bandwidth"):
            if not getattr(self, name) > 0:
                raise InputError(f"must be positive, got {getattr(self, name)!r}", source=name, field=name)
        if not 0.0 <= self.p2p_occupancy <= 1.0:
            raise InputError(f"must be in [0, 1], got {self.p2p_occupancy!r}", source="p2p_occupancy",
                             field="p2p_occupancy")
        for name in ("p2p_latency", "dp_latency", "step_overhead", "compute_jitter"):
            if not getattr(self, name) >= 0:
                raise InputError(f"must be >= 0, got {getattr(self, name)!r}", source=name, field=name)
        if self.memory_budget_bytes is not None and not self.memory_budget_bytes > 0:
            raise InputError(f"must be positive, got {self.memory_budget_bytes!r}", source="memory_budget",
                             field="memory_budget_bytes")


def even_cuts(num_layers: int, num_stages: int) -> np.ndarray:
    """``[P+1]`` cut points of the even layer-count split (:func:`omnibal.cost.spec.even_cuts`, which the planner
    and the trainer use too; it rounded differently here: 97 layers in 4 stages gave 24/24/25/24)."""
    return np.asarray(_even_cuts(num_layers, num_stages), dtype=np.int64)


def cuts_from_starts(starts, num_layers: int, source: str = "partition") -> np.ndarray:
    """Stage start layer indices ``[P]`` (first is 0) -> cut points ``[P+1]``."""
    return validate_cuts(np.append(np.asarray(starts, dtype=np.int64), num_layers), num_layers, source)


def validate_cuts(cuts, num_layers: int, source: str = "partition") -> np.ndarray:
    """Check cut points ``[P+1]``: start at 0, end at ``num_layers``, strictly increasing (no empty stage)."""
    arr = np.asarray(cuts)
    if arr.ndim != 1 or len(arr) < 2 or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"cut points must be a list of P+1 integers, got {cuts!r}", source=source, field="cuts")
    if arr[0] != 0 or arr[-1] != num_layers:
        raise InputError(f"cut points must start at 0 and end at the layer count {num_layers}, got "
                         f"{arr.tolist()}", source=source, field="cuts")
    bad = np.flatnonzero(np.diff(arr) <= 0)
    if len(bad):
        raise InputError(f"stage {int(bad[0])} is empty or reversed: cut points {arr.tolist()}", source=source,
                         record=int(bad[0]), field="cuts")
    return arr.astype(np.int64)


def recompute_mask_from_counts(cuts, counts, source: str = "recompute") -> np.ndarray:
    """Per-stage counts of recomputed layers -> a per-layer mask (each stage checkpoints its first layers)."""
    cuts = np.asarray(cuts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    sizes = np.diff(cuts)
    if counts.shape != sizes.shape:
        raise InputError(f"need one count per stage ({len(sizes)}), got {counts.tolist()}", source=source,
                         field="recompute")
    bad = np.flatnonzero((counts < 0) | (counts > sizes))
    if len(bad):
        s = int(bad[0])
        raise InputError(f"stage {s} has {sizes[s]} layers, cannot recompute {counts[s]}", source=source,
                         record=s, field="recompute")
    pos = np.arange(cuts[-1]) - np.repeat(cuts[:-1], sizes)
    return pos < np.repeat(counts, sizes)


@dataclass(frozen=True, eq=False)
class StageCosts:
    """Per-micro-batch, per-stage inputs of the schedule engine (leading axes as the features')."""

    fwd: np.ndarray
    """``[..., M, P]`` forward seconds."""
    bwd: np.ndarray
    """``[..., M, P]`` backward seconds."""
    recompute: np.ndarray
    """``[..., M, P]`` seconds re-running checkpointed forwards before the backward."""
    p2p: np.ndarray
    """``[..., M, P-1]`` seconds to move a boundary activation (and, backward, its gradient)."""
    act_bytes: np.ndarray
    """``[..., M, P]`` bytes a micro-batch keeps on a stage between its forward and backward."""
    transient_bytes: np.ndarray
    """``[..., M, P]`` extra bytes while its backward runs (the biggest recomputed layer's activations)."""
    static_bytes: np.ndarray
    """``[V]`` parameters + gradients + optimizer state per (virtual) stage (after ZeRO sharding)."""
    grad_bytes: np.ndarray
    """``[V]`` gradient bytes each (virtual) stage all-reduces over DP at the end of a step (0 under ZeRO-3,
    which reduce-scatters them layer by layer in the backward)."""

    def per_device(self, values: np.ndarray, num_chunks: int) -> np.ndarray:
        """``[..., V]`` per virtual stage -> ``[..., P]`` per device (sum over its chunks)."""
        values = np.asarray(values)
        return values.reshape(values.shape[:-1] + (num_chunks, -1)).sum(axis=-2)


def stage_costs(table: LayerCostTable, cuts, recompute_mask, features: np.ndarray, config: SimConfig,
                buffer_features: np.ndarray | None = None) -> StageCosts:
    """Per-stage op times and bytes of every micro-batch in ``features [..., M, 4]``.

    ``buffer_features`` (same shape, default ``features``): what crosses a stage boundary when a pipeline
    sends fixed-shape buffers (the caps) while compute skips the padding."""
    num_layers = table.num_layers
    cuts = validate_cuts(cuts, num_layers)
    num_stages = len(cuts) - 1
    rec = np.zeros(num_layers, np.int8) if recompute_mask is None else recompute_codes(recompute_mask)
    if rec.shape != (num_layers,):
        raise InputError(f"recompute mask needs {num_layers} entries, got shape {rec.shape}", source="recompute",
                         field="recompute_mask")
    features = np.asarray(features, dtype=np.float64)
    if features.ndim < 2 or features.shape[-1] != NUM_FEATURES:
        raise InputError(f"features must be [..., M, {NUM_FEATURES}], got {features.shape}", source="features",
                         field="shape")
    if buffer_features is not None:
        buffer_features = np.broadcast_to(np.asarray(buffer_features, dtype=np.float64), features.shape)

    stage_of = np.repeat(np.arange(num_stages), np.diff(cuts))
    assign = (stage_of[None, :] == np.arange(num_stages)[:, None]).astype(np.float64)  # [P, L]
    tp_half = 0.0 if table.tp_comm_time is None else 0.5 * table.tp_comm_time  # forward and backward collectives
    fwd_l = table.fwd_time + tp_half
    bwd_l = table.bwd_time + tp_half
    full, sel = (rec == RECOMPUTE_FULL)[:, None], (rec == RECOMPUTE_SELECTIVE)[:, None]
    act_l = np.where(full, table.ckpt_bytes, np.where(sel, table.sel_act_bytes, table.act_bytes))
    # while a recomputed layer's backward runs, what it freed exists again on top of what is held
    extra_l = np.maximum(table.act_bytes - act_l, 0.0)
    redo_l = np.where(full, fwd_l, np.where(sel, table.sel_fwd_time, 0.0))  # recomputed forward per layer
    uniq, inverse = np.unique(extra_l, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    present = np.zeros((num_stages, len(uniq)), bool)  # which distinct transient rows each stage has
    present[stage_of, inverse] = True

    boundary = table.out_bytes[cuts[1:-1] - 1]  # [P-1, 4] activation leaving each stage
    blocks = [assign @ fwd_l, assign @ bwd_l, assign @ redo_l, assign @ act_l,
              boundary / config.p2p_bandwidth, uniq]
    widths = [len(b) for b in blocks]
    coef = np.concatenate(blocks, axis=0).T  # [4, K]
    # one 2-D product: a stacked [..., M, 4] @ [4, K] would loop over the batch axes in small matmuls
    values = (features.reshape(-1, NUM_FEATURES) @ coef).reshape(features.shape[:-1] + (coef.shape[1],))
    parts = np.split(values, np.cumsum(widths)[:-1], axis=-1)
    fwd, bwd, recompute, act, p2p, trans_u = parts
    if zero3_active(config.zero_stage, config.dp_size):
        fwd, bwd, recompute = _zero3_times(table, features, fwd_l, bwd_l, redo_l, assign, config)
    if buffer_features is not None and num_stages > 1:
        flat = buffer_features.reshape(-1, NUM_FEATURES)
        p2p = (flat @ (boundary / config.p2p_bandwidth).T).reshape(p2p.shape)
    p2p = p2p + config.p2p_latency
    if config.p2p_occupancy > 0 and num_stages > 1:
        # stage s sends/receives over boundary s-1 and s, in the forward (activation) and backward (gradient)
        pad = np.zeros(p2p.shape[:-1] + (1,))
        held = config.p2p_occupancy * (np.concatenate([pad, p2p], -1) + np.concatenate([p2p, pad], -1))
        fwd = fwd + held
        bwd = bwd + held
    transient = np.zeros_like(act)
    for k in range(len(uniq)):  # a handful of distinct rows (one per layer kind)
        if uniq[k].any():
            np.maximum(transient, trans_u[..., k:k + 1] * present[:, k], out=transient)

    zero3 = zero3_active(config.zero_stage, config.dp_size)
    # ZeRO-3 reduce-scatters each layer's gradients inside the backward (in bwd above): no sync at step end
    grad = np.zeros(num_stages) if zero3 else assign @ table.grad_bytes
    static = assign @ sum(zero_sharded_bytes(table, dp_size=config.dp_size, zero_stage=config.zero_stage))
    # the gathered layers are a per-device working set: once on each device's first chunk, not per chunk
    static[:num_stages // config.num_chunks] += zero3_gather_reserve(table, zero_stage=config.zero_stage,
                                                                     dp_size=config.dp_size)
    return StageCosts(fwd=fwd, bwd=bwd, recompute=recompute, p2p=p2p, act_bytes=act, transient_bytes=transient,
                      static_bytes=static, grad_bytes=grad)


def _zero3_times(table, features, fwd_l, bwd_l, redo_l, assign, config: SimConfig):
    """ZeRO-3 ``(fwd, bwd, recompute)`` per stage.

    Layer by layer, the weights' all-gather runs beside the compute of the layer before it (prefetch), so a
    layer's forward takes the longer of the two; its backward phase (the recomputed forward, when
    recomputed, then the backward: one gather serves both) takes the longer of that compute and the
    gather + the gradients' reduce-scatter (``zero3_layer_comm``; a frozen layer moves neither). The
    collectives hold the DP ranks in lockstep, so every rank takes, layer by layer, the slowest rank's time
    on its same micro-batch (features ``[..., D, M, 4]``). An empty micro-batch (a padding slot) costs
    nothing of its own."""
    comm_fwd, comm_bwd = zero3_layer_comm(table, zero_stage=config.zero_stage, dp_size=config.dp_size,
                                          bandwidth=config.dp_bandwidth, latency=config.dp_latency)
    lead = features.shape[:-1]
    busy = np.any(features[..., 1:] > 0, axis=-1)[..., None]
    flat = features.reshape(-1, NUM_FEATURES)  # one 2-D product each, as in stage_costs
    f = (flat @ fwd_l.T).reshape(lead + (-1,))  # [..., M, L]
    redo = (flat @ redo_l.T).reshape(f.shape)
    fwd = np.where(busy, np.maximum(f, comm_fwd), 0.0)
    back = np.where(busy, np.maximum((flat @ bwd_l.T).reshape(f.shape) + redo, comm_bwd), 0.0)
    redo = np.where(busy, redo, 0.0)
    if features.ndim >= 3:  # lockstep over the DP axis
        fwd, back, redo = (np.broadcast_to(x.max(axis=-3, keepdims=True), x.shape) for x in (fwd, back, redo))
    per_stage = lambda x: (x.reshape(-1, x.shape[-1]) @ assign.T).reshape(lead + (assign.shape[0],))  # noqa: E731
    return per_stage(fwd), per_stage(back - redo), per_stage(redo)


def config_for_hardware(hardware, *, dp_size: int, pp_size: int, tp_size: int = 1, pp_schedule: str = "1f1b",
                        num_chunks: int = 1, zero_stage: int = 1,
                        memory_headroom: float | None = DEFAULT_MEMORY_HEADROOM,
                        step_overhead: float = 0.0, p2p_occupancy: float | None = None,
                        compute_jitter: float = 0.0) -> SimConfig:
    """A :class:`SimConfig` for ``hardware`` (an ``omnibal.cost.hardware.HardwareSpec``: anything with
    ``link(inter_node=...)``, ``gpus_per_node`` and ``memory_bytes``). ``memory_headroom``: what the budget
    leaves of the device memory (:func:`omnibal.cost.hardware.memory_budget`; None: no budget).

    Ranks are laid out as Megatron does by default (tensor-parallel innermost, then data-parallel, pipeline
    outermost): the DP ring stays inside a node while ``tp * dp <= gpus_per_node``, and neighbouring
    pipeline stages share a node only while the whole ``tp * dp * pp`` job fits in one node. CPU "devices"
    (one process per rank, gloo) copy the bytes themselves, so there transfers also occupy both ends.
    """
    per_node = int(getattr(hardware, "gpus_per_node", 8))
    p2p_bw, p2p_lat = hardware.link(inter_node=tp_size * dp_size * pp_size > per_node)
    dp_bw, dp_lat = hardware.link(inter_node=tp_size * dp_size > per_node)
    if p2p_occupancy is None:
        p2p_occupancy = 1.0 if str(getattr(hardware, "name", "")).startswith("cpu") else 0.0
    budget = None if memory_headroom is None else memory_budget(float(hardware.memory_bytes), memory_headroom)
    config = SimConfig(pp_schedule=pp_schedule, num_chunks=num_chunks, dp_size=dp_size, tp_size=tp_size,
                       zero_stage=zero_stage,
                       p2p_bandwidth=p2p_bw, p2p_latency=p2p_lat, dp_bandwidth=dp_bw, dp_latency=dp_lat,
                       memory_budget_bytes=budget, step_overhead=step_overhead, p2p_occupancy=p2p_occupancy,
                       compute_jitter=compute_jitter)
    config.validate()
    return config
