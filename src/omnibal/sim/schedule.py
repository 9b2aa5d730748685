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
(schedule, P, M)); each iteration is a handful of numpy operations over all batch items at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

from omnibal.errors import InputError

ScheduleKind = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")

FWD, BWD = 0, 1


def stage_op_order(schedule: str, num_stages: int, num_microbatches: int, stage: int) -> tuple[tuple[int, int], ...]:
    """Ops of one stage in execution order as ``(FWD|BWD, micro_batch)`` pairs."""
    m = num_microbatches
    if schedule == "gpipe":
        return tuple((FWD, i) for i in range(m)) + tuple((BWD, i) for i in range(m))
    if schedule == "1f1b":
        warmup = min(num_stages - 1 - stage, m)
        ops = [(FWD, i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, one backward
            ops += [(FWD, warmup + i), (BWD, i)]
        ops += [(BWD, i) for i in range(m - warmup, m)]
        return tuple(ops)
    raise InputError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}",
                     source="schedule", field="schedule")


@lru_cache(maxsize=256)
def global_op_order(schedule: str, num_stages: int, num_microbatches: int) -> tuple[tuple[int, int, int], ...]:
    """All ops as ``(stage, FWD|BWD, micro_batch)`` in an order where every op follows its dependencies.

    Built by sweeping the stages round-robin and taking each stage's next op once its cross-stage input
    has been produced; a sweep without progress means the per-stage orders deadlock (a bug, asserted).
    """
    per_stage = [stage_op_order(schedule, num_stages, num_microbatches, s) for s in range(num_stages)]
    pos = [0] * num_stages
    done = np.zeros((2, num_microbatches, num_stages), dtype=bool)
    order: list[tuple[int, int, int]] = []
    total = sum(len(ops) for ops in per_stage)
    while len(order) < total:
        progressed = False
        for s in range(num_stages):
            while pos[s] < len(per_stage[s]):
                kind, mb = per_stage[s][pos[s]]
                if kind == FWD:
                    ready = s == 0 or done[FWD, mb, s - 1]
                else:
                    ready = done[FWD, mb, s] and (s == num_stages - 1 or done[BWD, mb, s + 1])
                if not ready:
                    break
                done[kind, mb, s] = True
                order.append((s, kind, mb))
                pos[s] += 1
                progressed = True
        assert progressed, f"schedule {schedule} deadlocks at P={num_stages}, M={num_microbatches}"
    return tuple(order)


@lru_cache(maxsize=256)
def inflight_masks(schedule: str, num_stages: int, num_microbatches: int) -> tuple[np.ndarray, ...]:
    """Per stage, a ``[K, M]`` 0/1 matrix: row k marks the micro-batches whose activations are held while
    the stage runs its k-th op (forward started, backward not yet finished; the op's own micro-batch is in)."""
    masks = []
    for s in range(num_stages):
        held = np.zeros(num_microbatches)
        rows = []
        for kind, mb in stage_op_order(schedule, num_stages, num_microbatches, s):
            if kind == FWD:
                held[mb] = 1.0
            rows.append(held.copy())
            if kind == BWD:
                held[mb] = 0.0
        mask = np.array(rows)
        mask.setflags(write=False)
        masks.append(mask)
    return tuple(masks)


def peak_inflight(schedule: str, num_stages: int, num_microbatches: int) -> np.ndarray:
    """``[P]`` most micro-batches whose activations a stage holds at once (1F1B: min(P - s, M))."""
    return np.array([int(m.sum(axis=1).max()) for m in inflight_masks(schedule, num_stages, num_microbatches)])


