"""One prediction everywhere: ``omnibal simulate --plan`` predicts what ``omnibal plan`` predicted for that plan
(its pack, caps, balanced sample, budget, spec), the plan's report draws and tabulates each ablation row's own
schedule, and ``omnibal simulate`` asks for its inputs instead of simulating a job that cannot run."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from omnibal.cli import main
from omnibal.plan.plan import Plan

# the default job's code path (pack-size search, a balanced sample scaled to the epoch) on a smaller epoch
CHEAP = ["--samples", "48000", "--balance-samples", "24000", "--pack-microbatches", "8,24", "--search-steps", "32",
         "--top-k", "2", "--radius", "1"]


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _simulated(plan_path: Path, tmp_path: Path) -> tuple[dict, str]:
    """``omnibal simulate --plan`` of ``plan_path``: (its summary JSON, its stderr)."""
    out = tmp_path / "sim"
    code, _, err = _run(["simulate", "--plan", str(plan_path), "--out", str(out), "--quiet"])
    assert code == 0, err
    return json.loads((out / "simulate.json").read_text()), err


def _assert_same_prediction(plan: Plan, sim: dict) -> None:
    pred = plan.prediction
    assert sim["num_steps"] == pytest.approx(pred.num_steps, rel=0.01)
    assert sim["step_time_mean_s"] == pytest.approx(pred.step_time_s, rel=0.01)
    assert sim["gpu_days"] == pytest.approx(pred.gpu_days, rel=0.01)
    # per device (an interleaved plan's stages are its virtual stages; device d holds stages d, d + P, ...)
    assert [st["peak_memory_bytes"] for st in sim["stages"]] == pytest.approx(
        [st.simulated_peak_memory_bytes for st in plan.stages[:plan.inputs.layout.pp_size]], rel=0.01)
    assert sim["cuts"] == list(plan.parts) and not sim["oom_steps"]
    assert sim["inputs"]["micro-batches per step"] == plan.inputs.layout.num_microbatches
    caps = plan.data.settings["caps"]
    assert sim["inputs"]["caps (tiles, tokens)"] == f"{caps['tiles']}, {caps['tokens']}"


@pytest.fixture(scope="module")
def cheap_plan(tmp_path_factory):
    """The default job on a 48k-sample epoch, with every timeline the report draws captured:
    (plan folder, [(title, micro-batches per step drawn)])."""
    import omnibal.jobs.plan_report as report

    out = tmp_path_factory.mktemp("plan") / "out"
    drawn = []
    draw = report.plot_timeline

    def spy(costs, step, path, **kw):
        drawn.append((kw["title"], step.pipeline.fwd_start.shape[2]))  # [steps, D, M, V]
        return draw(costs, step, path, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report, "plot_timeline", spy)
        code, _, err = _run(["plan", *CHEAP, "--out", str(out), "--quiet"])
    assert code == 0, err
    return out, drawn


def test_simulate_reproduces_the_plans_prediction_with_a_searched_pack(cheap_plan, tmp_path):
    out, _ = cheap_plan
    plan = Plan.load(out / "plan.json")
    assert plan.inputs.layout.num_microbatches != 8  # the pack-size search chose another pack than the job's own
    sim, err = _simulated(out / "plan.json", tmp_path)
    _assert_same_prediction(plan, sim)
    assert "warning" not in err  # nothing departs from the plan


def test_timelines_and_balance_table_are_each_rows_own_schedule(cheap_plan):
    out, drawn = cheap_plan
    plan = Plan.load(out / "plan.json")
    rows = json.loads((out / "ablation.json").read_text())
    names = [r["name"] for r in rows["rows"]]
    # the cheap job interleaves (the default --chunks 1,2) after its pack-size row
    assert names[-2:] == ["+ pack size", "+ interleaved schedule"] and len(drawn) == len(names)
    assert plan.inputs.num_chunks == 2 and plan.pp_schedule == "interleaved"
    for name, (title, mbs) in zip(names, drawn):
        assert title.startswith(f"{name}:")
        assert mbs == (plan.inputs.layout.num_microbatches if name in names[-2:] else 8), name
    metrics = rows["balance_metrics"]
    assert list(metrics) == ["baseline", "balanced before pack search", "balanced"]
    assert metrics["balanced"]["num_microbatches"] == plan.inputs.layout.num_microbatches
    caps = plan.data.settings["caps"]
    assert (metrics["balanced"]["caps_tiles"], metrics["balanced"]["caps_tokens"]) == (caps["tiles"], caps["tokens"])
    assert metrics["balanced"] == plan.data.metrics
    report = (out / "report.md").read_text()
    assert f"| micro-batches per step | 8 | 8 | {plan.inputs.layout.num_microbatches} |" in report


def test_an_older_plan_still_simulates_and_names_what_it_lacks(cheap_plan, tmp_path):
    out, _ = cheap_plan
    raw = json.loads((out / "plan.json").read_text())
    for key in ("seed", "synthetic_stats", "convert_stats", "stats_path"):
        del raw["data"]["settings"][key]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(raw))
    sim, err = _simulated(old, tmp_path)
    _assert_same_prediction(Plan.load(old), sim)  # the defaults the older plans were made with
    assert "plan.json has no data.settings.seed, data.settings.synthetic_stats" in err
    raw["data"]["settings"]["config"]["pack_size"] = 3
    old.write_text(json.dumps(raw))
    code, _, err = _run(["simulate", "--plan", str(old), "--no-report", "--quiet"])
    assert code == 2 and "data.settings.config.pack_size" in err


def _llava_config(folder: Path) -> Path:
    """A LLaVA-1.5-7B-sized checkpoint's config.json alone (all ``omnibal plan --hf-model`` reads)."""
    tf = pytest.importorskip("transformers")
    vision = tf.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                 num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)
    text = tf.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=32, vocab_size=32064)
    tf.LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-2).save_pretrained(folder)
    return folder


