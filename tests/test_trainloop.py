"""Single-process trainer: layouts and plans, schedules, fixed buffers, the loop, its log and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_helpers import make_trainer, pack_schedule, plain_schedule_doc, tiny_plan, tiny_spec, tiny_stats
from omnibal.data.balance.schedule import Schedule
from omnibal.errors import InputError
from omnibal.train.config import TRAIN_LAYOUT, TrainConfig
from omnibal.train.distributed import local_world
from omnibal.train.feed import IndexSchedule, buffer_shape, check_schedule, load_schedule, random_microbatch_schedule
from omnibal.train.metrics_log import format_summary
from omnibal.train.stage_layout import (
    even_split,
    load_plan_layout,
    parse_stage_layers,
    resolve_layout,
    validate_stage_layers,
)

NAMES = [layer.name for layer in tiny_spec().layers()]  # 8 layers


# ------------------------------------------------------------------------------------------- layouts, plans


def test_even_split_and_parsing():
    assert even_split(8, 3) == ((0, 3), (3, 6), (6, 8))
    assert parse_stage_layers("0:5, 5:8") == ((0, 5), (5, 8))
    with pytest.raises(InputError, match="START:END"):
        parse_stage_layers("0-5")
    with pytest.raises(InputError, match="non-empty"):
        even_split(2, 3)


@pytest.mark.parametrize("ranges,msg", [([(0, 4), (5, 8)], "expected 4"), ([(0, 4), (4, 7)], "model has 8"),
                                        ([(0, 0), (0, 8)], "empty stage"), ([(0, 8)], "1 stage ranges for 2")])
def test_bad_stage_ranges_are_refused(ranges, msg):
    with pytest.raises(InputError, match=msg):
        validate_stage_layers(ranges, 8, source="--stage-layers", num_stages=2)


def _plan(tmp_path, ranges, recompute=None, model="dist-test-tiny", edit=None):
    doc = json.loads(tiny_plan(ranges, recompute, model=model).to_json())
    if edit is not None:
        edit(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    return path


def test_plan_layout_and_its_errors(tmp_path):
    good = ([(0, 3), (3, 8)], [["vision.blocks.0"], []])
    layout = load_plan_layout(_plan(tmp_path, *good), NAMES, pp_size=2, model_name="dist-test-tiny")
    assert layout.ranges == ((0, 3), (3, 8)) and layout.recompute == (("vision.blocks.0",), ())

    def bad_modules(doc):
        doc["stages"][0]["modules"] = ["vision.embed", "vision.blocks.0", "vision.blocks.7"]
    with pytest.raises(InputError, match="vision.blocks.7") as err:
        load_plan_layout(_plan(tmp_path, *good, edit=bad_modules), NAMES, pp_size=2)
    assert err.value.field == "modules" and err.value.record == "stages[0]"
    with pytest.raises(InputError, match="model has 8 layers"):
        load_plan_layout(_plan(tmp_path, [(0, 3), (3, 7)]), NAMES, pp_size=2)
    with pytest.raises(InputError, match="3 stage ranges for 2"):
        load_plan_layout(_plan(tmp_path, [(0, 3), (3, 5), (5, 8)]), NAMES, pp_size=2)
    with pytest.raises(InputError, match="made for model 'other'"):
        load_plan_layout(_plan(tmp_path, *good, model="other"), NAMES, pp_size=2, model_name="dist-test-tiny")

    def foreign_recompute(doc):
        doc["stages"][0]["recompute"] = ["llm.blocks.0"]
    with pytest.raises(InputError, match="not in this stage"):
        load_plan_layout(_plan(tmp_path, *good, edit=foreign_recompute), NAMES, pp_size=2)


def test_resolve_layout_modes(tmp_path):
    base = resolve_layout(NAMES, pp_size=2, mode="baseline")
    assert base.ranges == ((0, 4), (4, 8))
    assert base.recompute == (tuple(NAMES[0:4]), tuple(NAMES[4:8]))  # full recompute
    assert resolve_layout(NAMES, pp_size=2, mode="offline").recompute == ((), ())
    explicit = resolve_layout(NAMES, pp_size=2, mode="offline", stage_layers=[(0, 3), (3, 8)],
                              recompute=[["vision.blocks.1"], []])
    assert explicit.ranges == ((0, 3), (3, 8)) and explicit.recompute == (("vision.blocks.1",), ())
    with pytest.raises(InputError, match="not in stage 1"):
        resolve_layout(NAMES, pp_size=2, mode="offline", stage_layers=[(0, 3), (3, 8)],
                       recompute=[[], ["vision.blocks.1"]])


# ------------------------------------------------------------------------------------------- schedules


def test_schedule_json_is_checked(tmp_path):
    stats = tiny_stats()
    sched = pack_schedule(stats, dp_size=2, num_microbatches=2, num_steps=3)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(plain_schedule_doc(sched)))  # hand-made: no caps
    back = load_schedule(path)
    assert back.caps is None and Schedule.from_json(back.to_json()).equals(back)  # written back as caps null
    assert back.num_steps == 3 and np.array_equal(back.microbatch(2, 1, 1), sched.microbatch(2, 1, 1))
    with pytest.raises(InputError, match="dp_size 2, the run has 4"):
        check_schedule(back, dp_size=4, num_microbatches=2, num_samples=len(stats), source=str(path))
    with pytest.raises(InputError, match="outside the dataset") as err:
        check_schedule(back, dp_size=2, num_microbatches=2, num_samples=3, source=str(path))
    assert err.value.record.startswith("step 0")
    doc = plain_schedule_doc(sched)
    doc["steps"][1][0] = doc["steps"][1][0][:1]
    with pytest.raises(InputError, match="needs 2 micro-batches") as err:
        Schedule.from_dict(doc, source="s.json")
    assert err.value.record == "step 1 rank 0"
    doc["steps"][1] = doc["steps"][1][:1]
    with pytest.raises(InputError, match="needs 2 ranks") as err:
        Schedule.from_dict(doc, source="s.json")
    assert err.value.record == "step 1"


def test_random_baseline_schedule_is_deterministic_and_disjoint():
    a = random_microbatch_schedule(100, dp_size=2, num_microbatches=3, batch_size=4, seed=1)
    b = random_microbatch_schedule(100, dp_size=2, num_microbatches=3, batch_size=4, seed=1)
    assert a.num_steps == 100 // 24
    flat = np.concatenate([a.microbatch(s, r, k) for s in range(a.num_steps) for r in range(2) for k in range(3)])
    assert len(np.unique(flat)) == len(flat) == a.num_steps * 24
    assert all(np.array_equal(a.microbatch(s, 1, 2), b.microbatch(s, 1, 2)) for s in range(a.num_steps))


def test_buffer_shape_pays_for_the_worst_padded_microbatch():
    tiles = np.array([1, 3, 2, 1])
    tokens = np.array([10, 40, 20, 5])
    sched = IndexSchedule(1, 2, (((np.array([0, 1]), np.array([2, 3])),),), None)
    assert buffer_shape(sched, tiles, tokens, pad_to_longest=False) == (4, 50)
    assert buffer_shape(sched, tiles, tokens, pad_to_longest=True) == (4, 80)  # 2 rows x 40


def test_config_validation():
    assert TrainConfig(layout=replace(TRAIN_LAYOUT, dp_size=2, pp_size=2)).world_size == 4
    with pytest.raises(InputError, match="cannot fill 4 pipeline stages"):
        TrainConfig(layout=replace(TRAIN_LAYOUT, pp_size=4, num_microbatches=2))
    with pytest.raises(InputError) as err:
        TrainConfig(mode="fast")
    assert err.value.field == "mode"
    with pytest.raises(InputError, match="resume needs checkpoint_dir"):
        TrainConfig(resume=True)


# ------------------------------------------------------------------------------------------- the loop


def test_single_process_loop_logs_and_pads(tmp_path):
    torch.set_num_threads(1)
    trainer = make_trainer(local_world(), num_microbatches=2, num_steps=3, log_path=str(tmp_path / "log.jsonl"))
    summary = trainer.run(3, warmup=1)
    header, *lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert header["run"]["stage_layers"] == [[0, 8]]
    assert len(lines) == 3 and [rec["step"] for rec in lines] == [0, 1, 2]
    fed = sum(len(trainer.schedule.microbatch(s, 0, k)) for s in range(3) for k in range(2))
    assert sum(rec["samples"] for rec in lines) == fed
    assert all(rec["token_pad_ratio"] == 0 for rec in lines)  # packs: no padding inside the active prefix
    assert np.isfinite(summary["final_loss"]) and summary["samples_per_s"] > 0
    rank = summary["per_rank"][0]
    assert rank["compute_s"] > 0 and rank["compute_s"] <= rank["step_s"]
    assert "| rank | dp | pp |" in format_summary(summary)

    base = make_trainer(local_world(), mode="baseline", num_microbatches=2, num_steps=3)
    record = base.train_step()
    assert record.buffer_tokens > record.tokens  # padded to the longest sample of each micro-batch


def test_microbatch_that_does_not_fit_the_fixed_buffer_is_refused():
    from omnibal.train.feed import Buffer

    trainer = make_trainer(local_world(), num_microbatches=2, num_steps=2)
    trainer.buffer = Buffer(tiles=2, tokens=30)
    with pytest.raises(InputError, match="the buffer holds 2 / 30") as err:
        trainer.train_step()
    assert "step 0, dp rank 0, micro-batch" in str(err.value)


def test_single_process_checkpoint_resume(tmp_path):
    torch.set_num_threads(1)
    a = make_trainer(local_world(), num_microbatches=2, num_steps=4, checkpoint_dir=str(tmp_path))
    a.run(2)
    losses = [a.train_step().loss for _ in range(2)]
    b = make_trainer(local_world(), num_microbatches=2, num_steps=4, checkpoint_dir=str(tmp_path))
    assert b.maybe_resume() and b.step == 2
    assert [b.train_step().loss for _ in range(2)] == pytest.approx(losses, rel=1e-6)
    assert b.consumed == a.consumed[2:]
    # a checkpoint of another stage layout is refused
    c = make_trainer(local_world(), num_microbatches=2, num_steps=4, checkpoint_dir=str(tmp_path))
    c.layout = type(c.layout)(((0, 8),), ((),))
    c.model_id = "other:0"
    with pytest.raises(InputError, match="model"):
        c.maybe_resume()


# ------------------------------------------------------------------------------------------- CLI


def _stats_file(tmp_path, num_samples=40):
    from omnibal.stats.io import save_stats
    from omnibal.stats.table import SampleStats

    rng = np.random.default_rng(0)
    tiles = rng.integers(1, 4, num_samples)
    tokens = tiles * 256 + rng.integers(20, 120, num_samples)  # InternVL units: 256 image tokens per tile
    return save_stats(SampleStats.from_arrays(tiles=tiles, tokens=tokens, source="cli-test"), tmp_path / "s.jsonl")


def test_cli_one_process_run_writes_log_and_summary(tmp_path):
    from omnibal.cli import main

    stats = _stats_file(tmp_path)
    rc = main(["train", "--mode", "baseline", "--stats", str(stats), "--steps", "2", "--microbatches", "1",
               "--batch-size", "2", "--log", str(tmp_path / "log.jsonl"), "--summary-json", str(tmp_path / "sum.json"),
               "--checkpoint-dir", str(tmp_path / "ck"), "--quiet"])
    assert rc == 0
    doc = json.loads((tmp_path / "sum.json").read_text())
    assert doc["summary"]["steps"] == 1 and doc["summary"]["samples_per_s"] > 0
    assert doc["recompute"][0]  # baseline: every block recomputed
    assert len((tmp_path / "log.jsonl").read_text().splitlines()) == 3  # header + 2 steps
    assert (tmp_path / "ck" / "step_00000002" / "manifest.json").is_file()
    # resuming continues at step 2 and appends to the log
    rc = main(["train", "--mode", "baseline", "--stats", str(stats), "--steps", "3", "--microbatches", "1",
               "--batch-size", "2", "--log", str(tmp_path / "log.jsonl"), "--checkpoint-dir", str(tmp_path / "ck"),
               "--resume", "--quiet"])
    assert rc == 0
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [rec.get("step") for rec in lines] == [None, 0, 1, None, 2] and lines[3]["run"]["resumed_at_step"] == 2


def test_cli_bad_input_exits_2(tmp_path, capsys):
    from omnibal.cli import main

    stats = _stats_file(tmp_path)
    assert main(["train", "--stats", str(stats), "--dp", "2", "--nproc", "3"]) == 2
    assert "--nproc 3" in capsys.readouterr().err
    assert main(["train", "--mode", "baseline", "--stats", str(stats), "--pp", "2", "--stage-layers", "0:4,5:15"]) == 2
    assert "expected 4" in capsys.readouterr().err
    assert main(["train", "--mode", "offline", "--stats", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err


def test_module_entry_point_help():
    """What torchrun runs on every rank (``torchrun ... -m omnibal train ARGS``, docs/train.md)."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run([sys.executable, "-m", "omnibal", "train", "--help"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": src})
    assert out.returncode == 0 and "--stage-layers" in out.stdout and "torchrun" in out.stdout


