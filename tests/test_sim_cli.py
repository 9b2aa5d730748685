"""`omnibal simulate` end to end on small inputs (synthetic mixture, a few thousand samples)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omnibal.cli import main

BASE = ["simulate", "--model", "tiny", "--hardware", "a100-80g", "--samples", "3000", "--quiet"]


def test_simulate_writes_tables_and_report(tmp_path, capsys):
    out = tmp_path / "rep"
    code = main(BASE + ["--dp", "2", "--pp", "2", "--microbatches", "4", "--recompute", "3,0", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "GPU days" in text and "bubble" in text and "peak GiB" in text
    for name in ("simulate.md", "simulate.json", "simulate_timeline.png", "simulate_load.png"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "simulate.json").read_text())
    assert summary["num_gpus"] == 4 and summary["pp_size"] == 2
    assert summary["recompute_layers"] == [0, 1, 2]
    assert summary["inputs"]["model"] == "tiny"
    assert summary["gpu_days"] == pytest.approx(summary["total_time_s"] * 4 / 86400)
    assert len(summary["stages"]) == 2 and summary["stages"][0]["peak_inflight"] == 2


def test_explicit_partition_and_interleaved(tmp_path, capsys):
    code = main(BASE + ["--dp", "1", "--pp", "2", "--microbatches", "4", "--partition", "0,6", "--recompute", "none",
                        "--no-report"])
    assert code == 0
    assert " 0-5 " in capsys.readouterr().out
    code = main(BASE + ["--dp", "1", "--pp", "2", "--microbatches", "4", "--pp-schedule", "interleaved",
                        "--chunks", "2", "--recompute", "none", "--out", str(tmp_path / "il")])
    assert code == 0
    summary = json.loads((tmp_path / "il" / "simulate.json").read_text())
    assert summary["num_chunks"] == 2 and len(summary["stages"][0]["layers"]) == 2


def test_plan_file_sets_partition_and_recompute(tmp_path, capsys):
    from omnibal.cost.presets import get_model_preset
    from omnibal.layout import Layout
    from omnibal.plan.plan import DataPlan, Plan, PlanInputs, PlanStage, Prediction

    spec = get_model_preset("tiny")
    names = [layer.name for layer in spec.layers()]
    stages = tuple(PlanStage(stage=s, layers=(a, b), modules=tuple(names[a:b]), recompute=tuple(names[a:a + 1]),
                             in_flight=2 - s, compute_time_s=1.0, boundary_time_s=0.0, recompute_time_s=0.0,
                             memory_bytes=1.0) for s, (a, b) in enumerate(((0, 9), (9, len(names)))))
    plan = Plan(
        inputs=PlanInputs(model="tiny", model_spec={}, hardware="a100-80g",
                          layout=Layout(dp_size=1, pp_size=2, num_microbatches=4), memory_budget_bytes=None,
                          stats_source="x",
                          stats_fingerprint="", num_samples=3000, profile=None, omnibal_version="0"),
        data=DataPlan(method="omnibal", settings={}, num_steps=1), stages=stages,
        prediction=Prediction(step_time_s=1.0, epoch_time_s=1.0, gpu_days=0.0, bubble=0.0, num_steps=1))
    path = plan.save(tmp_path / "plan.json")
    out = tmp_path / "rep"
    assert main(["simulate", "--plan", str(path), "--samples", "3000", "--quiet", "--out", str(out)]) == 0
    summary = json.loads((out / "simulate.json").read_text())
    assert summary["cuts"] == [0, 9, len(names)]
    assert summary["recompute_layers"] == [0, 9]
    assert summary["pp_size"] == 2 and summary["dp_size"] == 1


@pytest.mark.parametrize("extra,needle", [
    (["--pp", "40"], "--pp"),
    (["--pp", "2", "--partition", "0,3,9"], "--partition"),
    (["--pp", "2", "--recompute", "1,99"], "--recompute"),
    (["--pp", "2", "--microbatches", "3", "--pp-schedule", "interleaved"], "num_microbatches"),
    (["--dp", "0"], "--dp"),
])
def test_bad_input_exits_2_naming_the_argument(extra, needle, capsys):
    assert main(BASE + ["--no-report"] + extra) == 2
    assert needle in capsys.readouterr().err


def test_schedule_file_must_match_the_cluster(tmp_path, capsys):
    from omnibal.cost.presets import get_model_preset
    from omnibal.data.balance import balance
    from omnibal.jobs.predict import job_stats

    stats, _ = job_stats(get_model_preset("tiny"), num_samples=3000)  # the rows simulate balances, tiny's units
    sched = balance(stats, dp_size=2, num_microbatches=4)
    path = tmp_path / "sched.json"
    sched.to_json(path)
    assert main(BASE + ["--model", "internvl-chat-1.5", "--dp", "4", "--microbatches", "4", "--schedule-file",
                        str(path), "--no-report"]) == 2
    assert "dp_size" in capsys.readouterr().err
    assert main(BASE + ["--dp", "2", "--pp", "2", "--microbatches", "4", "--schedule-file", str(path),
                        "--no-report"]) == 0
    days = [ln.split()[-1] for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("GPU days")]
    assert days and np.isfinite(float(days[0])) and float(days[0]) > 0


def test_a_multi_level_schedule_is_refused_by_name(tmp_path, capsys):
    from dataclasses import replace

    from omnibal.data.balance import balance
    from omnibal.stats.synthetic import synthetic_internvl_mixture

    sched = balance(synthetic_internvl_mixture(3000, seed=0), dp_size=2, num_microbatches=4)
    path = tmp_path / "hbp.json"
    replace(sched, levels=(0,) * sched.num_steps, level_sp=(1,)).to_json(path)  # one level, but HBP's form
    assert main(BASE + ["--model", "internvl-chat-1.5", "--dp", "2", "--microbatches", "4", "--schedule-file",
                        str(path), "--no-report"]) == 2
    err = capsys.readouterr().err
    assert "levels" in err and "omnibal plan --hbp" in err and "hbp.json" in err
    doc = json.loads(sched.to_json())
    del doc["caps"]  # a hand-made schedule the trainer takes; the simulator prices the balancer's
    path.write_text(json.dumps(doc))
    assert main(BASE + ["--model", "internvl-chat-1.5", "--dp", "2", "--microbatches", "4", "--schedule-file",
                        str(path), "--no-report"]) == 2
    err = capsys.readouterr().err
    assert "caps" in err and "omnibal balance" in err and "hbp.json" in err


def test_profile_from_another_model_is_refused(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": "omnibal-profile/1", "model": {"name": "other", "fingerprint": "x"},
                                "fit": {}, "dtype": "fp32", "measurements": []}))
    assert main(BASE + ["--profile", str(path), "--no-report"]) == 2
    assert "profile.json" in capsys.readouterr().err
