"""Pure pipeline-schedule engine: op start/end times of GPipe and 1F1B, vectorised over batch axes.

Inputs are per-micro-batch, per-stage durations shaped ``[..., M, P]`` (M micro-batches, P stages); the
leading axes are anything the caller wants to evaluate at once (typically ``[num_steps, dp_size]``: every
step of an epoch on every data-parallel rank). The schedule fixes the order of operations on each stage;
an operation starts when its stage is free and its input has arrived:

    F(m, s)  after the previous op of stage s, and after F(m, s-1) ended + the activation transfer s-1 -> s
    B(m, s)  after the previous op of stage s, and after B(m, s+1) ended + the gradient transfer s+1 -> s
             (the last stage's B(m) follows its own F(m) by the schedule order)

A backward op of a stage with recomputation first re-runs the checkpointed forwards (``recompute``), then
the backward proper: both happen after the gradient arrived, as with PyTorch / Megatron checkpointing.
Transfers are asynchronous: they delay the receiver, not the sender.

The Python loop runs once per op of the schedule (2*M*P iterations, in a fixed topological order cached per
(pp_schedule, P, M)); each iteration is a handful of numpy operations over all batch items at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from omnibal.errors import InputError
from omnibal.layout import PipelineSchedule

FWD, BWD = 0, 1


def _unknown(pp_schedule: str) -> InputError:
    return InputError(f"unknown pipeline schedule {pp_schedule!r}; choose one of {', '.join(PipelineSchedule)}",
                      source="pp_schedule", field="pp_schedule")


def check_layout(pp_schedule: str, num_stages: int, num_microbatches: int, num_chunks: int) -> None:
    """Refuse a (pp_schedule, P, M, chunks) combination the schedule cannot run."""
    if pp_schedule not in tuple(PipelineSchedule):
        raise _unknown(pp_schedule)
    if pp_schedule == "interleaved":
        if num_chunks < 2:
            raise InputError(f"interleaved 1F1B needs >= 2 model chunks per stage, got {num_chunks}",
                             source="num_chunks", field="num_chunks")
        if num_microbatches % num_stages:
            raise InputError(f"interleaved 1F1B needs micro-batches ({num_microbatches}) divisible by the "
                             f"pipeline stages ({num_stages})", source="num_microbatches", field="num_microbatches")
    elif num_chunks != 1:
        raise InputError(f"{pp_schedule} runs one model chunk per stage, got {num_chunks}", source="num_chunks",
                         field="num_chunks")


def device_op_order(pp_schedule: str, num_stages: int, num_microbatches: int, device: int,
                    num_chunks: int = 1) -> tuple[tuple[int, int, int], ...]:
    """Ops of one pipeline device in execution order as ``(FWD|BWD, micro_batch, virtual_stage)``.

    Virtual stage ``c * P + d`` is model chunk ``c`` of device ``d`` (one chunk per device except for
    ``interleaved``, Megatron's interleaved 1F1B: micro-batches go through the chunks in groups of P)."""
    p, m, v = num_stages, num_microbatches, num_chunks
    check_layout(pp_schedule, p, m, v)
    if pp_schedule == "gpipe":
        return tuple((FWD, i, device) for i in range(m)) + tuple((BWD, i, device) for i in range(m))
    if pp_schedule == "1f1b":
        warmup = min(p - 1 - device, m)
        fwd = [(FWD, i, device) for i in range(m)]
        bwd = [(BWD, i, device) for i in range(m)]
    else:
        total = m * v
        group = p * v

        def chunk(k: int, forward: bool) -> int:
            c = (k % group) // p
            return c if forward else v - 1 - c

        mb = [(k // group) * p + k % p for k in range(total)]
        fwd = [(FWD, mb[k], chunk(k, True) * p + device) for k in range(total)]
        bwd = [(BWD, mb[k], chunk(k, False) * p + device) for k in range(total)]
        warmup = total if m == p else min((p - device - 1) * 2 + (v - 1) * p, total)
        m = total
    ops = fwd[:warmup]
    for i in range(m - warmup):  # steady state: one forward, one backward
        ops += [fwd[warmup + i], bwd[i]]
    ops += bwd[m - warmup:]
    return tuple(ops)


def stage_op_order(pp_schedule: str, num_stages: int, num_microbatches: int, stage: int) -> tuple[tuple[int, int], ...]:
    """Ops of one stage (one chunk per stage) in execution order as ``(FWD|BWD, micro_batch)`` pairs."""
    return tuple((kind, mb) for kind, mb, _ in device_op_order(pp_schedule, num_stages, num_microbatches, stage))


@lru_cache(maxsize=256)
def global_op_order(pp_schedule: str, num_stages: int, num_microbatches: int,
                    num_chunks: int = 1) -> tuple[tuple[int, int, int, int], ...]:
    """All ops as ``(device, FWD|BWD, micro_batch, virtual_stage)`` in an order where every op follows its
    dependencies.

    Built by sweeping the devices round-robin and taking each device's next op once its cross-stage input
    has been produced; a sweep without progress means the per-device orders deadlock (a bug, asserted).
    """
    per_dev = [device_op_order(pp_schedule, num_stages, num_microbatches, d, num_chunks) for d in range(num_stages)]
    last = num_stages * num_chunks - 1
    pos = [0] * num_stages
    done = np.zeros((2, num_microbatches, last + 1), dtype=bool)
    order: list[tuple[int, int, int, int]] = []
    total = sum(len(ops) for ops in per_dev)
    while len(order) < total:
        progressed = False
        for d in range(num_stages):
            while pos[d] < len(per_dev[d]):
                kind, mb, vs = per_dev[d][pos[d]]
                if kind == FWD:
                    ready = vs == 0 or done[FWD, mb, vs - 1]
                else:
                    ready = done[FWD, mb, vs] and (vs == last or done[BWD, mb, vs + 1])
                if not ready:
                    break
                done[kind, mb, vs] = True
                order.append((d, kind, mb, vs))
                pos[d] += 1
                progressed = True
        assert progressed, f"{pp_schedule} deadlocks at P={num_stages}, M={num_microbatches}, v={num_chunks}"
    return tuple(order)


@lru_cache(maxsize=256)
def inflight_masks(pp_schedule: str, num_stages: int, num_microbatches: int,
                   num_chunks: int = 1) -> tuple[np.ndarray, ...]:
    """Per device, a ``[K, M * v]`` 0/1 matrix: row k marks the (micro-batch, chunk) pairs — column
    ``mb * v + chunk`` — whose activations are held while the device runs its k-th op (forward started,
    backward not yet finished; the op's own micro-batch is in)."""
    masks = []
    for d in range(num_stages):
        held = np.zeros(num_microbatches * num_chunks)
        rows = []
        for kind, mb, vs in device_op_order(pp_schedule, num_stages, num_microbatches, d, num_chunks):
            col = mb * num_chunks + vs // num_stages
            if kind == FWD:
                held[col] = 1.0
            rows.append(held.copy())
            if kind == BWD:
                held[col] = 0.0
        mask = np.array(rows)
        mask.setflags(write=False)
        masks.append(mask)
    return tuple(masks)


def peak_inflight(pp_schedule: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> np.ndarray:
    """``[P]`` most micro-batch chunks whose activations a device holds at once (1F1B: min(P - s, M))."""
    return np.array([int(m.sum(axis=1).max())
                     for m in inflight_masks(pp_schedule, num_stages, num_microbatches, num_chunks)])


@dataclass(frozen=True, eq=False)
class PipelineTimes:
    """Result of :func:`simulate_pipeline`. Arrays have the caller's batch axes ``[...]`` in front."""

    pp_schedule: str
    """Schedule kind."""
    num_chunks: int
    """Model chunks per device (virtual stages = P * num_chunks; > 1 only for ``interleaved``)."""
    stage_end: np.ndarray
    """``[..., P]`` time each stage finishes its last op (its gradients are complete then)."""
    makespan: np.ndarray
    """``[...]`` time the whole pipeline finishes (max of ``stage_end``)."""
    busy: np.ndarray
    """``[..., P]`` compute time of each stage (forward + recompute + backward)."""
    bubble: np.ndarray
    """``[...]`` idle share of the pipeline: 1 - sum(busy) / (P * makespan); 0 when nothing runs."""
    peak_inflight: np.ndarray
    """``[P]`` most micro-batch chunks whose activations a device holds at once (fixed by the schedule)."""
    peak_act_bytes: np.ndarray | None
    """``[..., P]`` peak activation bytes per stage (held micro-batches + the running op's transient), or
    None when no activation bytes were given."""
    fwd_start: np.ndarray | None = None
    """``[..., M, V]`` start of each forward (None unless ``keep_timeline``)."""
    fwd_end: np.ndarray | None = None
    """``[..., M, V]`` end of each forward."""
    bwd_start: np.ndarray | None = None
    """``[..., M, V]`` start of each backward op (its recompute runs first, then the backward proper)."""
    bwd_end: np.ndarray | None = None
    """``[..., M, V]`` end of each backward op."""


def _front(x: np.ndarray) -> np.ndarray:
    """``[..., M, K]`` -> contiguous ``[M, K, ...]`` so that ``x[m, s]`` is one contiguous batch array."""
    return np.ascontiguousarray(np.moveaxis(x, (-2, -1), (0, 1)))


def _back(x: np.ndarray) -> np.ndarray:
    return np.moveaxis(x, (0, 1), (-2, -1))


def simulate_pipeline(
    fwd: np.ndarray,
    bwd: np.ndarray,
    recompute: np.ndarray | None = None,
    p2p_fwd: np.ndarray | None = None,
    p2p_bwd: np.ndarray | None = None,
    *,
    pp_schedule: str = "1f1b",
    num_chunks: int = 1,
    act_bytes: np.ndarray | None = None,
    transient_bytes: np.ndarray | None = None,
    keep_timeline: bool = False,
) -> PipelineTimes:
    """Simulate one pipeline per batch item.

    ``fwd``, ``bwd``, ``recompute``: ``[..., M, V]`` seconds per virtual stage (V = P * num_chunks; with
    one chunk per device, V = P stages). ``p2p_fwd`` / ``p2p_bwd``: ``[..., M, V-1]`` seconds to send the
    activation of boundary k -> k+1 forward / its gradient k+1 -> k backward (default: ``p2p_bwd =
    p2p_fwd``, which is 0 when not given). ``act_bytes``: ``[..., M, V]`` bytes a micro-batch keeps on a
    stage from its forward until its backward ends; ``transient_bytes``: ``[..., M, V]`` extra bytes only
    while its backward runs (the recomputed layer's full activations). Leading axes broadcast. Per-device
    results (``stage_end``, ``busy``, memory) have P entries; the timeline keeps V.
    """
    fwd, bwd, rec, pf, pb = _checked_durations(fwd, bwd, recompute, p2p_fwd, p2p_bwd, num_chunks)
    num_mb, num_virtual = fwd.shape[-2:]
    num_stages = num_virtual // num_chunks
    check_layout(pp_schedule, num_stages, num_mb, num_chunks)

    batch_shape = np.broadcast_shapes(fwd.shape[:-2], bwd.shape[:-2], rec.shape[:-2], pf.shape[:-2], pb.shape[:-2])
    full = batch_shape + (num_mb, num_virtual)
    link = batch_shape + (num_mb, max(num_virtual - 1, 0))
    F = _front(np.broadcast_to(fwd, full))
    Bt = _front(np.broadcast_to(bwd, full) + np.broadcast_to(rec, full))  # a backward op = recompute + backward
    PF = _front(np.broadcast_to(pf, link))
    PB = _front(np.broadcast_to(pb, link))
    free, (fs, fe, bs, be) = _run_ops(pp_schedule, num_stages, num_mb, num_chunks, F, Bt, PF, PB, batch_shape)

    stage_end = np.stack(free, axis=-1)
    makespan = stage_end.max(axis=-1)
    busy_v = _back(F).sum(axis=-2) + _back(Bt).sum(axis=-2)  # [..., V]
    busy = busy_v.reshape(busy_v.shape[:-1] + (num_chunks, num_stages)).sum(axis=-2)
    with np.errstate(invalid="ignore", divide="ignore"):
        bubble = np.where(makespan > 0, 1.0 - busy.sum(axis=-1) / (num_stages * makespan), 0.0)

    peak_act = None
    if act_bytes is not None or transient_bytes is not None:
        peak_act = _peak_activation_bytes(pp_schedule, num_stages, num_mb, num_chunks, act_bytes, transient_bytes,
                                          full, batch_shape)
    timeline = {}
    if keep_timeline:
        timeline = dict(fwd_start=_back(fs), fwd_end=_back(fe), bwd_start=_back(bs), bwd_end=_back(be))
    return PipelineTimes(
        pp_schedule=pp_schedule, num_chunks=num_chunks, stage_end=stage_end, makespan=makespan, busy=busy,
        bubble=bubble, peak_inflight=peak_inflight(pp_schedule, num_stages, num_mb, num_chunks),
        peak_act_bytes=peak_act, **timeline,
    )


def _checked_durations(fwd, bwd, recompute, p2p_fwd, p2p_bwd, num_chunks: int):
    """The duration arrays as float64 with their defaults filled in; a shape or value that cannot be a
    ``[..., M, V]`` duration (``[..., M, V-1]`` for links) is an InputError naming the argument."""
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    if fwd.ndim < 2:
        raise InputError(f"fwd must be [..., M, P], got shape {fwd.shape}", source="fwd", field="shape")
    num_mb, num_virtual = fwd.shape[-2:]
    if num_mb < 1 or num_virtual < 1:
        raise InputError(f"need at least one micro-batch and one stage, got M={num_mb}, P={num_virtual}",
                         source="fwd", field="shape")
    if num_chunks < 1 or num_virtual % num_chunks:
        raise InputError(f"{num_virtual} virtual stages do not split into {num_chunks} chunks per device",
                         source="num_chunks", field="num_chunks")
    rec = np.zeros((1, 1)) if recompute is None else np.asarray(recompute, dtype=np.float64)
    pf = np.zeros((1, max(num_virtual - 1, 0))) if p2p_fwd is None else np.asarray(p2p_fwd, dtype=np.float64)
    pb = pf if p2p_bwd is None else np.asarray(p2p_bwd, dtype=np.float64)
    for name, arr, width in (("bwd", bwd, num_virtual), ("recompute", rec, num_virtual),
                             ("p2p_fwd", pf, num_virtual - 1), ("p2p_bwd", pb, num_virtual - 1)):
        if arr.ndim < 2 or arr.shape[-1] not in (width, 1) or arr.shape[-2] not in (num_mb, 1):
            raise InputError(f"expected [..., {num_mb}, {width}], got {arr.shape}", source=name, field="shape")
    for name, arr in (("fwd", fwd), ("bwd", bwd), ("recompute", rec), ("p2p_fwd", pf), ("p2p_bwd", pb)):
        if arr.size and not (np.all(np.isfinite(arr)) and arr.min() >= 0):
            raise InputError("durations must be finite and >= 0", source=name, field="value")
    return fwd, bwd, rec, pf, pb


def _run_ops(pp_schedule: str, num_stages: int, num_mb: int, num_chunks: int, F, Bt, PF, PB, batch_shape):
    """Play the schedule's global op order: ``(per-device free times, (fwd start, fwd end, bwd start, bwd
    end))``, each op starting when its device is free and its input (previous stage's output + link) is in."""
    fs, fe, bs, be = (np.empty_like(F) for _ in range(4))
    free = [np.zeros(batch_shape) for _ in range(num_stages)]
    last = F.shape[1] - 1
    for d, kind, m, k in global_op_order(pp_schedule, num_stages, num_mb, num_chunks):
        if kind == FWD:
            start = free[d] if k == 0 else np.maximum(free[d], fe[m, k - 1] + PF[m, k - 1])
            fs[m, k] = start
            fe[m, k] = start + F[m, k]
            free[d] = fe[m, k]
        else:
            start = free[d] if k == last else np.maximum(free[d], be[m, k + 1] + PB[m, k])
            bs[m, k] = start
            be[m, k] = start + Bt[m, k]
            free[d] = be[m, k]
    return free, (fs, fe, bs, be)


def _peak_activation_bytes(pp_schedule: str, num_stages: int, num_mb: int, num_chunks: int, act_bytes,
                           transient_bytes, full, batch_shape) -> np.ndarray:
    """``[..., P]`` peak activation bytes per device: the kept activations of its in-flight micro-batches at
    every op, plus the transient bytes of the backward running then."""
    act = _front(np.broadcast_to(np.asarray(0.0 if act_bytes is None else act_bytes, np.float64), full))
    trans = None if transient_bytes is None else _front(np.broadcast_to(np.asarray(transient_bytes, np.float64), full))
    peaks = []
    for d, mask in enumerate(inflight_masks(pp_schedule, num_stages, num_mb, num_chunks)):
        chunks = [c * num_stages + d for c in range(num_chunks)]
        held_act = act[:, chunks].reshape((num_mb * num_chunks,) + batch_shape)  # column mb * v + chunk
        held = np.tensordot(mask, held_act, axes=(1, 0))  # [K, ...]
        if trans is not None:
            ops = device_op_order(pp_schedule, num_stages, num_mb, d, num_chunks)
            rows = [i for i, op in enumerate(ops) if op[0] == BWD]
            held[rows] += trans[[ops[i][1] for i in rows], [ops[i][2] for i in rows]]
        peaks.append(held.max(axis=0))
    return np.stack(peaks, axis=-1)
