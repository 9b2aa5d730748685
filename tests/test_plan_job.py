"""`omnibal plan` end to end on the tiny preset (seconds, not the 1.2M default), its outputs and errors."""

import json

import numpy as np
import pytest

from omnibal.cli import main
from omnibal.cost.presets import get_model_preset
from omnibal.errors import InputError
from omnibal.jobs.plan_config import PlanJobConfig
from omnibal.jobs.plan_job import run_plan_job
from omnibal.jobs.plan_report import render_report, write_job_outputs
from omnibal.layout import Layout
from omnibal.plan.ablation import ROW_NAMES
from omnibal.plan.partition import vision_first_partition
from omnibal.plan.plan import Plan
from omnibal.plan.search import SearchConfig

TINY = ["--model", "tiny", "--gpus", "4", "--pp", "2", "--microbatches", "4", "--samples", "3000",
        "--search-steps", "16", "--top-k", "3", "--quiet"]


def tiny_config(**kw) -> PlanJobConfig:
    base = dict(preset="tiny", num_gpus=4, layout=Layout(dp_size=2, pp_size=2, num_microbatches=4), num_samples=3000,
                search=SearchConfig(radius=1, top_k=3, sample_steps=16))
    base.update(kw)
    return PlanJobConfig(**base)


@pytest.fixture(scope="module")
def tiny_result():
    return run_plan_job(tiny_config(memory_budget_gib=None))


def test_job_produces_the_four_ablation_rows_and_a_fitting_plan(tiny_result):
    res = tiny_result
    assert tuple(r.name for r in res.ablation) == ROW_NAMES + ("+ selective recompute",)
    base, data, part, memory, selective = res.ablation
    assert selective.gpu_days <= memory.gpu_days * (1 + 1e-9)
    assert base.speedup == 1.0 and base.paper_gpu_days is None  # the paper ran InternVL-Chat-1.5, not tiny
    # the baseline and the two middle rows checkpoint every layer that frees memory; the plan fewer or equal
    assert base.num_checkpointed == data.num_checkpointed == part.num_checkpointed > 0
    assert memory.num_checkpointed <= part.num_checkpointed
    assert not selective.oom and res.plan.prediction.gpu_days == pytest.approx(selective.gpu_days)
    budget = res.plan.inputs.memory_budget_bytes
    for st in res.plan.stages:
        assert st.memory_bytes <= budget and st.simulated_peak_memory_bytes <= budget
    assert res.plan.inputs.layout.num_gpus == 4 and res.plan.data.settings["caps"]["tiles"] >= 1
    assert res.balance_metrics["balanced"]["coverage_ok"]
    # the scored candidates include the exact joint optimum and the plan is the fastest scored one
    scored = res.plan.search["candidates"]
    assert any(c["parts"] == res.plan.search["anchor_parts"] for c in scored)
    fitting = [c["sim_step_time_s"] for c in scored if not c["oom"]]
    assert min(fitting) == pytest.approx(
        next(c["sim_step_time_s"] for c in scored if c["parts"] == list(res.plan.parts)))


def test_outputs_round_trip_and_the_trainer_accepts_the_plan(tiny_result, tmp_path):
    files = write_job_outputs(tiny_result, tmp_path)
    for key in ("plan", "report", "ablation", "png:ablation", "png:stages"):
        assert files[key].is_file() and files[key].stat().st_size > 0
    assert files["ablation"].name == "ablation.json"
    assert sum(1 for k in files if k.startswith("png:timeline:")) == 5
    plan = Plan.load(tmp_path / "plan.json")
    assert plan == tiny_result.plan
    md = (tmp_path / "report.md").read_text()
    assert "## Ablation" in md and "61.8" not in md and "timeline_3" in md
    from omnibal.cost.presets import get_model_preset
    from omnibal.train.stage_layout import load_plan_layout

    names = [layer.name for layer in get_model_preset("tiny").layers()]
    layout = load_plan_layout(tmp_path / "plan.json", names, pp_size=2, model_name="tiny")
    assert [list(r) for r in layout.ranges] == [list(st.layers) for st in plan.stages]
    assert [list(r) for r in layout.recompute] == [list(st.recompute) for st in plan.stages]
    # omnibal report re-renders from the files alone
    (tmp_path / "report.md").unlink()
    out = render_report(tmp_path / "plan.json")
    assert out["report"].is_file() and "## Stages" in out["report"].read_text()


