"""Section 1 of the GPU check: forward and backward time of real layers against the analytic cost model.

Each :class:`~benchmarks.gpu.shapes.LayerCase` is timed with :func:`omnibal.measure.profile.measure_points`
(the reference model's real modules, CUDA events on a GPU) and fitted into a profile
(:func:`omnibal.cost.profile.fit_profile`). The analytic table of the model on the detected hardware preset
predicts every point; the efficiency factors are then fitted on the calibration case
(:func:`omnibal.cost.calibrate.calibrate_hardware`) and every case is predicted again: the held-out case
tells whether the fit carries over to a model it never saw.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.gpu.shapes import CheckShapes, LayerCase
from omnibal.cost.analytic import analytic_cost_table
from omnibal.cost.calibrate import calibrate_hardware, prediction_errors
from omnibal.cost.hardware import HardwareSpec
from omnibal.cost.profile import FORMAT, fit_profile, grid_points
from omnibal.measure.profile import measure_points


def _profile(case: LayerCase, rows: list[dict[str, Any]], shapes: CheckShapes) -> dict[str, Any]:
    """The measured rows as an ``omnibal profile`` document (what ``cost_table_from_profile`` reads)."""
    return {"format": FORMAT, "model": {"name": case.spec.name, "fingerprint": case.spec.fingerprint(),
                                        "spec": case.spec.to_dict()},
            "dtype": shapes.dtype, "warmup": shapes.warmup, "repeats": shapes.repeats, "statistic": "median",
            "grid": case.grid.to_dict(), "measurements": rows, "fit": fit_profile(rows)}


def _points(case: LayerCase, rows: list[dict[str, Any]], hardware: HardwareSpec, dtype: str) -> list[dict]:
    """Per measured point: measured and predicted forward / backward milliseconds."""
    table = analytic_cost_table(case.spec, hardware, dtype=dtype)
    kinds = list(table.kinds)
    out = []
    for r in rows:
        i = kinds.index(r["kind"])
        f = np.asarray(r["features"], dtype=np.float64)
        out.append({"kind": r["kind"], "tiles": r["tiles"], "tokens": r["tokens"], "segments": r["segments"],
                    "fwd_ms": r["fwd_s"] * 1e3, "bwd_ms": r["bwd_s"] * 1e3,
                    "fwd_pred_ms": float(f @ table.fwd_time[i]) * 1e3,
                    "bwd_pred_ms": float(f @ table.bwd_time[i]) * 1e3})
    return out


def _errors(case: LayerCase, rows, hardware: HardwareSpec, dtype: str) -> dict[str, dict[str, float]]:
    return prediction_errors(case.spec, analytic_cost_table(case.spec, hardware, dtype=dtype), rows)


def run_layer_costs(shapes: CheckShapes, hardware: HardwareSpec, log) -> dict[str, Any]:
    """Time every case, predict it before and after calibration; returns the section's result (the
    profiles included, one per case)."""
    measured: list[tuple[LayerCase, list[dict[str, Any]]]] = []
    for case in shapes.layers:
        points = grid_points(case.grid, case.spec, case.kinds)
        log(f"layer costs: {case.label}: {len(points)} shapes")
        rows = measure_points(case.spec, points, device=shapes.device, dtype=shapes.dtype,
                              warmup=shapes.warmup, repeats=shapes.repeats)
        measured.append((case, rows))
    calibrated = hardware
    fitted_on = [c for c, _ in measured if c.calibrate]
    if fitted_on:
        case, rows = next((c, r) for c, r in measured if c.calibrate)
        calibrated = calibrate_hardware(case.spec, hardware, {"measurements": rows, "dtype": shapes.dtype})
    cases = []
    for case, rows in measured:
        cases.append({"label": case.label, "model": case.spec.name, "calibrated_on": case.calibrate,
                      "points": _points(case, rows, hardware, shapes.dtype),
                      "errors_before": _errors(case, rows, hardware, shapes.dtype),
                      "errors_after": _errors(case, rows, calibrated, shapes.dtype),
                      "profile": _profile(case, rows, shapes)})
    return {"hardware": hardware.to_dict(), "calibrated": calibrated.to_dict(), "cases": cases}
