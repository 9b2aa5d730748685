"""An epoch of DP x PP steps from a cost table, a plan (cut points + recompute mask) and micro-batch features.

``simulate_epoch`` is the full result (per step, rank and stage); ``score_plan`` is the planner's fast path
(a few numbers per candidate); ``simulate_one_step`` keeps the op timeline of one step for the picture.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from omnibal.cost.table import NUM_FEATURES, RECOMPUTE_FULL, RECOMPUTE_SELECTIVE, LayerCostTable, recompute_codes
from omnibal.errors import InputError
from omnibal.sim.costs import SimConfig, StageCosts, stage_costs, validate_cuts
from omnibal.sim.pipeline_order import peak_inflight
from omnibal.sim.step import StepTimes, ring_allreduce_time, simulate_steps

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True, eq=False)
class EpochResult:
    """Simulated epoch. Axes: S steps, D DP ranks, P stages."""

    config: SimConfig
    """The cluster configuration simulated."""
    cuts: np.ndarray
    """``[V+1]`` partition cut points (V = P stages, or P * num_chunks virtual stages when interleaved)."""
    recompute_mask: np.ndarray
    """``[L]`` recompute codes of the layers (:func:`omnibal.cost.table.recompute_codes`)."""
    step_time: np.ndarray
    """``[S]`` seconds per step."""
    makespan: np.ndarray
    """``[S, D]`` pipeline makespan per rank (before the gradient sync)."""
    bubble: np.ndarray
    """``[S, D]`` pipeline bubble share per rank."""
    busy: np.ndarray
    """``[S, D, P]`` compute seconds per device."""
    sync_wait: np.ndarray
    """``[S, D, P]`` seconds a device waits for slower DP ranks before its gradient sync."""
    peak_memory: np.ndarray
    """``[S, D, P]`` peak bytes per device."""
    oom: np.ndarray | None
    """``[S, D, P]`` peak above the memory budget (None without a budget)."""
    allreduce_time: np.ndarray
    """``[P]`` gradient sync seconds per stage group."""
    static_bytes: np.ndarray
    """``[P]`` params + grads + optimizer bytes per device."""
    peak_inflight: np.ndarray
    """``[P]`` most micro-batches a stage holds at once."""
    epoch_scale: float = 1.0
    """Samples of the whole epoch per sample simulated: the steps stand for a uniform subset of the epoch
    (``omnibal plan --balance-samples``), and the epoch's steps, time and GPU days are scaled by it."""

    @property
    def num_stages(self) -> int:
        """Pipeline devices P (each holding ``config.num_chunks`` layer ranges)."""
        return (len(self.cuts) - 1) // self.config.num_chunks

    def stage_layers(self, stage: int) -> list[list[int]]:
        """Layer ranges ``[start, stop)`` of pipeline device ``stage`` (one per model chunk)."""
        p = self.num_stages
        return [[int(self.cuts[c * p + stage]), int(self.cuts[c * p + stage + 1])]
                for c in range(self.config.num_chunks)]

    @property
    def num_gpus(self) -> int:
        return self.config.dp_size * self.num_stages * self.config.tp_size

    @property
    def num_steps(self) -> int:
        """Steps of the whole epoch (the simulated steps times ``epoch_scale``)."""
        return int(round(len(self.step_time) * self.epoch_scale))

    @property
    def total_time(self) -> float:
        """Seconds for the whole epoch."""
        return float(self.step_time.sum()) * self.epoch_scale

    @property
    def gpu_days(self) -> float:
        return self.total_time * self.num_gpus / SECONDS_PER_DAY

    @property
    def idle(self) -> np.ndarray:
        """``[S, D, P]`` seconds per device not computing."""
        return self.step_time[:, None, None] - self.busy

    def summary(self) -> dict:
        """JSON-ready totals and per-stage means/peaks."""
        out = {
            "num_steps": self.num_steps,
            "simulated_steps": int(len(self.step_time)),
            "epoch_scale": self.epoch_scale,
            "dp_size": self.config.dp_size,
            "pp_size": self.num_stages,
            "tp_size": self.config.tp_size,
            "num_gpus": self.num_gpus,
            "pp_schedule": self.config.pp_schedule,
            "num_chunks": self.config.num_chunks,
            "total_time_s": self.total_time,
            "gpu_days": self.gpu_days,
            "step_time_mean_s": float(self.step_time.mean()) if len(self.step_time) else 0.0,
            "step_time_max_s": float(self.step_time.max()) if len(self.step_time) else 0.0,
            "bubble_mean": float(self.bubble.mean()) if self.bubble.size else 0.0,
            "cuts": self.cuts.tolist(),
            "recompute_layers": np.flatnonzero(self.recompute_mask == RECOMPUTE_FULL).tolist(),
            "selective_layers": np.flatnonzero(self.recompute_mask == RECOMPUTE_SELECTIVE).tolist(),
            "stages": [],
            "config": asdict(self.config),
        }
        for s in range(self.num_stages):
            out["stages"].append({
                "layers": self.stage_layers(s),
                "busy_mean_s": float(self.busy[..., s].mean()),
                "idle_mean_s": float(self.idle[..., s].mean()),
                "sync_wait_mean_s": float(self.sync_wait[..., s].mean()),
                "allreduce_s": float(self.allreduce_time[s]),
                "static_bytes": float(self.static_bytes[s]),
                "peak_memory_bytes": float(self.peak_memory[..., s].max()),
                "peak_inflight": int(self.peak_inflight[s]),
                "oom_steps": None if self.oom is None else int(self.oom[..., s].any(axis=-1).sum()),
            })
        out["oom_steps"] = None if self.oom is None else int(self.oom.any(axis=(1, 2)).sum())
        return out


