"""The default job is the paper's setting (issue 17 item 1) and searches the pack size (item 3)."""

import argparse
import json
from dataclasses import replace

import numpy as np
import pytest

from omnibal.cost.analytic import analytic_cost_table
from omnibal.cost.hardware import get_hardware
from omnibal.cost.presets import get_model_preset
from omnibal.data.balance.api import BalanceConfig
from omnibal.data.balance.cost import BalanceCost
from omnibal.jobs.plan_config import PlanJobConfig
from omnibal.jobs.plan_job import run_plan_job
from omnibal.layout import Layout
from omnibal.plan.ablation import PAPER_GPU_DAYS, AblationRow, with_speedups
from omnibal.plan.packsize import PackSearchConfig, search_pack_size
from omnibal.plan.search import SearchConfig
from omnibal.plan.stages import StageModelConfig
from omnibal.sim.costs import config_for_hardware
from omnibal.stats.synthetic import (
    FITTED_TILES,
    INTERNVL_12_SFT,
    SyntheticConfig,
    mixture_layout,
    synthetic_internvl_mixture,
)

FITTED = {"science_diagrams": "ai2d", "charts": "chartqa"}


def _profile(name):
    return next(p for p in INTERNVL_12_SFT if p.name == name)


@pytest.mark.parametrize("profile_name", sorted(FITTED))
def test_fitted_subsets_match_the_published_statistics(profile_name, shared_stats_dir):
    from conftest import REAL_STATS_FILES

    rows = json.loads((shared_stats_dir / REAL_STATS_FILES[FITTED[profile_name]]).read_text())
    tiles = np.array([r["vit_num"] for r in rows])
    tokens = np.array([r["token_num"] for r in rows])
    profile = _profile(profile_name)
    # the embedded shares and medians are the files' own (refit here)
    text = tokens - 256 * tiles - 2
    for mix in profile.tile_mix:
        sel = tiles == mix.tiles
        assert mix.share == pytest.approx(sel.mean(), abs=5e-4)
        assert mix.text_median == pytest.approx(np.exp(np.median(np.log(text[sel]))), abs=1.0)
        assert mix.text_sigma == pytest.approx(np.log(text[sel]).std(), abs=2e-3)
    assert set(np.unique(tiles)) == {m.tiles for m in profile.tile_mix}
    synth = synthetic_internvl_mixture(60_000, seed=1, config=SyntheticConfig(profiles=(replace(profile, weight=1),)))
    assert synth.tiles.mean() == pytest.approx(tiles.mean(), rel=0.03)
    assert synth.tokens.mean() == pytest.approx(tokens.mean(), rel=0.03)
    for q in (10, 50, 90):
        assert np.percentile(synth.tokens, q) == pytest.approx(np.percentile(tokens, q), rel=0.06)


def test_default_mixture_uses_the_published_tile_rule():
    assert SyntheticConfig().tiles == FITTED_TILES and FITTED_TILES.max_tiles == 4 and FITTED_TILES.use_thumbnail
    s = synthetic_internvl_mixture(100_000, seed=0)
    assert set(np.unique(s.tiles).tolist()) <= {1, 3, 4, 5}
    # about a third of the 12-tile rule's weight (7.8 tiles, 2,229 tokens per sample)
    assert 2.0 < s.tiles.mean() < 3.0 and 700 < s.tokens.mean() < 1000
    layout = {n: (a, b) for n, a, b in mixture_layout(100_000)}
    a, b = layout["general_vqa"]
    assert s.tiles[a:b].max() == 5


def test_default_job_is_the_papers_setting():
    cfg = PlanJobConfig()
    assert cfg.baseline_partition == "vision-first" and cfg.stack == "megatron-deepspeed"
    assert cfg.baseline_sampler == "length-grouped"  # InternVL-1.5's fine-tuning scripts pass --group_by_length
    assert ((cfg.preset, cfg.hardware, cfg.layout.dp_size, cfg.layout.pp_size, cfg.layout.tp_size)
            == ("internvl-chat-1.5", "a100-80g", 32, 4, 1))
    assert cfg.pack_search.microbatches == ()  # library callers keep their M
    from omnibal.cli.plan import add_arguments, job_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cli = job_config(parser.parse_args([]))
    assert cli.baseline_partition == "vision-first" and cli.stack == "megatron-deepspeed"
    assert cli.baseline_sampler == "length-grouped"
    assert job_config(parser.parse_args(["--baseline-sampler", "random"])).baseline_sampler == "random"
    assert cli.pack_search.microbatches == (8, 12, 16, 24, 32)
    assert job_config(parser.parse_args(["--pack-microbatches", "none"])).pack_search.microbatches == ()


