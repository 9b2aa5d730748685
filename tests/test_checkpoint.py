"""Checkpoint files: atomic writes, checksum manifest, corrupt ones skipped, incompatible ones refused."""

from __future__ import annotations

import json

import pytest
import torch

from omnibal.errors import InputError
from omnibal.train import checkpoint as ckpt

WORLD = {"dp_size": 2, "pp_size": 2}
LAYERS = [[0, 3], [3, 6]]


def _stage(seed: int, width: int = 4) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, width)).sum().backward()
    opt.step()
    return model, opt


def _write(root, step: int, seed: int = 0, model_id: str = "m:1", world=WORLD, next_step: int | None = None):
    records = []
    for stage in range(2):
        model, opt = _stage(seed + stage)
        records.append(ckpt.write_stage_file(root, step, stage, model=model, optimizer=opt))
    ckpt.write_manifest(root, step, stage_records=records, world=world, model_id=model_id, stage_layers=LAYERS,
                        sampler={"next_step": step if next_step is None else next_step, "schedule_fingerprint": "f"})


def _find(root, **kw):
    args = {"world": WORLD, "model_id": "m:1", "stage_layers": LAYERS, **kw}
    return ckpt.find_latest_valid(root, **args)


def test_roundtrip_restores_model_and_optimizer(tmp_path):
    _write(tmp_path, 5, seed=3)
    found = _find(tmp_path)
    assert found.path == ckpt.step_dir(tmp_path, 5) and not found.skipped
    assert not [p for p in found.path.iterdir() if ".tmp" in p.name]  # no temporary files left behind
    model, opt = _stage(99)
    ckpt.load_stage_file(found.path, found.manifest, 1, model=model, optimizer=opt)
    ref_model, ref_opt = _stage(4)
    for a, b in zip(model.state_dict().values(), ref_model.state_dict().values()):
        assert torch.equal(a, b)
    assert opt.state_dict()["state"][0]["step"] == ref_opt.state_dict()["state"][0]["step"]
    assert found.manifest["sampler"]["next_step"] == 5


@pytest.mark.parametrize("damage,expect", [("truncate", "truncated"), ("flip", "SHA-256"),
                                           ("manifest", "not completed"), ("missing", "missing"),
                                           ("garbage", "unreadable manifest")])
def test_corrupt_newest_is_skipped_for_the_previous_good_one(tmp_path, damage, expect):
    _write(tmp_path, 2)
    _write(tmp_path, 4)
    newest = ckpt.step_dir(tmp_path, 4)
    target = newest / "stage_1.pt"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "manifest":
        (newest / ckpt.MANIFEST).unlink()
    elif damage == "missing":
        target.unlink()
    else:
        (newest / ckpt.MANIFEST).write_text("{not json")
    found = _find(tmp_path)
    assert found.path == ckpt.step_dir(tmp_path, 2)
    assert len(found.skipped) == 1 and expect in found.skipped[0] and "step_00000004" in found.skipped[0]
    with pytest.raises(InputError, match=expect):
        ckpt.verify(newest)


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert _find(tmp_path / "absent").path is None
    _write(tmp_path, 1)
    (ckpt.step_dir(tmp_path, 1) / "stage_0.pt").write_bytes(b"")
    found = _find(tmp_path)
    assert found.path is None and len(found.skipped) == 1


def test_other_world_or_model_is_refused(tmp_path):
    _write(tmp_path, 3)
    with pytest.raises(InputError, match="world") as err:
        _find(tmp_path, world={"dp_size": 1, "pp_size": 2})
    assert err.value.field == "world" and "step_00000003" in str(err.value)
    with pytest.raises(InputError, match="model") as err:
        _find(tmp_path, model_id="m:2")
    assert err.value.field == "model_id"
    with pytest.raises(InputError, match="stage layers"):
        _find(tmp_path, stage_layers=[[0, 2], [2, 6]])


def test_parameter_mismatch_names_the_parameter(tmp_path):
    _write(tmp_path, 1)
    found = _find(tmp_path)
    model, opt = _stage(0, width=5)
    with pytest.raises(InputError, match=r"stage 0 parameters differ.*0\.weight") as err:
        ckpt.load_stage_file(found.path, found.manifest, 0, model=model, optimizer=opt)
    assert err.value.field == "params"


def test_manifest_lists_sizes_and_checksums(tmp_path):
    _write(tmp_path, 7)
    doc = json.loads((ckpt.step_dir(tmp_path, 7) / ckpt.MANIFEST).read_text())
    assert doc["format"] == ckpt.FORMAT and doc["world"] == WORLD and doc["step"] == 7
    for rec in doc["files"]:
        path = ckpt.step_dir(tmp_path, 7) / rec["file"]
        assert path.stat().st_size == rec["bytes"] and ckpt.sha256_file(path) == rec["sha256"]


def test_prune_keeps_newest(tmp_path):
    for step in (1, 2, 3):
        _write(tmp_path, step)
    ckpt.prune(tmp_path, keep=2)
    assert ckpt.list_steps(tmp_path) == [2, 3]