def _check_features(features: np.ndarray, config: SimConfig) -> np.ndarray:
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 4 or features.shape[-1] != NUM_FEATURES:
        raise InputError(f"micro-batch features must be [num_steps, dp_size, M, {NUM_FEATURES}], got "
                         f"{features.shape}", source="features", field="shape")
    if features.shape[1] != config.dp_size:
        raise InputError(f"features have {features.shape[1]} DP ranks but dp_size is {config.dp_size}",
                         source="features", field="dp_size")
    if features.shape[2] < 1:
        raise InputError("need at least one micro-batch per step", source="features", field="num_microbatches")
    return features


def _check_cuts(cuts, table: LayerCostTable, config: SimConfig) -> np.ndarray:
    cuts = validate_cuts(cuts, table.num_layers)
    if (len(cuts) - 1) % config.num_chunks:
        raise InputError(f"{len(cuts) - 1} layer ranges do not split into {config.num_chunks} chunks per pipeline "
                         "device", source="partition", field="cuts")
    return cuts


def _run(table: LayerCostTable, cuts, recompute_mask, features: np.ndarray, config: SimConfig,
         keep_timeline: bool, buffer_features: np.ndarray | None = None) -> tuple[StageCosts, StepTimes]:
    costs = stage_costs(table, cuts, recompute_mask, features, config, buffer_features)
    v = config.num_chunks
    ar = ring_allreduce_time(costs.per_device(costs.grad_bytes, v), config.dp_size, config.dp_bandwidth,
                             config.dp_latency)
    steps = simulate_steps(
        costs.fwd, costs.bwd, costs.recompute, costs.p2p, costs.p2p, pp_schedule=config.pp_schedule, num_chunks=v,
        allreduce_time=ar, step_overhead=config.step_overhead, act_bytes=costs.act_bytes,
        transient_bytes=costs.transient_bytes, static_bytes=costs.per_device(costs.static_bytes, v),
        memory_budget=config.memory_budget_bytes, keep_timeline=keep_timeline, jitter=config.compute_jitter)
    return costs, steps


