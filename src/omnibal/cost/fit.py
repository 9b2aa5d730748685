"""Fitting measured layer costs: non-negative least squares over the cost features, and calibration of a
:class:`~omnibal.cost.hardware.HardwareSpec`'s efficiency factors against measurements.

The fits minimise *relative* residuals (rows weighted by 1/measured), so small shapes count as much as
large ones: a cost model used for balancing must be right for small and large micro-batches alike.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b||_2 subject to x >= 0, exactly, for the few columns used here (<= 8): the optimum
    is the unconstrained least-squares solution on some subset of columns (its support), so every subset
    is tried and the best feasible one kept."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    num_cols = a.shape[1]
    assert num_cols <= 8, "exhaustive NNLS is for a handful of columns"
    best_x = np.zeros(num_cols)
    best_res = float(np.sum(b * b))
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a_scaled = a / scale  # columns of very different magnitudes (1 vs tokens^2) stay well conditioned
    for size in range(1, num_cols + 1):
        for cols in itertools.combinations(range(num_cols), size):
            sol, *_ = np.linalg.lstsq(a_scaled[:, cols], b, rcond=None)
            if np.any(sol < 0):
                continue
            res = float(np.sum((a_scaled[:, cols] @ sol - b) ** 2))
            if res < best_res * (1 - 1e-12):
                best_res = res
                best_x = np.zeros(num_cols)
                best_x[list(cols)] = sol
    return best_x / scale


@dataclass(frozen=True)
class FitResult:
    coef: np.ndarray
    """``[num_features]`` non-negative coefficients (zeros for features not fitted)."""
    mean_rel_error: float
    """Mean of |predicted - measured| / measured over the fitted points."""
    max_rel_error: float
    """Largest relative error over the fitted points."""


def fit_linear(features: np.ndarray, values: np.ndarray, columns: tuple[int, ...], *,
               relative: bool = True) -> FitResult:
    """Fit ``values ~ features[:, columns] @ c`` with c >= 0; returns full-width coefficients."""
    features = np.asarray(features, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    weights = 1.0 / np.maximum(np.abs(values), 1e-30) if relative else np.ones_like(values)
    sub = nnls(features[:, columns] * weights[:, None], values * weights)
    coef = np.zeros(features.shape[1])
    coef[list(columns)] = sub
    pred = features @ coef
    rel = np.abs(pred - values) / np.maximum(np.abs(values), 1e-30)
    return FitResult(coef=coef, mean_rel_error=float(rel.mean()), max_rel_error=float(rel.max()))


def relative_errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Signed (predicted - measured) / measured."""
    measured = np.asarray(measured, dtype=np.float64)
    return (np.asarray(predicted, dtype=np.float64) - measured) / np.maximum(np.abs(measured), 1e-30)