def test_csr_fast_paths_agree_with_the_generic_loops():
    """The balancer's Schedule (CSR packs) takes vectorised paths; they must match the per-micro-batch loops."""
    from types import SimpleNamespace

    from omnibal.train.feed import schedule_fingerprint

    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 5, 24)  # some empty packs on purpose
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    samples = rng.permutation(int(offsets[-1]))
    pack_ids = rng.permutation(24)[:18].reshape(3, 2, 3)  # 6 packs unused
    tiles = rng.integers(1, 6, len(samples))
    tokens = rng.integers(10, 300, len(samples))
    pack = lambda k: samples[offsets[k]:offsets[k + 1]]  # noqa: E731
    csr = SimpleNamespace(dp_size=2, num_microbatches=3, num_steps=3, pack_samples=samples, pack_offsets=offsets,
                          pack_ids=pack_ids, microbatch=lambda s, r, k: pack(int(pack_ids[s, r, k])))
    plain = SimpleNamespace(dp_size=2, num_microbatches=3, num_steps=3, microbatch=csr.microbatch)
    for padded in (False, True):
        fast = buffer_shape(csr, tiles, tokens, pad_to_longest=padded)
        slow = buffer_shape(plain, tiles, tokens, pad_to_longest=padded)
        assert fast == slow
    # an empty micro-batch is refused by both paths, naming the same slot (training it would fail at that step)
    records = []
    for sched in (csr, plain):
        with pytest.raises(InputError, match="empty micro-batch") as err:
            check_schedule(sched, dp_size=2, num_microbatches=3, num_samples=len(samples), source="csr")
        records.append(err.value.record)
    assert records[0] == records[1]
    full = SimpleNamespace(**{**csr.__dict__, "num_steps": 2,
                              "pack_ids": rng.permutation(np.flatnonzero(sizes > 0))[:12].reshape(2, 2, 3)})
    full.microbatch = lambda s, r, k: pack(int(full.pack_ids[s, r, k]))
    check_schedule(full, dp_size=2, num_microbatches=3, num_samples=len(samples), source="csr")
    with pytest.raises(InputError, match="outside the dataset"):
        check_schedule(full, dp_size=2, num_microbatches=3, num_samples=len(samples) - 1, source="csr")
    assert len(schedule_fingerprint(csr)) == 32