def _pack_inputs(budget_gib):
    spec, hw = get_model_preset("internvl-chat-1.5"), get_hardware("a100-80g")
    table = analytic_cost_table(spec, hw, stack="megatron-deepspeed")
    sim = config_for_hardware(hw, dp_size=32, pp_size=4, tp_size=1, memory_headroom=None)
    sim = replace(sim, memory_budget_bytes=budget_gib * 2**30)
    stage = StageModelConfig(num_stages=4, num_microbatches=8, dp_size=32, memory_budget_bytes=budget_gib * 2**30,
                             p2p_bandwidth=sim.p2p_bandwidth, p2p_latency=sim.p2p_latency)
    return table, sim, stage, BalanceConfig(cost=BalanceCost.from_cost_table(table))


def test_pack_search_picks_the_fastest_fitting_pack_at_the_same_samples_per_step():
    table, sim, stage, bal = _pack_inputs(76)
    stats = synthetic_internvl_mixture(30_000, seed=0)
    config = PackSearchConfig(microbatches=(8, 16, 48), screen_samples=30_000)
    chosen, cands = search_pack_size(stats, table, stage, sim, balance_config=bal, samples_per_rank_step=36,
                                     config=config, num_total_samples=1_200_000, seed=0)
    assert [c.num_microbatches for c in cands] == [8, 16, 48]
    for c in cands:
        assert c.num_microbatches * c.target_samples == pytest.approx(36)
        assert c.off_batch == (abs(c.samples_per_microbatch / c.target_samples - 1) > config.batch_tolerance)
        assert c.off_batch == (c.parts == ())  # reported, not planned
    # a pack holds at least one sample: 48 packs of 0.75 samples overshoot the batch (reported, not planned)
    assert cands[-1].off_batch and cands[-1].samples_per_microbatch >= 1.0
    ok = [c for c in cands if not c.oom and not c.off_batch]
    assert chosen is min(ok, key=lambda c: c.gpu_days)
    # smaller packs hold less in flight: they need fewer checkpoints
    assert cands[1].num_checkpointed < cands[0].num_checkpointed


def test_pack_search_never_chooses_a_pack_that_does_not_fit():
    table, sim, stage, bal = _pack_inputs(44)
    stats = synthetic_internvl_mixture(20_000, seed=2)
    chosen, cands = search_pack_size(stats, table, stage, sim, balance_config=bal, samples_per_rank_step=36,
                                     config=PackSearchConfig(microbatches=(4, 8, 16)), num_total_samples=20_000,
                                     seed=0)
    assert cands[0].oom and not np.isfinite(cands[0].gpu_days) and cands[0].parts == ()  # 9-sample packs
    assert cands[1].oom  # 4.5-sample packs do not fit 44 GiB either
    assert chosen is cands[2] and not chosen.oom and chosen.num_checkpointed > 0


def test_pack_row_is_the_plan_and_records_the_search():
    cfg = PlanJobConfig(preset="tiny", num_gpus=4, layout=Layout(dp_size=2, pp_size=2, num_microbatches=4),
                        num_samples=3000,
                        search=SearchConfig(radius=1, top_k=3, sample_steps=16),
                        pack_search=PackSearchConfig(microbatches=(2, 8)))
    res = run_plan_job(cfg)
    pack = res.plan.data.settings["pack_search"]
    assert [c["num_microbatches"] for c in pack["candidates"]] == [2, 4, 8]  # the job's own M is a candidate
    chosen = pack["chosen"]["num_microbatches"]
    names = [r.name for r in res.ablation]
    assert names[:4] == list(PAPER_GPU_DAYS)
    extra = [n for n in names[4:] if n != "+ selective recompute"]  # the reference engine plans selective recompute
    if chosen == 4:
        assert extra == []
    else:
        assert extra == ["+ pack size"] and res.ablation[-1].paper_gpu_days is None
        assert res.plan.inputs.layout.num_microbatches == chosen
        assert res.plan.data.settings["config"]["target_samples"] == pytest.approx(pack["chosen"]["target_samples"])
    assert res.plan.prediction.gpu_days == pytest.approx(res.ablation[-1].gpu_days)


def test_paper_columns_leave_the_extra_row_blank():
    row = dict(data="", partition="", recompute="", parts=(0, 1), num_checkpointed=0, num_steps=1, step_time_s=1.0,
               epoch_time_s=1.0, bubble=0.0, peak_memory_bytes=(0.0,), oom=False)
    rows = [AblationRow(name=n, gpu_days=d, **row) for n, d in
            (("baseline", 60.0), ("+ adaptive recompute", 30.0), ("+ pack size", 24.0))]
    out = with_speedups(rows)
    assert [r.paper_gpu_days for r in out] == [61.8, 21.3, None]
    assert out[2].speedup == pytest.approx(2.5) and out[1].paper_speedup == pytest.approx(61.8 / 21.3)


