"""Fit the simulator's compute scales to measured per-rank step times (each rank's own compute).

On one device a step is the sum of its micro-batches' forward, recompute and backward times plus a fixed
overhead, so it is *linear* in a few scale factors of the cost table:

    step = sum_g a_g * (F_g + R_g) + b_g * B_g + c

where, per layer group g (vision, LLM), ``F_g``/``R_g``/``B_g`` are the table's forward / recompute /
backward seconds of the step's micro-batches, ``a_g``, ``b_g`` the fitted scales and ``c`` the per-step
overhead (optimizer step, data, launch). Runs with and without recomputation separate ``a`` from ``b``.
A run may also cover one pipeline stage's layers only (a rank's own CPU time in a pipeline run), which
separates the vision from the LLM scale. The fit is non-negative least squares over all steps of all
calibration runs; apply it to a table with
:meth:`Calibration.apply` and pass ``step_overhead`` to :class:`~omnibal.sim.costs.SimConfig`.
Pipeline and DP step times are *not* used here (they are a max, not a sum): they are what the calibrated
simulator is validated against. A DP run's per-rank times give :func:`rank_jitter`, the unpredicted
per-rank variation that makes the gradient sync wait for a straggler (``SimConfig.compute_jitter``).

Ranks that share one host (processes on the cores of one CPU, not one rank per GPU) compute slower than a
rank alone: their communication threads preempt them, and they share caches and memory bandwidth. Runs
flagged ``shared_host`` get one more factor, ``shared_host_scale``, fitted together with the rest when the
calibration holds both kinds of run (:meth:`Calibration.apply` with ``shared_host=True`` applies it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from omnibal.cost.table import NUM_FEATURES, LayerCostTable
from omnibal.errors import InputError

GROUPS: dict[str, tuple[str, ...]] = {
    "vision": ("vision_embed", "vision_block"),
    "llm": ("projector", "llm_embed", "llm_block", "lm_head"),
    "all": ("vision_embed", "vision_block", "projector", "llm_embed", "llm_block", "lm_head"),
}
"""Layer kinds of each group that gets its own forward and backward scale. Within one run the vision and
LLM work grow together with the micro-batch size, so separate group scales need calibration data where
their mix varies; ``("all",)`` (one scale) suits a measured profile that only needs an overall correction."""


@dataclass(frozen=True)
class CalibrationRun:
    """One measured single-process run."""

    features: np.ndarray
    """``[S, M, 4]`` features of each step's micro-batches (as the run computed them)."""
    recompute_mask: np.ndarray
    """``[L]`` layers the run checkpointed."""
    step_times: np.ndarray
    """``[S]`` measured seconds per step."""
    layers: tuple[int, int] | None = None
    """Layer range ``[start, stop)`` the times cover (one pipeline stage's own compute, e.g. a rank's CPU
    time in a pipeline run: it separates the stages' layer groups); None: the whole model."""
    shared_host: bool = False
    """Whether other ranks computed on the same host at the same time (several CPU ranks per machine)."""


@dataclass(frozen=True)
class Calibration:
    """Scales per layer group and the per-step overhead (see the module docstring)."""

    groups: tuple[str, ...]
    """Group names (keys of :data:`GROUPS`)."""
    fwd_scale: tuple[float, ...]
    """Forward (and recompute) time scale per group."""
    bwd_scale: tuple[float, ...]
    """Backward time scale per group."""
    step_overhead: float
    """Seconds per step outside the layers."""
    rel_rms_error: float
    """Root-mean-square relative error of the fit on the calibration steps."""
    num_steps: int
    """Calibration steps used."""
    shared_host_scale: float = 1.0
    """Extra compute time factor of a rank whose host also runs other ranks (1.0 when the calibration had
    no runs of both kinds to tell it)."""

    def apply(self, table: LayerCostTable, *, shared_host: bool = False) -> LayerCostTable:
        """``table`` with each group's forward/backward time coefficients scaled (and by
        ``shared_host_scale`` for a run whose ranks share hosts)."""
        fwd_mult, bwd_mult = np.ones(table.num_layers), np.ones(table.num_layers)
        for g, name in enumerate(self.groups):
            mask = _group_mask(table, name)
            fwd_mult[mask] = self.fwd_scale[g]
            bwd_mult[mask] = self.bwd_scale[g]
        if shared_host:
            fwd_mult, bwd_mult = fwd_mult * self.shared_host_scale, bwd_mult * self.shared_host_scale
        return replace(table, fwd_time=table.fwd_time * fwd_mult[:, None], bwd_time=table.bwd_time * bwd_mult[:, None],
                       sel_fwd_time=table.sel_fwd_time * fwd_mult[:, None])

    def to_dict(self) -> dict:
        return {"groups": list(self.groups), "fwd_scale": list(self.fwd_scale), "bwd_scale": list(self.bwd_scale),
                "step_overhead": self.step_overhead, "rel_rms_error": self.rel_rms_error,
                "num_steps": self.num_steps, "shared_host_scale": self.shared_host_scale}


