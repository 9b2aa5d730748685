import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal.cost.analytic import BWD_FACTOR, analytic_cost_table, layer_work
from omnibal.cost.calibrate import calibrate_hardware, prediction_errors
from omnibal.cost.fit import fit_linear, nnls
from omnibal.cost.hardware import get_hardware
from omnibal.cost.presets import get_model_preset
from omnibal.cost.profile import CPU_GRID, fit_profile, grid_points


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 12), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_nnls_satisfies_kkt(num_rows, num_cols, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(num_rows, num_cols))
    b = rng.normal(size=num_rows)
    x = nnls(a, b)
    assert (x >= 0).all()
    grad = a.T @ (a @ x - b)
    tol = 1e-7 * (1 + np.abs(a).sum() * (1 + np.abs(b).sum()))
    assert np.all(grad >= -tol)  # no descent direction into the feasible set
    assert np.all(np.abs(grad[x > 0]) <= tol)  # stationary on the support


def test_fit_linear_recovers_coefficients_of_very_different_scales():
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, 8000, size=30).astype(float)
    seg = rng.integers(50, 1000, size=30).astype(float)
    feats = np.stack([np.ones(30), np.zeros(30), tokens, tokens * seg], axis=1)
    true = np.array([2e-3, 0.0, 4e-5, 3e-9])
    res = fit_linear(feats, feats @ true, (0, 2, 3))
    assert np.allclose(res.coef, true, rtol=1e-6) and res.max_rel_error < 1e-9
    noisy = feats @ true * (1 + rng.normal(scale=0.01, size=30))
    res = fit_linear(feats, noisy, (0, 2, 3))
    assert res.mean_rel_error < 0.02 and np.allclose(res.coef[2], true[2], rtol=0.1)


def _synthetic_rows(spec, table, rng=None, noise=0.0):
    """Rows in the profile format whose times are exactly a cost table's predictions (times noise)."""
    rows = []
    kinds = list(table.kinds)
    for point in grid_points(CPU_GRID, spec, tuple(dict.fromkeys(kinds))):
        i = kinds.index(point.kind)
        f = point.features
        scale = (lambda: 1 + rng.normal(scale=noise)) if rng is not None else (lambda: 1.0)
        rows.append(dict(kind=point.kind, tiles=point.tiles, tokens=int(f[2]), features=f.tolist(),
                         fwd_s=float(f @ table.fwd_time[i]) * scale(), bwd_s=float(f @ table.bwd_time[i]) * scale(),
                         saved_bytes=float(f @ table.act_bytes[i])))
    return rows


def test_calibration_recovers_known_efficiencies():
    spec = get_model_preset("tiny")
    base = get_hardware("a100-80g")
    truth = base.with_efficiency(matmul=0.31, attention=0.12, memory=0.44)
    truth = type(truth)(**{**truth.to_dict(), "layer_overhead_s": 2e-4})
    rows = _synthetic_rows(spec, analytic_cost_table(spec, truth, dtype="fp32"))
    fitted = calibrate_hardware(spec, base, {"measurements": rows, "dtype": "fp32"})
    assert fitted.eff_matmul == pytest.approx(0.31, rel=1e-4)
    assert fitted.eff_attention == pytest.approx(0.12, rel=1e-4)
    assert fitted.eff_memory == pytest.approx(0.44, rel=1e-4)
    assert fitted.layer_overhead_s == pytest.approx(2e-4, rel=1e-4)
    errors = prediction_errors(spec, analytic_cost_table(spec, fitted, dtype="fp32"), rows)
    assert set(errors) == set(spec_kinds(spec))
    assert all(e["step_max_abs"] < 1e-6 for e in errors.values())


def spec_kinds(spec):
    return {layer.kind for layer in spec.layers()}


def test_fit_profile_recovers_table_and_reports_errors():
    spec = get_model_preset("tiny")
    table = analytic_cost_table(spec, get_hardware("h100"), dtype="fp32")
    rng = np.random.default_rng(1)
    fits = fit_profile(_synthetic_rows(spec, table, rng, noise=0.02))
    kinds = list(table.kinds)
    for kind, entry in fits.items():
        i = kinds.index(kind)
        assert entry["fwd_time"]["mean_rel_error"] < 0.05
        assert entry["act_bytes"]["max_rel_error"] < 1e-9
        assert np.allclose(entry["act_bytes"]["coef"], table.act_bytes[i], rtol=1e-6, atol=1e-6)
    block = kinds.index("llm_block")
    assert fits["llm_block"]["fwd_time"]["coef"][3] == pytest.approx(table.fwd_time[block][3], rel=0.2)


def test_backward_factors_are_documented_values():
    assert BWD_FACTOR == {"matmul": 2.0, "attention": 2.5, "memory": 2.0}
    work = layer_work(get_model_preset("tiny"))
    assert work.matmul_flops.shape == work.attention_flops.shape
