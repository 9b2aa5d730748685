import dataclasses
import json

import numpy as np
import pytest

from omnibal.cli import main
from omnibal.cost.analytic import layer_work
from omnibal.cost.hardware import get_hardware
from omnibal.cost.presets import get_model_preset
from omnibal.cost.profile import (
    FORMAT,
    ProfileConfig,
    ProfileGrid,
    check_profile_model,
    cost_table_from_profile,
    fit_profile,
    load_profile,
    save_profile,
)
from omnibal.cost.spec import LLMSpec, ModelSpec, VisionSpec
from omnibal.errors import InputError
from omnibal.measure.profile import measure


def small_spec(name="profile-test"):
    """8 px patches on 32 px tiles (16 patches + class token, 4 LLM tokens per tile): measures in ~1 s."""
    return ModelSpec(name=name,
                     vision=VisionSpec(num_layers=2, hidden=32, num_heads=4, mlp_hidden=128, image_size=32,
                                       patch_size=8),
                     llm=LLMSpec(num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, mlp_hidden=64,
                                 vocab_size=64))


def synthetic_profile(spec):
    rows = []
    for kind in ("vision_embed", "vision_block", "projector"):
        for tiles in (1, 2, 4):
            rows.append(dict(kind=kind, features=[1, tiles, 0, 0], fwd_s=1e-3 + 2e-3 * tiles,
                             bwd_s=2e-3 + 4e-3 * tiles, saved_bytes=1000 * tiles))
    for kind in ("llm_embed", "llm_block", "lm_head"):
        for tokens, seg in ((64, 16), (64, 64), (128, 32), (256, 256)):
            sq = tokens * seg
            rows.append(dict(kind=kind, features=[1, 1, tokens, sq], fwd_s=5e-4 + 1e-5 * tokens + 1e-8 * sq,
                             bwd_s=1e-3 + 2e-5 * tokens + 2e-8 * sq, saved_bytes=100 * tokens))
    return {"format": FORMAT, "model": {"name": spec.name, "fingerprint": spec.fingerprint()}, "dtype": "fp32",
            "measurements": rows, "fit": fit_profile(rows)}


def test_cost_table_from_profile_uses_the_fits(tmp_path):
    spec = small_spec()
    path = tmp_path / "p.json"
    save_profile(synthetic_profile(spec), path)
    profile = load_profile(path, spec)
    table = cost_table_from_profile(spec, profile)
    assert table.names == tuple(layer.name for layer in spec.layers())
    block = table.kinds.index("llm_block")
    assert np.allclose(table.fwd_time[block], [5e-4, 0, 1e-5, 1e-8], rtol=1e-6, atol=1e-12)
    vision = table.kinds.index("vision_block")
    assert np.allclose(table.bwd_time[vision], [2e-3, 4e-3, 0, 0], rtol=1e-6, atol=1e-12)
    assert (table.ckpt_bytes <= table.act_bytes + 1e-9).all()
    with pytest.raises(InputError) as exc:
        cost_table_from_profile(spec, profile, tp_size=2)
    assert exc.value.field == "hardware"
    tp2 = cost_table_from_profile(spec, profile, tp_size=2, hardware=get_hardware("a100-80g"))
    # LLM GEMMs dominate a block: close to half the time per token; the all-reduces come on top.
    assert 0.4 < tp2.fwd_time[block][2] / table.fwd_time[block][2] < 0.75
    assert tp2.tp_comm_time is not None and tp2.tp_comm_time[block][2] > 0
    assert np.allclose(tp2.param_bytes[block], table.param_bytes[block] / 2)
    with pytest.raises(InputError) as exc:
        cost_table_from_profile(spec, profile, tp_size=3, hardware=get_hardware("a100-80g"))
    assert exc.value.field == "llm.num_heads"
    frozen = dataclasses.replace(spec, freeze_vision=True)
    with pytest.raises(InputError):  # another shape of training: another fingerprint
        cost_table_from_profile(frozen, profile)


def test_profile_of_another_model_is_refused(tmp_path):
    spec = small_spec()
    path = tmp_path / "p.json"
    save_profile(synthetic_profile(spec), path)
    with pytest.raises(InputError) as exc:
        load_profile(path, get_model_preset("tiny"))
    assert exc.value.field == "model.fingerprint" and str(path) in str(exc.value)
    with pytest.raises(InputError) as exc:
        check_profile_model(load_profile(path), small_spec(name="renamed"))
    assert exc.value.field == "model.name"
    (tmp_path / "bad.json").write_text('{"format": "something-else"}')
    with pytest.raises(InputError) as exc:
        load_profile(tmp_path / "bad.json")
    assert exc.value.field == "format"
    (tmp_path / "broken.json").write_text('{"format": ')
    with pytest.raises(InputError):
        load_profile(tmp_path / "broken.json")
    with pytest.raises(InputError):
        load_profile(tmp_path / "missing.json")


