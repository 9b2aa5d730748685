"""run_simulate_job: omnibal simulate as a library call."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from omnibal.errors import InputError
from omnibal.jobs.simulate import SimulateJobConfig, resolve_cluster, run_simulate_job
from omnibal.layout import PartialLayout
from omnibal.plan.plan import measured_plan

TINY = dict(model="tiny", hardware="a100-80g", samples=3000,
            layout=PartialLayout(dp_size=2, pp_size=2, num_microbatches=4))


def test_result_is_serialisable_and_matches_the_files(tmp_path):
    lines = []
    result = run_simulate_job(SimulateJobConfig(**TINY, out=str(tmp_path / "r")), log=lines.append)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["header"]["dp x pp x tp"] == "2 x 2 x 1" and data["summary"]["num_steps"] > 0
    assert data["totals"][0] == ["quantity", "value"] and len(data["stages"]) == 3  # header + 2 stages
    assert set(data["files"]) == {"markdown", "json", "timeline", "load"}
    assert json.loads((tmp_path / "r" / "simulate.json").read_text())  # written
    assert any(line.startswith("simulating") for line in lines)


def test_no_out_writes_nothing(tmp_path):
    result = run_simulate_job(SimulateJobConfig(**TINY, out=None))
    assert result.files == {} and not list(tmp_path.iterdir())


def test_explicit_settings_win_the_plan_fills_the_rest_and_a_contradiction_is_refused():
    plan = measured_plan(model="tiny", layer_names=[f"l{i}" for i in range(10)], parts=(0, 5, 10),
                         stage_times_s=[1.0, 1.0], num_samples=100, num_microbatches=8, dp_size=4)
    plan = replace(plan, inputs=replace(plan.inputs, hardware="h100"))
    cluster = resolve_cluster(SimulateJobConfig(layout=PartialLayout(dp_size=2)), plan)
    assert (cluster["dp_size"], cluster["pp_size"], cluster["hardware"], cluster["num_microbatches"]) == \
        (2, 2, "h100", 8)
    cluster = resolve_cluster(SimulateJobConfig(model="tiny", layout=PartialLayout(tp_size=2)), None)
    assert {k: cluster[k] for k in ("dp_size", "pp_size", "tp_size", "zero_stage", "num_microbatches")} == {
        "dp_size": 1, "pp_size": 1, "tp_size": 2, "zero_stage": 1, "num_microbatches": 4}  # SIMULATE_LAYOUT
    with pytest.raises(InputError, match="nothing to simulate: give --plan FILE .* or --model NAME"):
        resolve_cluster(SimulateJobConfig(), None)  # no default job: the 26B preset on one GPU cannot run
    with pytest.raises(InputError, match=r"--pp: field .pp_size.: 4 contradicts the plan.s 2 \(plan\)"):
        resolve_cluster(SimulateJobConfig(layout=PartialLayout(pp_size=4)), plan)
    with pytest.raises(InputError, match="--dp: field 'dp_size': must be a positive integer, got 0"):
        resolve_cluster(SimulateJobConfig(layout=PartialLayout(dp_size=0)), None)
    with pytest.raises(InputError, match="field 'model': other contradicts the plan's tiny") as err:
        resolve_cluster(SimulateJobConfig(model="other"), plan)
    assert err.value.source is None  # the job knows the field; the command line names it by its flag


def test_the_command_line_names_a_contradicting_model_by_its_flag(tmp_path, capsys):
    from omnibal.cli import main

    plan = measured_plan(model="tiny", layer_names=[f"l{i}" for i in range(10)], parts=(0, 5, 10),
                         stage_times_s=[1.0, 1.0], num_samples=100, num_microbatches=8, dp_size=4)
    path = plan.save(tmp_path / "plan.json")
    assert main(["simulate", "--plan", str(path), "--model", "internvl2-8b", "--no-report"]) == 2
    err = capsys.readouterr().err
    assert f"--model: field 'model': internvl2-8b contradicts the plan's tiny ({path})" in err