@pytest.mark.parametrize("with_caps", [False, True])
def test_cli_offline_mode_trains_a_schedule_file(tmp_path, with_caps):
    """offline mode on a schedule JSON, with caps or hand-made without: the same micro-batches either way; a
    pipeline's buffer is the caps when the file has them, else the tightest that holds its micro-batches."""
    from omnibal.cli import main
    from omnibal.stats.io import load_stats
    from omnibal.train.feed import Buffer, fixed_buffer, load_schedule

    stats_path = _stats_file(tmp_path)
    stats = load_stats(stats_path)
    packs = pack_schedule(stats, dp_size=1, num_microbatches=2, num_steps=2)
    doc = plain_schedule_doc(packs)
    # bound to the statistics it was made for; the rows it does not train are listed as left out on purpose
    doc["stats_fingerprint"] = stats.fingerprint()
    used = {i for step in doc["steps"] for rank in step for mb in rank for i in mb}
    doc["dropped"] = sorted(set(range(len(stats))) - used)
    if with_caps:
        doc["caps"] = {"tiles": 12, "tokens": 4096}
    sched_path = tmp_path / "sched.json"
    sched_path.write_text(json.dumps(doc))
    loaded = load_schedule(sched_path)
    assert all(np.array_equal(loaded.microbatch(s, 0, k), packs.microbatch(s, 0, k))
               for s in range(2) for k in range(2))
    tight = buffer_shape(packs, stats.tiles, stats.tokens, pad_to_longest=False)
    assert fixed_buffer(loaded, stats, mode="offline") == (Buffer(12, 4096) if with_caps else Buffer(*tight))
    assert (loaded.caps is None) == (not with_caps)
    rc = main(["train", "--mode", "offline", "--stats", str(stats_path), "--schedule-file", str(sched_path),
               "--steps", "2", "--microbatches", "2", "--summary-json", str(tmp_path / "sum.json"), "--quiet"])
    assert rc == 0
    doc = json.loads((tmp_path / "sum.json").read_text())
    assert doc["summary"]["token_pad_ratio"] == 0 and doc["recompute"] == [[]]
