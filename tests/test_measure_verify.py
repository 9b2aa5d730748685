"""``omnibal plan --verify K`` (``omnibal.measure.verify``): refused where the trainer cannot run the model;
on the tiny preset the top-K candidates run in the reference trainer (gloo, CPU) and the plan takes the
fastest measured one, with predicted vs measured per candidate in the plan JSON."""

from __future__ import annotations

import contextlib
import io
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from omnibal.cli import main
from omnibal.errors import InputError
from omnibal.jobs.plan_config import PLAN_LAYOUT, PlanJobConfig
from omnibal.jobs.plan_job import run_plan_job
from omnibal.layout import Layout
from omnibal.measure.hardware import hardware_by_name
from omnibal.measure.verify import VerifyConfig, check_verifiable, top_candidates, verify_plan
from omnibal.plan.plan import Plan
from omnibal.plan.search import SearchConfig
from omnibal.stats.table import SampleStats

ROOT = Path(__file__).resolve().parents[1]
TINY_PROFILE = ROOT / "benchmarks" / "results" / "profile_tiny_cpu.json"


@pytest.mark.parametrize("change, field", [
    (dict(preset="internvl-chat-1.5"), "preset"), (dict(hardware="a100-80g"), "hardware"),
    (dict(layout=replace(PLAN_LAYOUT, dp_size=1, pp_size=2, tp_size=2)), "tp_size"),
    (dict(hf_model="/some/checkpoint"), "verify")])
def test_verify_is_refused_where_the_trainer_cannot_measure_the_plan(change, field):
    config = PlanJobConfig(**{"preset": "tiny", "hardware": "cpu", "layout": replace(PLAN_LAYOUT, dp_size=1, pp_size=2),
                              **change})
    with pytest.raises(InputError) as exc:
        check_verifiable(config, device="cpu")
    assert exc.value.field == field


def test_cli_refuses_verify_for_a_large_model_before_planning(tmp_path):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", "--model", "llava-1.5-7b", "--verify", "2", "--quiet", "--out", str(tmp_path / "x")]) == 2
    assert "--verify" in err.getvalue() and "tiny" in err.getvalue()


def test_verify_never_starts_more_local_ranks_than_cores(monkeypatch, capsys, tmp_path):
    """``plan --verify 2 --model tiny --hardware cpu`` (what its own messages asked for) started the default
    layout's 128 ranks on a 2-core machine (21 of 23 GB, load ~200). It is refused, naming both numbers, in a
    second and before any planning."""
    import time

    from omnibal.measure import verify

    cores = verify.usable_cpus()
    t0 = time.monotonic()
    assert main(["plan", "--verify", "2", "--model", "tiny", "--hardware", "cpu", "--quiet", "--out",
                 str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - t0 < 30
    assert "the plan's 128 ranks" in err and f"this machine has {cores}" in err and "--gpus" in err, err
    assert "--preset" not in err
    monkeypatch.setattr(verify, "usable_cpus", lambda: 1)
    config = PlanJobConfig(preset="tiny", hardware="cpu", layout=replace(PLAN_LAYOUT, dp_size=1, pp_size=2))
    with pytest.raises(InputError) as exc:
        check_verifiable(config, device="cpu")
    assert exc.value.field == "num_gpus" and "2 ranks" in exc.value.message
    check_verifiable(config, device="cuda")  # one rank per device there: resolve_device counted the devices


def _stats(n: int = 240) -> SampleStats:
    rng = np.random.default_rng(1)
    tiles = rng.integers(1, 5, n)
    return SampleStats.from_arrays(tiles=tiles, tokens=tiles * 256 + rng.integers(20, 120, n), source="verify-test")


@pytest.mark.skipif(not TINY_PROFILE.is_file(), reason="no committed CPU profile of the tiny preset")
def test_verify_measures_top_k_candidates_and_chooses_the_fastest(tmp_path):
    # the caller resolves --hardware cpu (a measurement of this machine), as omnibal plan does
    config = PlanJobConfig(preset="tiny", hardware=hardware_by_name("cpu"), profile_path=str(TINY_PROFILE),
                           layout=Layout(dp_size=1, pp_size=2, num_microbatches=2), balance_samples=None,
                           search=SearchConfig(radius=2, top_k=4, sample_steps=8))
    result = run_plan_job(config, stats=_stats())
    assert len(top_candidates(result.scored, 2)) == 2
    plan, measured = verify_plan(result, VerifyConfig(top_k=2, steps=1, device="cpu"), config)
    assert len(measured) == 2 and all(m.measured_step_s > 0 and m.predicted_step_s > 0 for m in measured)
    fastest = min(range(2), key=lambda i: measured[i].normalised_step_s)
    assert all(m.slowdown >= 1.0 for m in measured)
    assert list(plan.parts) == list(measured[fastest].parts)
    back = Plan.load(plan.save(tmp_path / "plan.json"))
    verify = back.search["verify"]
    assert verify["chosen"] == fastest and verify["device"] == "cpu"
    assert [c["parts"] for c in verify["candidates"]] == [list(m.parts) for m in measured]
    assert all("predicted_step_s" in c and "measured_step_s" in c for c in verify["candidates"])
