"""HBP planner: the SP terms of the cost model, a small plan end to end, and ``omnibal plan --hbp``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omnibal.cli import main
from omnibal.cost.analytic import analytic_cost_table
from omnibal.cost.hardware import get_hardware
from omnibal.cost.presets import get_model_preset
from omnibal.errors import InputError
from omnibal.hbp.planning import HBPPlanConfig
from omnibal.hbp.sp_cost import max_tokens_per_rank, per_rank_features, ulysses_a2a_time
from omnibal.jobs.hbp import hbp_markdown, run_hbp_job
from omnibal.jobs.plan_config import PlanJobConfig
from omnibal.layout import Layout
from omnibal.plan.joint import JointPlanner
from omnibal.plan.stages import StageModelConfig, layer_quantities
from omnibal.stats.long_context import long_context_mixture

SMALL_JOB = dict(preset="internvl2-8b", layout=Layout(dp_size=8, pp_size=2, num_microbatches=2), balance_samples=None)


@pytest.fixture(scope="module")
def table_8b():
    spec, hw = get_model_preset("internvl2-8b"), get_hardware("a100-80g")
    return spec, hw, analytic_cost_table(spec, hw)


def test_ulysses_all_to_all_only_in_llm_blocks_and_grows_with_degree(table_8b):
    spec, hw, table = table_8b
    assert not ulysses_a2a_time(table, spec, hw, 1).any()
    per_token = [ulysses_a2a_time(table, spec, hw, d)[:, 2] for d in (2, 4, 8, 16)]
    blocks = np.asarray(table.kinds) == "llm_block"
    assert np.all(per_token[0][blocks] > 0) and not per_token[0][~blocks].any()
    assert per_token[0][blocks][0] < per_token[1][blocks][0] < per_token[2][blocks][0]
    assert per_token[3][blocks][0] > 3 * per_token[2][blocks][0]  # 16 ranks leave the node: slower link
    # 2 (2 hidden + 2 kv_dim) bf16 values per token, forward and backward, (d-1)/d of them sent
    bw, _ = hw.link(inter_node=False)
    expect = 2 * (2 * 4096 + 2 * 1024) * 2 * (1 / 2) / bw
    assert per_token[0][blocks][0] == pytest.approx(expect)


def test_per_rank_features_split_everything_but_the_fixed_term():
    feats = np.array([[1.0, 8.0, 4096.0, 4096.0**2]])
    assert per_rank_features(feats, 4).tolist() == [[1.0, 2.0, 1024.0, 4096.0**2 / 4]]


def test_max_tokens_per_rank_is_the_memory_edge(table_8b):
    _, _, table = table_8b
    config = StageModelConfig(num_stages=2, num_microbatches=2, dp_size=8, memory_budget_bytes=40 * 2**30)
    most = max_tokens_per_rank(table, config, tiles_per_token=0.002)

    def min_memory(tokens):
        feats = np.array([[1.0, tokens * 0.002, tokens, float(tokens) ** 2]])
        return JointPlanner(layer_quantities(table, feats, config), config).min_memory_partition().bottleneck

    assert min_memory(most) <= 40 * 2**30 < min_memory(most + 1)


@pytest.fixture(scope="module")
def small_plan():
    stats = long_context_mixture(3000, seed=4)
    return stats, run_hbp_job(PlanJobConfig(**SMALL_JOB), HBPPlanConfig(baseline_batch_size=1), stats)


def test_small_plan_covers_every_sample_once_and_is_serialisable(small_plan):
    stats, result = small_plan
    assert [r.name for r in result.rows] == ["baseline", "single level, naive packing", "levels, naive packing",
                                             "single level, full recompute", "single level", "hbp"]
    hbp = result.row("hbp")
    assert sum(lv.samples for lv in hbp.levels) == len(stats)
    assert np.all(result.schedule.sample_counts() == 1)
    lengths = [lv.length for lv in hbp.levels]
    assert lengths == sorted(lengths) and lengths[-1] >= stats.tokens.max()
    for row in result.rows:
        assert row.gpu_days > 0 and row.oom_steps == 0
        for lv in row.levels:
            assert lv.length <= result.model.max_tokens_per_rank * lv.sp or row.name == "baseline"
    assert hbp.gpu_days <= result.row("single level").gpu_days  # the simulator keeps the best level set
    assert len(result.tried) >= 1 and min(t["gpu_days"] for t in result.tried) == pytest.approx(hbp.gpu_days)
    json.dumps(result.to_dict())
    assert "| hbp |" in hbp_markdown(result)


def test_naive_packing_is_hbps_paper_recipe_and_the_ablation_follows_its_table(small_plan):
    """HBP's naive row: ISF packs at the longest level, the SP degree that fits (the fastest), the fewest
    checkpointed layers that fit; "+ hierarchical" packs HBP's own levels the same naive way."""
    stats, result = small_plan
    naive, recipe, hbp = (result.row(n) for n in ("single level, naive packing", "single level, full recompute", "hbp"))
    (lv,), (rl,) = naive.levels, recipe.levels
    assert lv.length == rl.length and lv.samples == len(stats) and naive.dropped == 0 and naive.oom_steps == 0
    assert lv.checkpointed < rl.checkpointed  # adaptive: not every layer, as full recompute does
    assert lv.sp in result.model.feasible_sp(lv.length)
    levels = result.row("levels, naive packing")
    assert [(x.length, x.sp) for x in levels.levels] == [(x.length, x.sp) for x in hbp.levels]
    assert sum(x.samples for x in levels.levels) == len(stats) and levels.oom_steps == 0
    # balanced packing beats naive packing of the same levels, and HBP beats the naive recipe
    assert naive.gpu_days > hbp.gpu_days and levels.gpu_days > hbp.gpu_days
    table = result.ablation()
    assert [t["step"] for t in table] == ["naive packing", "+ hierarchical", "+ balance"]
    assert table[0]["speedup"] == 1.0 and table[2]["speedup"] == pytest.approx(naive.gpu_days / hbp.gpu_days)
    assert result.to_dict()["ablation"] == table