@dataclass(frozen=True, eq=False)
class PipelineTimes:
    """Result of :func:`simulate_pipeline`. Arrays have the caller's batch axes ``[...]`` in front."""

    schedule: str
    """Schedule kind."""
    stage_end: np.ndarray
    """``[..., P]`` time each stage finishes its last op (its gradients are complete then)."""
    makespan: np.ndarray
    """``[...]`` time the whole pipeline finishes (max of ``stage_end``)."""
    busy: np.ndarray
    """``[..., P]`` compute time of each stage (forward + recompute + backward)."""
    bubble: np.ndarray
    """``[...]`` idle share of the pipeline: 1 - sum(busy) / (P * makespan); 0 when nothing runs."""
    peak_inflight: np.ndarray
    """``[P]`` most micro-batches whose activations a stage holds at once (fixed by the schedule)."""
    peak_act_bytes: np.ndarray | None
    """``[..., P]`` peak activation bytes per stage (held micro-batches + the running op's transient), or
    None when no activation bytes were given."""
    fwd_start: np.ndarray | None = None
    """``[..., M, P]`` start of each forward (None unless ``keep_timeline``)."""
    fwd_end: np.ndarray | None = None
    """``[..., M, P]`` end of each forward."""
    bwd_start: np.ndarray | None = None
    """``[..., M, P]`` start of each backward op (its recompute runs first, then the backward proper)."""
    bwd_end: np.ndarray | None = None
    """``[..., M, P]`` end of each backward op."""


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
    schedule: str = "1f1b",
    act_bytes: np.ndarray | None = None,
    transient_bytes: np.ndarray | None = None,
    keep_timeline: bool = False,
) -> PipelineTimes:
    """Simulate one pipeline per batch item.

    ``fwd``, ``bwd``, ``recompute``: ``[..., M, P]`` seconds. ``p2p_fwd`` / ``p2p_bwd``: ``[..., M, P-1]``
    seconds to send the activation of boundary s -> s+1 forward / its gradient s+1 -> s backward (default:
    ``p2p_bwd = p2p_fwd``, which is 0 when not given). ``act_bytes``: ``[..., M, P]`` bytes a micro-batch
    keeps on a stage from its forward until its backward ends; ``transient_bytes``: ``[..., M, P]`` extra
    bytes only while its backward runs (the recomputed layer's full activations). Leading axes broadcast.
    """
    if schedule not in SCHEDULES:
        raise InputError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}",
                         source="schedule", field="schedule")
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    if fwd.ndim < 2:
        raise InputError(f"fwd must be [..., M, P], got shape {fwd.shape}", source="fwd", field="shape")
    num_mb, num_stages = fwd.shape[-2:]
    if num_mb < 1 or num_stages < 1:
        raise InputError(f"need at least one micro-batch and one stage, got M={num_mb}, P={num_stages}",
                         source="fwd", field="shape")
    rec = np.zeros((1, 1)) if recompute is None else np.asarray(recompute, dtype=np.float64)
    pf = np.zeros((1, max(num_stages - 1, 0))) if p2p_fwd is None else np.asarray(p2p_fwd, dtype=np.float64)
    pb = pf if p2p_bwd is None else np.asarray(p2p_bwd, dtype=np.float64)
    for name, arr, width in (("bwd", bwd, num_stages), ("recompute", rec, num_stages),
                             ("p2p_fwd", pf, num_stages - 1), ("p2p_bwd", pb, num_stages - 1)):
        if arr.ndim < 2 or arr.shape[-1] not in (width, 1) or arr.shape[-2] not in (num_mb, 1):
            raise InputError(f"expected [..., {num_mb}, {width}], got {arr.shape}", source=name, field="shape")
    for name, arr in (("fwd", fwd), ("bwd", bwd), ("recompute", rec), ("p2p_fwd", pf), ("p2p_bwd", pb)):
        if arr.size and not (np.all(np.isfinite(arr)) and arr.min() >= 0):
            raise InputError("durations must be finite and >= 0", source=name, field="value")

    batch_shape = np.broadcast_shapes(fwd.shape[:-2], bwd.shape[:-2], rec.shape[:-2], pf.shape[:-2], pb.shape[:-2])
    full = batch_shape + (num_mb, num_stages)
    link = batch_shape + (num_mb, max(num_stages - 1, 0))
    F = _front(np.broadcast_to(fwd, full))
    Bt = _front(np.broadcast_to(bwd, full) + np.broadcast_to(rec, full))  # a backward op = recompute + backward
    PF = _front(np.broadcast_to(pf, link))
    PB = _front(np.broadcast_to(pb, link))

    fs = np.empty_like(F)
    fe = np.empty_like(F)
    bs = np.empty_like(F)
    be = np.empty_like(F)
    stage_free = [np.zeros(batch_shape) for _ in range(num_stages)]
    last = num_stages - 1
    for s, kind, m in global_op_order(schedule, num_stages, num_mb):
        if kind == FWD:
            start = stage_free[s] if s == 0 else np.maximum(stage_free[s], fe[m, s - 1] + PF[m, s - 1])
            fs[m, s] = start
            fe[m, s] = start + F[m, s]
            stage_free[s] = fe[m, s]
        else:
            start = stage_free[s] if s == last else np.maximum(stage_free[s], be[m, s + 1] + PB[m, s])
            bs[m, s] = start
            be[m, s] = start + Bt[m, s]
            stage_free[s] = be[m, s]

    stage_end = np.stack(stage_free, axis=-1)
    makespan = stage_end.max(axis=-1)
    busy = _back(F).sum(axis=-2) + _back(Bt).sum(axis=-2)
    with np.errstate(invalid="ignore", divide="ignore"):
        bubble = np.where(makespan > 0, 1.0 - busy.sum(axis=-1) / (num_stages * makespan), 0.0)

    peak_act = None
    if act_bytes is not None or transient_bytes is not None:
        act = _front(np.broadcast_to(np.asarray(0.0 if act_bytes is None else act_bytes, np.float64), full))
        trans = None if transient_bytes is None else _front(
            np.broadcast_to(np.asarray(transient_bytes, np.float64), full))
        peaks = []
        for s, mask in enumerate(inflight_masks(schedule, num_stages, num_mb)):
            held = np.tensordot(mask, act[:, s], axes=(1, 0))  # [K, ...]
            if trans is not None:
                ops = stage_op_order(schedule, num_stages, num_mb, s)
                rows = [k for k, (kind, _) in enumerate(ops) if kind == BWD]
                held[rows] += trans[[ops[k][1] for k in rows], s]
            peaks.append(held.max(axis=0))
        peak_act = np.stack(peaks, axis=-1)

    timeline = {}
    if keep_timeline:
        timeline = dict(fwd_start=_back(fs), fwd_end=_back(fe), bwd_start=_back(bs), bwd_end=_back(be))
    return PipelineTimes(
        schedule=schedule, stage_end=stage_end, makespan=makespan, busy=busy, bubble=bubble,
        peak_inflight=peak_inflight(schedule, num_stages, num_mb), peak_act_bytes=peak_act, **timeline,
    )