def simulate_epoch(
    table: LayerCostTable,
    cuts,
    recompute_mask,
    features: np.ndarray,
    config: SimConfig,
    *,
    buffer_features: np.ndarray | None = None,
    max_chunk_microbatches: int = 1 << 19,
    progress: bool = False,
    epoch_scale: float = 1.0,
) -> EpochResult:
    """Simulate every step of ``features [num_steps, dp_size, M, 4]``; steps are processed in chunks of at
    most ``max_chunk_microbatches`` micro-batches to bound memory (``progress``: a tqdm bar on stderr).
    ``buffer_features``: fixed-shape buffers a pipeline sends between stages (see ``stage_costs``).
    ``epoch_scale``: the features are a uniform subset of the epoch, this many times smaller
    (:attr:`EpochResult.epoch_scale`)."""
    config.validate()
    if not (np.isfinite(epoch_scale) and epoch_scale > 0):
        raise InputError(f"must be a finite number > 0, got {epoch_scale}", source="epoch_scale", field="epoch_scale")
    cuts = _check_cuts(cuts, table, config)
    rec = np.zeros(table.num_layers, np.int8) if recompute_mask is None else recompute_codes(recompute_mask)
    features = _check_features(features, config)
    num_steps, dp, num_mb, _ = features.shape
    chunk = max(1, max_chunk_microbatches // (dp * num_mb))
    starts = range(0, num_steps, chunk)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="simulate", unit="chunk", total=-(-num_steps // chunk), leave=False)
    if buffer_features is not None:
        buffer_features = np.broadcast_to(np.asarray(buffer_features, np.float64), features.shape)
    pieces: list[tuple[StageCosts, StepTimes]] = [
        _run(table, cuts, rec, features[i:i + chunk], config, False,
             None if buffer_features is None else buffer_features[i:i + chunk]) for i in starts]
    if not pieces:  # zero steps: an empty but well-formed result
        pieces = [_run(table, cuts, rec, np.zeros((0, dp, num_mb, NUM_FEATURES)), config, False)]
    cat = lambda get: np.concatenate([get(st) for _, st in pieces], axis=0)  # noqa: E731
    costs0, steps0 = pieces[0]
    v = config.num_chunks
    return EpochResult(
        config=config, cuts=cuts, recompute_mask=rec,
        step_time=cat(lambda st: st.step_time),
        makespan=cat(lambda st: st.pipeline.makespan),
        bubble=cat(lambda st: st.pipeline.bubble),
        busy=cat(lambda st: st.pipeline.busy),
        sync_wait=cat(lambda st: st.sync_wait),
        peak_memory=cat(lambda st: np.broadcast_to(st.peak_memory, st.pipeline.stage_end.shape)),
        oom=None if steps0.oom is None else cat(lambda st: st.oom),
        allreduce_time=steps0.allreduce_time,
        static_bytes=costs0.per_device(costs0.static_bytes, v),
        peak_inflight=peak_inflight(config.pp_schedule, (len(cuts) - 1) // v, num_mb, v),
        epoch_scale=float(epoch_scale),
    )


@dataclass(frozen=True)
class PlanScore:
    """What the planner needs to rank a candidate (partition, recompute)."""

    total_time: float
    """Epoch seconds."""
    step_time_mean: float
    """Mean seconds per step."""
    bubble_mean: float
    """Mean pipeline bubble share."""
    peak_memory: tuple[float, ...]
    """Per stage, the highest peak bytes over all steps and ranks."""
    oom: bool
    """Whether any device of any step exceeds the memory budget."""


def score_plan(table: LayerCostTable, cuts, recompute_mask, features: np.ndarray, config: SimConfig,
               buffer_features: np.ndarray | None = None) -> PlanScore:
    """Fast path for the planner: one candidate over an epoch's (or a sample of steps') features."""
    res = simulate_epoch(table, cuts, recompute_mask, features, config, buffer_features=buffer_features)
    peak = res.peak_memory.max(axis=(0, 1)) if len(res.step_time) else res.static_bytes
    return PlanScore(
        total_time=res.total_time,
        step_time_mean=float(res.step_time.mean()) if len(res.step_time) else 0.0,
        bubble_mean=float(res.bubble.mean()) if res.bubble.size else 0.0,
        peak_memory=tuple(float(x) for x in peak),
        oom=bool(res.oom.any()) if res.oom is not None else False,
    )


def simulate_one_step(table: LayerCostTable, cuts, recompute_mask, step_features: np.ndarray,
                      config: SimConfig, buffer_features: np.ndarray | None = None) -> tuple[StageCosts, StepTimes]:
    """One step ``[dp_size, M, 4]`` with the full op timeline (for the pipeline picture)."""
    config.validate()
    feats = _check_features(np.asarray(step_features, np.float64)[None], config)
    buf = None if buffer_features is None else np.asarray(buffer_features, np.float64)[None]
    return _run(table, _check_cuts(cuts, table, config), recompute_mask, feats, config, True, buf)
