"""Calibrate the analytic model's efficiency factors against measured layer timings.

Each measured pass of a layer is modelled as (see :mod:`omnibal.cost.analytic`)

    t = F_matmul / (peak * eff_matmul) + F_attention / (peak * eff_attention)
        + B_memory / (bandwidth * eff_memory) + layer_overhead_s

(backward: 2x, 2.5x, 2x and 2x of the same terms), which is linear in
``x = (1/eff_matmul, 1/eff_attention, 1/eff_memory, layer_overhead_s)``. A non-negative least-squares fit of
``x`` over all forward and backward measurements of a profile (relative residuals) gives the calibrated
:class:`HardwareSpec`. A term whose work never appears in the measurements (or is fitted to zero) keeps the
hardware's previous factor. Calibration and validation must use different runs (docs/cost.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from omnibal.cost.analytic import BWD_FACTOR, layer_work
from omnibal.cost.fit import nnls, relative_errors
from omnibal.cost.hardware import HardwareSpec
from omnibal.cost.spec import ModelSpec


def _design(spec: ModelSpec, hardware: HardwareSpec, rows: list[dict[str, Any]], dtype: str
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Design matrix, measured seconds and each row's layer count in the chain."""
    work = layer_work(spec, dtype=dtype)
    kinds = [layer.kind for layer in spec.layers()]
    first = {kind: kinds.index(kind) for kind in set(kinds)}
    peak = hardware.peak_flops(dtype)
    design, target, count = [], [], []
    for row in rows:
        i = first[row["kind"]]
        f = np.asarray(row["features"], dtype=np.float64)
        terms = np.array([work.matmul_flops[i] @ f / peak, work.attention_flops[i] @ f / peak,
                          work.memory_bytes[i] @ f / hardware.memory_bandwidth, 1.0])
        design.append(terms)
        target.append(row["fwd_s"])
        count.append(kinds.count(row["kind"]))
        if work.trainable[i] and row["bwd_s"] > 0:
            design.append(terms * np.array([BWD_FACTOR["matmul"], BWD_FACTOR["attention"], BWD_FACTOR["memory"], 2.0]))
            target.append(row["bwd_s"])
            count.append(kinds.count(row["kind"]))
    return np.array(design), np.array(target), np.array(count, dtype=np.float64)


def calibrate_hardware(spec: ModelSpec, hardware: HardwareSpec, profile: dict[str, Any], *,
                       weight_by_layer_count: bool = True) -> HardwareSpec:
    """``hardware`` with ``eff_matmul``, ``eff_attention``, ``eff_memory`` and ``layer_overhead_s`` fitted to
    the profile's measurements (``profile["measurements"]`` rows, as written by ``omnibal profile``).

    Residuals are relative; with ``weight_by_layer_count`` each is also weighted by how many layers of its
    kind the model has, so the few factors fit best where the model spends its time: the whole-model error
    is what the plan pays for, not the mean over kinds."""
    design, target, count = _design(spec, hardware, profile["measurements"], profile["dtype"])
    weights = 1.0 / np.maximum(target, 1e-12)
    if weight_by_layer_count:
        weights = weights * count
    x = nnls(design * weights[:, None], target * weights)
    factors = {}
    for j, kind in enumerate(("matmul", "attention", "memory")):
        if x[j] > 0 and design[:, j].any():
            factors[kind] = float(1.0 / x[j])
    tuned = hardware.with_efficiency(**factors)

    return replace(tuned, layer_overhead_s=float(x[3]), name=f"{hardware.name}-calibrated")


def prediction_errors(spec: ModelSpec, table, rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per layer kind: signed relative errors of ``table``'s forward, backward and forward+backward times and
    activation bytes against measured ``rows``: mean |error|, max |error| and mean signed error (bias)."""
    kinds = list(table.kinds)
    out: dict[str, dict[str, float]] = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        sel = [r for r in rows if r["kind"] == kind]
        i = kinds.index(kind)
        feats = np.array([r["features"] for r in sel])
        fwd_m = np.array([r["fwd_s"] for r in sel])
        bwd_m = np.array([r["bwd_s"] for r in sel])
        fwd_p = feats @ table.fwd_time[i]
        bwd_p = feats @ table.bwd_time[i]
        entry: dict[str, float] = {"points": len(sel)}
        series = {"fwd": (fwd_p, fwd_m), "bwd": (bwd_p, bwd_m), "step": (fwd_p + bwd_p, fwd_m + bwd_m)}
        saved = np.array([r.get("saved_bytes", 0) for r in sel], dtype=np.float64)
        if saved.any():
            series["act"] = (feats @ table.act_bytes[i], saved)
        for name, (pred, meas) in series.items():
            if not np.any(meas > 0):
                continue
            err = relative_errors(pred, meas)
            entry[f"{name}_mean_abs"] = float(np.abs(err).mean())
            entry[f"{name}_max_abs"] = float(np.abs(err).max())
            entry[f"{name}_bias"] = float(err.mean())
        out[kind] = entry
    return out