def test_bound_on_the_long_mixture_lies_between_hbp_and_the_single_level(small_plan):
    stats, result = small_plan
    b = result.bound
    assert b.single_gpu_days == result.row("single level").gpu_days and b.hbp_gpu_days == result.row("hbp").gpu_days
    assert b.free_gpu_days < b.single_gpu_days  # the single level recomputes and sends all-to-alls here
    # a micro-batch count per level (the default) saves pipeline fill/drain and syncs that (a) keeps: only the
    # work floor (c) bounds it
    assert not b.same_microbatches and b.gain_limit == b.gain_floor >= b.gain_free
    assert b.gain_floor >= b.gain_amdahl >= b.hbp_gain >= 1.0
    assert 0 < b.long_share < 1 and b.long_length < stats.tokens.max()
    # the longest level at every SP degree dividing dp_size, memory ignored, and the single level's own packing
    assert len(b.free_trials) == 1 + len(result.model.sp_degrees)
    assert result.notes and "not tried" in result.notes[0]  # one rank cannot hold the 100k-token videos


def test_one_count_for_every_level_is_slower_and_under_the_free_single_level_bound(small_plan):
    stats, tokens = small_plan
    same = run_hbp_job(PlanJobConfig(**SMALL_JOB), HBPPlanConfig(baseline_batch_size=1, microbatches="same"), stats)
    b = same.bound
    assert b.same_microbatches and b.gain_limit == b.gain_free
    assert b.gain_free >= b.gain_amdahl >= b.hbp_gain >= 1.0
    assert all(lv.microbatches == SMALL_JOB["layout"].num_microbatches for lv in same.row("hbp").levels)
    counts = [lv.microbatches for lv in tokens.row("hbp").levels]
    assert max(counts) > SMALL_JOB["layout"].num_microbatches <= min(counts)
    # no level's step holds more tokens per rank than the single level's (up to one micro-batch's rounding)
    single = tokens.row("single level").levels[0]
    budget = SMALL_JOB["layout"].num_microbatches * single.length / single.sp
    for lv in tokens.row("hbp").levels:
        assert lv.microbatches * lv.length / lv.sp <= budget + lv.length / lv.sp / 2 or lv.microbatches == 2
    assert tokens.row("hbp").gpu_days < same.row("hbp").gpu_days
    assert same.row("single level").gpu_days == pytest.approx(tokens.row("single level").gpu_days)


