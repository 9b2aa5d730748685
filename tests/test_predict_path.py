"""One step-time prediction path: ``omnibal plan`` and ``omnibal simulate`` agree for every preset, stats carry
their image convention, and a convention mismatch is an InputError naming both (``omnibal.jobs.predict``,
``omnibal.cost.units``)."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from omnibal.cli import main
from omnibal.cost.presets import get_model_preset, preset_names
from omnibal.cost.units import model_convention, model_stats
from omnibal.errors import InputError
from omnibal.jobs.plan_config import PlanJobConfig
from omnibal.jobs.plan_job import run_plan_job
from omnibal.layout import Layout
from omnibal.measure.hardware import hardware_by_name
from omnibal.plan.plan import Plan
from omnibal.plan.search import SearchConfig
from omnibal.stats.io import load_stats, save_stats
from omnibal.stats.table import (
    INTERNVL_CONVENTION,
    LLAVA_CONVENTION,
    ImageConvention,
    SampleStats,
    convert_convention,
)

ROOT = Path(__file__).resolve().parents[1]
TINY_PROFILE = ROOT / "benchmarks" / "results" / "profile_tiny_cpu.json"
SAMPLES = 320


def _simulated_step(argv: list[str]) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["simulate", *argv, "--no-report", "--quiet"]) == 0
    m = re.search(r"step time mean / max s\s+([0-9.e+-]+) /", out.getvalue())
    assert m, out.getvalue()
    return float(m.group(1))


def _plan_then_simulate(tmp_path: Path, preset: str, hardware: str, profile: str | None) -> tuple[float, float]:
    # the plan's caller resolves --hardware (cpu: measured here), as omnibal plan does
    config = PlanJobConfig(preset=preset, hardware=hardware_by_name(hardware),
                           layout=Layout(dp_size=2, pp_size=2, num_microbatches=2),
                           num_samples=SAMPLES, balance_samples=None, memory_budget_gib=1e5, profile_path=profile,
                           search=SearchConfig(radius=1, top_k=2, sample_steps=8))
    plan = run_plan_job(config).plan
    path = plan.save(tmp_path / f"{preset}.json")
    # the plan gives the rest: its data, budget, balancer settings and profile (hardware: measured again here)
    return plan.prediction.step_time_s, _simulated_step(["--plan", str(path), "--hardware", hardware])


@pytest.mark.parametrize("preset", preset_names())
def test_plan_and_simulate_predict_the_same_step_for_every_preset(tmp_path, preset):
    planned, simulated = _plan_then_simulate(tmp_path, preset, "a100-80g", None)
    assert simulated == pytest.approx(planned, rel=0.01)


@pytest.mark.skipif(not TINY_PROFILE.is_file(), reason="no committed CPU profile of the tiny preset")
def test_plan_and_simulate_agree_for_tiny_with_a_cpu_profile(tmp_path):
    planned, simulated = _plan_then_simulate(tmp_path, "tiny", "cpu", str(TINY_PROFILE))
    assert simulated == pytest.approx(planned, rel=0.01)
    # the tiny model sees 16 tokens per tile, not the statistics' 256: a CPU step of the tiny model is seconds
    assert planned < 5.0


def _internvl_stats(n: int = 50) -> SampleStats:
    rng = np.random.default_rng(0)
    tiles = rng.integers(1, 8, n)
    images = (rng.random(n) < 0.8).astype(int)
    tokens = tiles * 256 * images + rng.integers(20, 400, n)
    return SampleStats.from_arrays(tiles=tiles, tokens=tokens, images=images, source="s")


def test_llava_model_refuses_internvl_stats_naming_both_conventions_unless_converted():
    llava = get_model_preset("llava-1.5-7b")
    stats = _internvl_stats()
    with pytest.raises(InputError) as exc:
        model_stats(stats, llava)
    message = str(exc.value)
    assert "InternVL tiles" in message and "LLaVA single image" in message and "--convert-stats" in message
    out = model_stats(stats, llava, convert=True)
    assert out.convention == LLAVA_CONVENTION == model_convention(llava)
    image = stats.images > 0
    assert (out.tiles[image] == stats.images[image]).all()  # one 336 px image is one tile
    text = stats.tokens - 256 * stats.tiles * image
    assert (out.tokens == text + 576 * out.tiles * image).all()


def test_same_layout_recounts_tokens_per_tile_and_unrecorded_reads_as_internvl():
    tiny = get_model_preset("tiny")
    stats = _internvl_stats()
    out = model_stats(stats, tiny)
    assert str(out.convention) == "internvl/16" and "no recorded convention" in out.source
    assert (out.tiles == stats.tiles).all()
    assert out.tokens.tolist() == tiny.sample_tokens(stats.tiles, stats.tokens, images=stats.images).tolist()
    internvl = get_model_preset("internvl-chat-1.5")
    same = model_stats(stats, internvl)
    assert same.convention == INTERNVL_CONVENTION and same.equals(stats) and same.source == stats.source


def test_llava_stats_cannot_become_internvl_tiles():
    llava = convert_convention(_internvl_stats(), LLAVA_CONVENTION)
    with pytest.raises(InputError, match="image sizes"):
        model_stats(llava, get_model_preset("internvl2-8b"), convert=True)


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_stats_files_carry_their_convention(tmp_path, ext):
    llava = convert_convention(_internvl_stats(1500), LLAVA_CONVENTION)
    path = save_stats(llava, tmp_path / f"s.{ext}")
    back = load_stats(path)
    assert back.convention == LLAVA_CONVENTION and back.equals(llava)
    plain = save_stats(_internvl_stats(1500), tmp_path / f"old.{ext}")
    assert load_stats(plain).convention is None  # files without one read back as unrecorded


def test_jsonl_header_keeps_line_numbers_of_bad_records(tmp_path):
    llava = convert_convention(_internvl_stats(5), LLAVA_CONVENTION)
    path = save_stats(llava, tmp_path / "s.jsonl")
    lines = path.read_text().splitlines()
    lines[3] = lines[3].replace('"tokens": ', '"tokens": -')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match="line 4"):
        load_stats(path)


def test_formats_that_cannot_record_a_convention_refuse_a_non_default_one(tmp_path):
    llava = convert_convention(_internvl_stats(), LLAVA_CONVENTION)
    with pytest.raises(InputError, match="cannot record"):
        save_stats(llava, tmp_path / "s.json")


def test_plan_refuses_internvl_stats_for_llava(tmp_path):
    path = save_stats(_internvl_stats(400), tmp_path / "s.jsonl")
    config = PlanJobConfig(preset="llava-1.5-7b", layout=Layout(dp_size=2, pp_size=2, num_microbatches=2),
                           stats_path=str(path),
                           balance_samples=None, memory_budget_gib=1e5)
    with pytest.raises(InputError, match="LLaVA single image"):
        run_plan_job(config)


EXAMPLES = ROOT / "src" / "omnibal" / "examples"


def test_stats_cli_makes_llava_stats_one_tile_per_image_and_records_it(tmp_path):
    llava_out, internvl_out = tmp_path / "llava.jsonl", tmp_path / "internvl.jsonl"
    base = [str(EXAMPLES / "annotations.jsonl"), "--quiet", "--workers", "1"]
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main(["stats", *base, "--convention", "llava", "--out", str(llava_out)]) == 0
        assert main(["stats", *base, "--out", str(internvl_out)]) == 0
    llava, internvl = load_stats(llava_out), load_stats(internvl_out)
    assert llava.convention == LLAVA_CONVENTION and internvl.convention == INTERNVL_CONVENTION
    assert (llava.tiles[llava.images > 0] == llava.images[llava.images > 0]).all()
    assert internvl.tiles.max() > 1  # the examples hold large images: InternVL cuts them into several tiles


def test_balance_cli_takes_the_model_cost_and_refuses_a_convention_mismatch(tmp_path):
    stats = save_stats(_internvl_stats(400), tmp_path / "s.jsonl")
    err = io.StringIO()
    common = ["balance", "--stats", str(stats), "--dp", "2", "--microbatches", "2", "--quiet"]
    with contextlib.redirect_stderr(err):
        assert main([*common, "--model", "llava-1.5-7b"]) == 2
    assert "LLaVA single image" in err.getvalue()
    out = tmp_path / "sched.json"
    assert main([*common, "--model", "llava-1.5-7b", "--convert-stats", "--out", str(out)]) == 0
    if TINY_PROFILE.is_file():
        assert main([*common, "--model", "tiny", "--profile", str(TINY_PROFILE), "--hardware", "cpu"]) == 0


def test_internvl_stats_with_one_tile_per_image_fit_a_llava_model_without_a_flag():
    single = SampleStats.from_arrays(tiles=[1, 1, 1], tokens=[900, 40, 1000], images=[1, 0, 1], source="single")
    out = model_stats(single, get_model_preset("llava-1.5-7b"))
    assert out.tiles.tolist() == [1, 1, 1] and out.tokens.tolist() == [900 - 256 + 576, 40, 1000 - 256 + 576]


def test_plan_records_how_the_stats_convention_was_read(tmp_path):
    path = save_stats(_internvl_stats(400), tmp_path / "s.jsonl")
    config = PlanJobConfig(preset="tiny", layout=Layout(dp_size=2, pp_size=2, num_microbatches=2), stats_path=str(path),
                           balance_samples=None, memory_budget_gib=1e5, search=SearchConfig(radius=1, top_k=2,
                                                                                              sample_steps=8))
    plan = run_plan_job(config).plan
    assert plan.inputs.stats_convention == "internvl/256 (not recorded: default) -> internvl/16"
    assert Plan.load(plan.save(tmp_path / "p.json")).inputs.stats_convention == plan.inputs.stats_convention


def test_the_trainer_puts_statistics_in_the_models_units_as_plan_does(tmp_path):
    """The trainer rescaled tokens by ``--stats-tokens-per-tile`` alone, ignoring a recorded convention: it now
    calls ``model_stats`` too, so a recorded convention wins and another layout is refused."""
    from omnibal.train.config import TrainConfig
    from omnibal.train.run import load_training_stats

    tiny = get_model_preset("tiny")
    tiles, images = np.array([2, 1, 3]), np.array([1, 0, 2])
    recorded = replace(SampleStats.from_arrays(tiles=tiles, tokens=tiles * 100 + 50, images=images, source="s"),
                       convention=ImageConvention("internvl", 100))
    save_stats(recorded, tmp_path / "recorded.jsonl")
    got = load_training_stats(TrainConfig(stats_path=str(tmp_path / "recorded.jsonl")), tiny)  # default 256 unused
    assert got.tokens.tolist() == model_stats(recorded, tiny).tokens.tolist() == [2 * 16 + 50, 150, 3 * 16 + 50]
    unrecorded = SampleStats.from_arrays(tiles=tiles, tokens=tiles * 100 + 50, images=images, source="u")
    save_stats(unrecorded, tmp_path / "unrecorded.jsonl")
    cfg = TrainConfig(stats_path=str(tmp_path / "unrecorded.jsonl"), stats_tokens_per_tile=100)
    assert load_training_stats(cfg, tiny).tokens.tolist() == [2 * 16 + 50, 150, 3 * 16 + 50]
    llava = replace(recorded, convention=LLAVA_CONVENTION)
    save_stats(llava, tmp_path / "llava.jsonl")
    with pytest.raises(InputError, match=r"statistics are LLaVA .* model tiny expects .*\(internvl/16\)"):
        load_training_stats(TrainConfig(stats_path=str(tmp_path / "llava.jsonl")), tiny)