def test_ablation_table_shows_each_rows_gap_to_the_paper():
    from omnibal.plan.ablation import ablation_markdown

    row = dict(data="", partition="", recompute="", parts=(0, 1), num_checkpointed=0, num_steps=1, step_time_s=1.0,
               epoch_time_s=1.0, bubble=0.0, peak_memory_bytes=(0.0,), oom=False)
    rows = with_speedups([AblationRow(name=n, gpu_days=d, **row) for n, d in
                          (("baseline", 61.8), ("+ data balance", 61.8 / 1.41), ("+ pack size", 20.0))])
    lines = ablation_markdown(rows).splitlines()
    assert lines[0].endswith("| ours vs paper |")
    assert lines[2].endswith("| 61.8 | 1.00x |  |") and lines[3].endswith("| 51.9 | 1.19x | +18% |")
    assert lines[4].endswith("|  |  |  |")


def test_pack_search_keeps_the_jobs_own_pack_on_a_near_tie():
    table, sim, stage, bal = _pack_inputs(76)
    stats = synthetic_internvl_mixture(20_000, seed=0)
    kw = dict(balance_config=bal, samples_per_rank_step=36, num_total_samples=20_000, seed=0, incumbent=8)
    best, cands = search_pack_size(stats, table, stage, sim, config=PackSearchConfig(microbatches=(8, 12)), **kw)
    own, other = cands
    gain = 1 - other.gpu_days / own.gpu_days
    assert gain > 0 and best is other  # 12 smaller packs are faster here ...
    kept, _ = search_pack_size(stats, table, stage, sim,
                               config=PackSearchConfig(microbatches=(8, 12), min_gain=gain + 0.01), **kw)
    assert kept == own  # ... but not by enough to replace the job's own pack


def test_baseline_padding_prices_only_the_baselines_padding():
    from omnibal.cli.plan import add_arguments, job_config
    from omnibal.errors import InputError

    base = PlanJobConfig(num_samples=20_000, balance_samples=None,
                         search=SearchConfig(radius=1, top_k=2, sample_steps=16))
    padded = run_plan_job(base)
    varlen = run_plan_job(replace(base, baseline_padding="varlen"))
    # the same baseline micro-batches without their padding: cheaper; every balanced row unchanged
    assert varlen.ablation[0].gpu_days < padded.ablation[0].gpu_days
    assert "variable length" in varlen.ablation[0].data and "padded" in padded.ablation[0].data
    for a, b in zip(padded.ablation[1:], varlen.ablation[1:], strict=True):
        assert a.gpu_days == pytest.approx(b.gpu_days)
    assert varlen.balance_metrics["baseline"]["padding"] == "varlen"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert job_config(parser.parse_args([])).baseline_padding == "pad_to_longest"
    assert job_config(parser.parse_args(["--baseline-padding", "varlen"])).baseline_padding == "varlen"
    with pytest.raises(InputError, match="baseline-padding"):
        replace(base, baseline_padding="fixed_buffer").validate()


def test_fixed_caps_set_the_planned_pack_and_turn_the_pack_search_off(tmp_path):
    from omnibal.cli.plan import add_arguments, job_config, run
    from omnibal.errors import InputError

    base = PlanJobConfig(num_samples=20_000, balance_samples=None, pack_search=PackSearchConfig(),
                         search=SearchConfig(radius=1, top_k=2, sample_steps=16))
    res = run_plan_job(replace(base, max_tiles=9, max_tokens=4096, oversize="own_pack", balance_method="isf"))
    assert res.plan.data.settings["caps"] == {"tiles": 9, "tokens": 4096}
    assert "+ pack size" not in [r.name for r in res.ablation]
    assert res.balanced_schedule.method == "isf"
    with pytest.raises(InputError, match="caps"):  # a sample over 4096 tokens, and no policy for it
        run_plan_job(replace(base, max_tiles=9, max_tokens=4096))
    with pytest.raises(InputError, match="max-tokens"):
        replace(base, max_tokens=0).validate()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cli = job_config(parser.parse_args(["--max-tiles", "9", "--max-tokens", "4096", "--oversize", "drop"]))
    assert (cli.max_tiles, cli.max_tokens, cli.oversize) == (9, 4096, "drop")
    for args, flag in ((["--max-tiles", "9"], "--max-tiles"), (["--max-tokens", "4096"], "--max-tokens"),
                       (["--oversize", "own_pack"], "--oversize"), (["--baseline-padding", "varlen"],
                                                                    "--baseline-padding")):
        with pytest.raises(InputError, match=f"^{flag}: .*--hbp"):  # refused, never ignored
            run(parser.parse_args(["--hbp", *args, "--out", str(tmp_path)]))
    with pytest.raises(InputError, match="^--hbp-microbatches: .*add --hbp"):  # an HBP option without --hbp
        run(parser.parse_args(["--hbp-microbatches", "same", "--out", str(tmp_path)]))
    with pytest.raises(InputError, match="^--max-tiles: .*no buffer"):  # a fixed-count sampler has no caps
        replace(base, max_tiles=9, balance_method="random").validate()