def test_time_breakdown_adds_up_to_each_levels_simulated_time(small_plan):
    from omnibal.hbp.bound import BREAKDOWN_PARTS, time_breakdown
    from omnibal.jobs.hbp import hbp_context
    from omnibal.jobs.plan_phases import balance_subset

    stats, result = small_plan
    config = PlanJobConfig(**SMALL_JOB)
    balanced = balance_subset(stats, config)
    ctx = hbp_context(config, num_samples=len(stats), balanced_samples=len(balanced))
    row = result.row("hbp")
    parts = time_breakdown(ctx, HBPPlanConfig(baseline_batch_size=1), row, result.schedule, balanced)
    assert [p["length"] for p in parts] == [lv.length for lv in row.levels]
    for p, lv in zip(parts, row.levels):
        assert p["time_s"] == pytest.approx(lv.time_s)
        assert sum(p[k] for k in BREAKDOWN_PARTS) == pytest.approx(p["time_s"])
        assert p["work"] > 0 and p["recompute"] >= 0 and p["grad_sync"] > 0 and p["pipeline_idle"] >= 0
        assert (p["recompute"] > 0) == (lv.checkpointed > 0)  # checkpoints cost busy time, none costs nothing


def test_training_schedule_covers_every_row_or_is_none_for_a_plain_winner(small_plan):
    from dataclasses import replace

    from omnibal.data.balance import balance
    from omnibal.jobs.hbp import training_schedule

    stats, result = small_plan
    config, hbp = PlanJobConfig(**SMALL_JOB), HBPPlanConfig(baseline_batch_size=1)
    sched = training_schedule(config, hbp, result, stats)
    assert np.all(sched.sample_counts() == 1) and sched.level_sp == result.schedule.level_sp
    assert sched.level_microbatches == result.schedule.level_microbatches
    # each level's recompute choice travels to the trainer by layer name (partition-free)
    meta, hbp_row = sched.meta["hbp"], result.row("hbp")
    from omnibal.cost.presets import get_model_preset

    assert meta["model"] == get_model_preset("internvl2-8b").name
    assert [len(names) for names in meta["level_recompute"]] == [lv.checkpointed for lv in hbp_row.levels]
    assert [len(names) for names in meta["level_selective"]] == [lv.selective for lv in hbp_row.levels]
    assert meta["stage_cuts"] == list(hbp_row.parts)
    plain = balance(stats, dp_size=SMALL_JOB["layout"].dp_size, num_microbatches=2)
    assert training_schedule(config, hbp, replace(result, schedule=plain), stats) is None


def test_plan_refuses_a_sample_no_level_can_hold():
    stats = long_context_mixture(3000, seed=4)
    # SP <= 2 on a 32 GiB budget cannot hold the 100k-token videos (the megatron-deepspeed stack needs 28.6 GiB
    # for parameters, gradients and optimizer state alone)
    with pytest.raises(InputError) as err:
        run_hbp_job(PlanJobConfig(**SMALL_JOB, memory_budget_gib=32.0), HBPPlanConfig(sp_degrees=(1, 2)), stats)
    assert err.value.field == "tokens" and "oversize" in str(err.value)


def test_cli_plan_hbp_writes_the_level_table(tmp_path, capsys):
    code = main(["plan", "--hbp", "long-context", "--model", "internvl2-8b", "--gpus", "16", "--pp", "2",
                 "--microbatches", "2", "--samples", "2500", "--balance-samples", "1500",
                 "--batch-size", "1", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| level | pack length | SP | micro-batches |" in out and "| hbp |" in out
    assert "SP degree per level, chosen by the simulator" in out and "Bound on HBP's gain" in out
    doc = json.loads((tmp_path / "hbp.json").read_text())
    hbp = next(row for row in doc["rows"] if row["name"] == "hbp")
    assert doc["speedup_hbp_vs_single"] > 0 and doc["speedup_hbp_vs_naive"] >= doc["speedup_hbp_vs_single"]
    assert doc["bound"]["gain_bound_floor"] >= doc["speedup_hbp_vs_single"]
    # the winning levels balanced over all 2,500 rows (the plan balanced 1,500), as a trainer runs them
    from omnibal.data.balance.schedule import Schedule

    sched = Schedule.from_json(tmp_path / "hbp_schedule.json")
    assert sched.num_samples == 2500 and np.all(sched.sample_counts() == 1)
    assert sched.meta["hbp"]["level_lengths"] == [lv["length"] for lv in hbp["levels"]]
    assert list(sched.level_sp) == [lv["sp"] for lv in hbp["levels"]]
    assert list(sched.level_microbatches or [2] * len(sched.level_sp)) == [lv["microbatches"] for lv in hbp["levels"]]
    assert f"--microbatches {sched.num_microbatches}" in out