def test_simulate_reproduces_an_hf_model_plan(tmp_path):
    model = _llava_config(tmp_path / "llava")
    out = tmp_path / "plan"
    code, _, err = _run(["plan", "--hf-model", str(model), "--gpus", "16", *CHEAP, "--out", str(out), "--quiet",
                         "--no-timelines"])
    assert code == 0, err
    plan = Plan.load(out / "plan.json")
    assert plan.inputs.model == "hf-llava"  # no preset of that name: simulate runs the plan's recorded spec
    sim, err = _simulated(out / "plan.json", tmp_path)
    _assert_same_prediction(plan, sim)
    assert "warning" not in err


@pytest.mark.slow
def test_simulate_reproduces_the_default_plan(tmp_path):
    """``omnibal plan`` with no arguments, then ``simulate --plan`` of its plan.json."""
    out = tmp_path / "omnibal-out"
    code, _, err = _run(["plan", "--out", str(out), "--quiet", "--no-timelines"])
    assert code == 0, err
    plan = Plan.load(out / "plan.json")
    sim, err = _simulated(out / "plan.json", tmp_path)
    _assert_same_prediction(plan, sim)
    assert "warning" not in err


def test_simulate_without_a_plan_or_a_model_asks_for_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(["simulate"])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--plan" in err and "--model" in err
    assert not (tmp_path / "simulate-report").exists()  # nothing simulated, nothing written


def test_a_job_that_runs_out_of_memory_on_every_step_exits_1_after_its_tables(tmp_path):
    code, out, err = _run(["simulate", "--model", "internvl-chat-1.5", "--samples", "2000", "--no-report",
                           "--quiet"])
    assert code == 1 and "GPU days" in out  # the tables still print
    assert "every simulated step runs out of memory" in err and "stage 0 peak" in err


def test_the_library_returns_an_out_of_memory_result_instead_of_raising():
    from omnibal.jobs.simulate import SimulateJobConfig, run_simulate_job

    result = run_simulate_job(SimulateJobConfig(model="internvl-chat-1.5", samples=2000, out=None))
    assert result.summary["oom_steps"] == result.summary["simulated_steps"] > 0