def _group_mask(table: LayerCostTable, name: str) -> np.ndarray:
    if name not in GROUPS:
        raise InputError(f"unknown layer group {name!r}; known: {', '.join(GROUPS)}", source="groups", field="groups")
    return np.isin(np.asarray(table.kinds), GROUPS[name])


def design_matrix(table: LayerCostTable, run: CalibrationRun, groups: tuple[str, ...],
                  separate_backward: bool = True) -> np.ndarray:
    """``[S, 2 G + 1]`` columns: per group (forward + recompute) seconds, per group backward seconds, 1
    (``separate_backward=False``: ``[S, G + 1]``, per group forward + recompute + backward seconds, 1)."""
    feats = np.asarray(run.features, dtype=np.float64)
    if feats.ndim != 3 or feats.shape[-1] != NUM_FEATURES:
        raise InputError(f"features must be [steps, M, {NUM_FEATURES}], got {feats.shape}", source="calibration",
                         field="features")
    rec = np.asarray(run.recompute_mask, dtype=bool)
    if rec.shape != (table.num_layers,):
        raise InputError(f"recompute mask needs {table.num_layers} entries", source="calibration",
                         field="recompute_mask")
    step_feats = feats.sum(axis=1)  # every cost is linear: a step's sum is the cost of its summed features
    in_run = np.ones(table.num_layers, bool)
    if run.layers is not None:
        start, stop = run.layers
        if not 0 <= start < stop <= table.num_layers:
            raise InputError(f"layer range {run.layers} outside the {table.num_layers}-layer model",
                             source="calibration", field="layers")
        in_run[:] = False
        in_run[start:stop] = True
    cols_f, cols_b = [], []
    for name in groups:
        mask = _group_mask(table, name) & in_run
        fwd = table.fwd_time[mask].sum(axis=0) + table.fwd_time[mask & rec].sum(axis=0)
        cols_f.append(step_feats @ fwd)
        cols_b.append(step_feats @ table.bwd_time[mask].sum(axis=0))
    if not separate_backward:
        return np.stack([f + b for f, b in zip(cols_f, cols_b)] + [np.ones(len(step_feats))], axis=1)
    return np.stack(cols_f + cols_b + [np.ones(len(step_feats))], axis=1)


def nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 (active set: drop negative coefficients and refit until none is left)."""
    free = np.ones(a.shape[1], bool)
    x = np.zeros(a.shape[1])
    for _ in range(a.shape[1] + 1):
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        x[:] = 0.0
        x[free] = sol
        if (sol >= 0).all():
            return x
        free[np.flatnonzero(free)[sol < 0]] = False
    return np.maximum(x, 0.0)


def calibrate(table: LayerCostTable, runs: list[CalibrationRun], groups: tuple[str, ...] = ("vision", "llm"),
              weight_relative: bool = True, separate_backward: bool = False) -> Calibration:
    """Fit the group scales and the step overhead to the measured steps of ``runs``.

    ``weight_relative``: minimise relative rather than absolute errors (long and short steps count alike;
    weighted by the fitted prediction, not by the measurement, so noise does not bias the scales).
    By default one scale per group covers forward, recompute and backward together (keeps the table's
    backward/forward ratio). ``separate_backward=True`` fits forward and backward scales apart; it needs runs
    whose recompute share differs, and with few or noisy steps the fit degenerates (one scale of a group
    driven to 0, the other inflated), which is why it is not the default. When some runs are flagged
    ``shared_host`` and some are not, their extra factor is fitted too (``Calibration.shared_host_scale``).
    """
    if not runs:
        raise InputError("need at least one calibration run", source="calibration", field="runs")
    rows, ys, shared = [], [], []
    for k, run in enumerate(runs):
        y = np.asarray(run.step_times, dtype=np.float64)
        x = design_matrix(table, run, groups, separate_backward)
        if len(y) != len(x):
            raise InputError(f"{len(y)} step times for {len(x)} steps", source="calibration", record=k,
                             field="step_times")
        if (y <= 0).any() or not np.isfinite(y).all():
            raise InputError("step times must be positive", source="calibration", record=k, field="step_times")
        rows.append(x)
        ys.append(y)
        shared.append(np.full(len(y), bool(run.shared_host)))
    x, y, shared = np.concatenate(rows), np.concatenate(ys), np.concatenate(shared)
    fit_shared = bool(shared.any() and not shared.all())
    if len(y) < x.shape[1] + fit_shared:
        raise InputError(f"{len(y)} steps cannot fit {x.shape[1] + fit_shared} parameters", source="calibration",
                         field="runs")

    def weights(pred: np.ndarray) -> np.ndarray:
        # relative errors, weighted by the *prediction*: weights taken from the noisy measurements themselves
        # favour the fast steps and bias every scale low (-8% at 20% lognormal step-to-step noise, the size of
        # a shared CPU's)
        return 1.0 / np.maximum(pred, 1e-12 * y.mean()) if weight_relative else np.ones_like(y)

    def fit(kappa: float) -> tuple[np.ndarray, np.ndarray]:
        """Scales and overhead for a given shared-host factor, and the predictions."""
        factor = np.where(shared, kappa, 1.0)
        xs = np.concatenate([x[:, :-1] * factor[:, None], x[:, -1:]], axis=1)
        coef = nonneg_lstsq(xs, y)
        for _ in range(3 if weight_relative else 0):  # iteratively reweighted by the last fit's prediction
            w = weights(xs @ coef)
            coef = nonneg_lstsq(xs * w[:, None], y * w)
        return coef, xs @ coef

    def loss(log_kappa: float) -> float:
        pred = fit(np.exp(log_kappa))[1]
        return float(np.sum((weights(pred) * (pred - y)) ** 2))

    # step = kappa * (compute columns @ scales) + overhead with kappa = 1 for a rank alone: bilinear, so the
    # factor is searched over log kappa in [1/4, 4] with the linear fit inside
    kappa = float(np.exp(golden_section_min(loss, np.log(0.25), np.log(4.0)))) if fit_shared else 1.0
    coef, pred = fit(kappa)
    g = len(groups)
    bwd = coef[g:2 * g] if separate_backward else coef[:g]
    return Calibration(groups=tuple(groups), fwd_scale=tuple(float(c) for c in coef[:g]),
                       bwd_scale=tuple(float(c) for c in bwd), step_overhead=float(coef[-1]),
                       rel_rms_error=float(np.sqrt(np.mean(((pred - y) / y) ** 2))), num_steps=int(len(y)),
                       shared_host_scale=kappa)


def golden_section_min(f, lo: float, hi: float, tol: float = 1e-12) -> float:
    """The minimiser of a unimodal ``f`` on ``[lo, hi]`` (to ``tol``)."""
    ratio = (np.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = f(a), f(b)
    while hi - lo > tol:
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = f(b)
    return (lo + hi) / 2.0


def rank_jitter(table: LayerCostTable, features: np.ndarray, recompute_mask, step_times: np.ndarray,
                layers: tuple[int, int] | None = None) -> float:
    """Relative standard deviation of the per-rank variation the cost table does not predict, from a
    data-parallel run: ``features [S, D, M, 4]`` of each rank's micro-batches and ``step_times [S, D]``
    each rank's own time for them (e.g. its CPU seconds). Pass it as ``SimConfig.compute_jitter``.

    Per step, every rank's measured / predicted ratio is compared with the other ranks' of the same step,
    so what slows all ranks alike (machine speed drift, a mis-scaled table) cancels; what remains is what
    makes one rank the straggler."""
    feats = np.asarray(features, dtype=np.float64)
    times = np.asarray(step_times, dtype=np.float64)
    if feats.ndim != 4 or feats.shape[-1] != NUM_FEATURES:
        raise InputError(f"features must be [steps, dp, M, {NUM_FEATURES}], got {feats.shape}",
                         source="calibration", field="features")
    if times.shape != feats.shape[:2]:
        raise InputError(f"step_times must be [steps, dp] = {feats.shape[:2]}, got {times.shape}",
                         source="calibration", field="step_times")
    if feats.shape[1] < 2:
        raise InputError("rank jitter needs a run with at least 2 DP ranks", source="calibration", field="features")
    if (times <= 0).any() or not np.isfinite(times).all():
        raise InputError("step times must be positive", source="calibration", field="step_times")
    rec = np.asarray(recompute_mask, dtype=bool)
    pred = np.stack([design_matrix(table, CalibrationRun(feats[:, d], rec, times[:, d], layers=layers), ("all",),
                                   separate_backward=False)[:, 0] for d in range(feats.shape[1])], axis=1)
    ratio = times / np.maximum(pred, 1e-12)
    ratio = ratio / ratio.mean(axis=1, keepdims=True)  # per step: what all ranks share cancels
    return float(np.sqrt(ratio.var(axis=1, ddof=1).mean()))