def test_grid_validation_and_shapes():
    with pytest.raises(InputError) as exc:
        ProfileGrid(tiles=())
    assert exc.value.field == "tiles"
    grid = ProfileGrid(tiles=(1, 3), tokens=(64, 128), segments=(32, 100))
    spec = small_spec()
    block = grid.shapes("llm_block", spec)
    assert {(s["tokens"], s["segment"]) for s in block} == {(64, 32), (128, 32), (128, 100)}
    assert [s["tiles"] for s in grid.shapes("projector", spec)] == [1, 3]


def test_measured_saved_bytes_match_the_analytic_accounting(tmp_path):
    """On the real modules: the vision block keeps exactly the analytic activation bytes (flash attention,
    no dropout); every kind is measured, timed and fitted; the CLI writes a loadable profile."""
    spec = small_spec()
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec.to_dict()))
    out = tmp_path / "profile.json"
    code = main(["profile", "--spec", str(spec_path), "-o", str(out), "--tiles", "1,2,3", "--tokens", "32,64,96",
                 "--segments", "16,32", "--repeats", "1", "--warmup", "1", "--quiet"])
    assert code == 0
    profile = load_profile(out, spec)
    assert profile["device"]["type"] == "cpu" and profile["threads"] == 1
    kinds = {r["kind"] for r in profile["measurements"]}
    assert kinds == {layer.kind for layer in spec.layers()}
    assert all(r["fwd_s"] > 0 and r["bwd_s"] > 0 for r in profile["measurements"])
    assert all(r["fwd_s"] == r["fwd_median_s"] and r["fwd_min_s"] <= r["fwd_median_s"] and r["fwd_cpu_s"] > 0
               for r in profile["measurements"])
    work = layer_work(spec, dtype="fp32")
    i = [layer.kind for layer in spec.layers()].index("vision_block")
    for row in profile["measurements"]:
        if row["kind"] == "vision_block":
            assert row["saved_bytes"] == pytest.approx(work.act_bytes[i] @ np.array(row["features"]))
    table = cost_table_from_profile(spec, profile)
    assert (table.fwd_time.sum(axis=1) > 0).all()


def test_profile_flags_build_the_config_and_the_grid_defaults_to_the_devices():
    import argparse

    from omnibal.cli.fields import config_from_args
    from omnibal.cli.profile import add_arguments
    from omnibal.cost.profile import CPU_GRID, GPU_GRID

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(ProfileConfig, parser.parse_args(
        ["--device", "cuda:1", "--tiles", "1,2,4", "--kinds", "llm_block,lm_head", "--statistic", "min"]))
    assert config == ProfileConfig(device="cuda:1", tiles=(1, 2, 4), kinds=("llm_block", "lm_head"),
                                   statistic="min")
    assert config.grid() == ProfileGrid(tiles=(1, 2, 4), tokens=GPU_GRID.tokens, segments=GPU_GRID.segments)
    assert config_from_args(ProfileConfig, parser.parse_args([])).grid() == CPU_GRID
    with pytest.raises(InputError) as exc:
        ProfileConfig(tokens=(0,))
    assert exc.value.field == "tokens"


def test_cli_refuses_an_unknown_device_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--device", "gpu", "--quiet"])
    assert exc.value.code == 2
    assert "argument --device: must be cpu or cuda[:N], got 'gpu'" in capsys.readouterr().err


def test_cli_rejects_bad_input(tmp_path, capsys):
    assert main(["profile", "--model", "nope", "-o", str(tmp_path / "x.json"), "--quiet"]) == 2
    assert "unknown model preset" in capsys.readouterr().err
    assert main(["profile", "--spec", str(tmp_path / "missing.json"), "--quiet"]) == 2


@pytest.mark.gpu
def test_cuda_profile_uses_events_and_records_peak_memory():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    spec = small_spec()
    profile = measure(spec, ProfileConfig(device="cuda", tiles=(1, 2), tokens=(64, 128), segments=(32, 64), repeats=2,
                                          warmup=1))
    assert profile["device"]["type"] == "cuda" and profile["dtype"] == "bf16"
    assert all(r["peak_bytes"] > 0 and r["fwd_s"] > 0 for r in profile["measurements"])
    assert cost_table_from_profile(spec, profile).fwd_time.shape == (spec.num_layers, 4)