def test_tight_budget_forces_recompute_and_too_tight_names_the_smallest(tiny_result):
    peaks = [st.memory_bytes for st in tiny_result.plan.stages]
    from omnibal.plan.joint import JointPlanner
    from omnibal.plan.stages import StageModelConfig, layer_quantities

    cfg = StageModelConfig(num_stages=2, num_microbatches=4, dp_size=2)
    q = layer_quantities(tiny_result.table, tiny_result.features["balanced"], cfg)
    smallest = JointPlanner(q, cfg).min_memory_partition().bottleneck
    assert smallest < max(peaks)
    budget = (smallest + 0.5 * (max(peaks) - smallest)) / 2**30
    tight = run_plan_job(tiny_config(memory_budget_gib=budget))
    rows = {r.name: r for r in tight.ablation}
    adaptive, selective = rows["+ adaptive recompute"], rows["+ selective recompute"]
    assert adaptive.num_checkpointed > 0 and adaptive.num_selective == 0 and not adaptive.oom
    assert selective.num_selective > 0 and not selective.oom  # blocks trade whole recompute for selective
    assert selective.step_time_s <= adaptive.step_time_s * (1 + 1e-9)
    st = tight.plan.stages
    assert {m for s in st for m in s.selective} and not {m for s in st for m in s.selective} & {m for s in st
                                                                                                 for m in s.recompute}
    whole = run_plan_job(tiny_config(memory_budget_gib=budget, selective=False))
    assert "+ selective recompute" not in [r.name for r in whole.ablation]
    assert not any(s.selective for s in whole.plan.stages)
    with pytest.raises(InputError, match="deepspeed.*selective|selective.*DeepSpeed"):
        tiny_config(engine="deepspeed", selective=True).validate()
    with pytest.raises(InputError, match=r"smallest budget that fits is .* stage \d") as exc:
        run_plan_job(tiny_config(memory_budget_gib=0.9 * smallest / 2**30))
    assert exc.value.field == "memory_budget_bytes"


def test_vision_first_split_puts_the_encoder_on_stage_zero():
    kinds = ("vision_embed",) + ("vision_block",) * 4 + ("projector", "llm_embed") + ("llm_block",) * 6 + ("lm_head",)
    assert vision_first_partition(kinds, 3) == (0, 6, 10, 14)
    assert vision_first_partition(kinds, 1) == (0, 14)


@pytest.mark.parametrize("argv,match", [
    (["--gpus", "128", "--dp", "16", "--pp", "4"], "does not match the 128 devices"),
    (["--gpus", "130", "--pp", "4"], "not a multiple of 4"),
    (["--model", "nope"], "unknown model preset 'nope'"),
    (["--hardware", "tpu"], "unknown hardware 'tpu'"),
    (["--model", "tiny", "--gpus", "64", "--pp", "64"], f"only {len(get_model_preset('tiny').layers())} layers"),
    (["--memory-budget", "10"], "alone need at least .* GiB"),
    (["--stats", "/nonexistent/stats.jsonl"], "nonexistent"),
])
def test_bad_arguments_are_clear_errors_with_exit_code_2(argv, match, capsys, tmp_path):
    code = main(["plan", "--quiet", "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    import re

    assert re.search(match, err), err


def test_cli_end_to_end_on_tiny(capsys, tmp_path):
    # one chunk per stage: DeepSpeed's export (an interleaved plan has none: tests/test_engine_interleaved.py)
    assert main(["plan", *TINY, "--chunks", "1", "--out", str(tmp_path / "o"), "--no-timelines"]) == 0
    out = capsys.readouterr().out
    assert "+ adaptive recompute" in out and "DeepSpeed parts" in out and "wrote" in out
    doc = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert doc["format"] == "omnibal.plan"
    assert doc["exports"]["deepspeed"]["parts"][-1] == len(get_model_preset("tiny").layers())
    assert main(["report", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "report.md").is_file()
    np.testing.assert_equal(len(doc["stages"]), 2)
