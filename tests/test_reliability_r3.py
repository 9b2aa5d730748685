"""Issue 31 ("Reliability, third round"): notices about the data under ``--quiet``, a sample that cannot be
built under ``--on-error``, resume and reshard for every schedule kind the trainer runs, the HF Trainer's
resume from the newest complete checkpoint, and every input path checked before any rank starts.

The reproductions of the issue are the test inputs."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from dist_helpers import make_trainer
from omnibal.cli import main
from omnibal.errors import InputError
from omnibal.stats.io import save_stats
from omnibal.stats.table import SampleStats
from omnibal.train.distributed import local_world
from omnibal.train.ledger import trained_counts


@pytest.fixture(scope="module")
def stats480(tmp_path_factory) -> Path:
    """480 rows of 1-3 tiles and 16-95 text tokens: what these tests check (resume, reshard, notices, refusals)
    does not depend on the shapes, and short rows keep each training step of the tiny model short."""
    rng = np.random.default_rng(0)
    tiles = rng.integers(1, 4, 480)
    stats = SampleStats.from_arrays(tiles=tiles, tokens=tiles * 256 + rng.integers(16, 96, 480), source="r3")
    return save_stats(stats, tmp_path_factory.mktemp("r3") / "s.jsonl")


# ------------------------------------------------------------------------------------ item 1: --quiet


class _Failing:
    """A dataset whose rows in ``bad`` cannot be built (as a truncated image is found only when decoded)."""

    def __init__(self, inner, bad) -> None:
        self.inner, self.bad = inner, set(bad)
        self.stats = inner.stats

    def __len__(self) -> int:
        return len(self.inner)

    def key(self, i: int) -> int:
        return 1000 + i

    def __getitem__(self, i: int) -> dict:
        if i in self.bad:
            raise InputError("unreadable image x.png: image file is truncated", source="ann.jsonl",
                             record=f"line {i + 1}", field="image")
        return self.inner[i]


def test_a_sample_that_cannot_be_built_follows_on_error(tmp_path):
    """A truncated image (its header passes the statistics) stopped a ``--on-error skip`` run. Now it is skipped,
    said once by the rank that read it, listed in ``skipped_samples``, kept out of the ledger; a micro-batch
    whose every sample was skipped runs as a pack that trains nothing. ``raise`` still stops the run, naming
    the step and the record."""
    trainer = make_trainer(local_world(), num_microbatches=2, num_steps=3)
    first = [int(i) for i in trainer.schedule.microbatch(0, 0, 1)]  # a whole micro-batch
    other = int(trainer.schedule.microbatch(1, 0, 0)[0])
    bad = first + [other]
    said: list[str] = []
    trainer.dataset = _Failing(trainer.dataset, bad)
    trainer.reader.dataset, trainer.reader.on_error, trainer.reader.warn = trainer.dataset, "skip", said.append
    trainer.ledger_path = str(tmp_path / "ledger.jsonl")
    trainer.run(3)
    assert sorted(s["index"] for s in trainer.skipped_samples) == sorted(bad)
    assert all("image file is truncated" in s["error"] and s["key"] == 1000 + s["index"]
               for s in trainer.skipped_samples)
    assert len(said) == len(bad) and all("skipped sample" in line and "--on-error skip" in line for line in said)
    counts = trained_counts(trainer.ledger_path)
    assert not set(counts) & {1000 + i for i in bad}  # keys of skipped rows never in the ledger
    trained = [i for step in trainer.consumed for i in step]
    assert not set(trained) & set(bad) and len(trained) == len(set(trained))

    strict = make_trainer(local_world(), num_microbatches=2, num_steps=3)
    strict.dataset = strict.reader.dataset = _Failing(strict.dataset, [other])
    with pytest.raises(InputError, match="step 1, dp rank 0, micro-batch 0: unreadable image") as err:
        strict.run(3)
    assert err.value.record == f"line {other + 1}"


@pytest.mark.multiprocess
def test_quiet_still_says_what_a_resharded_resume_leaves_untrained(stats480, tmp_path, capfd):
    """``train --dp 4 --resume --reshard --steps 7 --quiet`` exited 0 with 224 of 480 samples untrained and
    printed nothing. ``--quiet`` hides progress and tables only: the notice reaches stderr and the summary."""
    ck = tmp_path / "ck"
    base = ["train", "--stats", str(stats480), "--checkpoint-dir", str(ck), "--quiet"]
    assert main([*base, "--steps", "3", "--checkpoint-every", "1"]) == 0
    shutil.rmtree(ck / "step_00000001")
    (ck / "step_00000003" / "stage_0.pt").write_bytes(b"corrupt")  # a checkpoint skipped as corrupt
    capfd.readouterr()
    summary = tmp_path / "summary.json"
    assert main([*base, "--dp", "2", "--steps", "5", "--resume", "--reshard", "--summary-json",
                 str(summary)]) == 0
    out, err = capfd.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert any(line.startswith("omnibal train: skipped corrupt checkpoint: ") and "step_00000003" in line
               for line in lines), err
    assert any("resumed from" in line and "step_00000002" in line for line in lines), err
    untrained = [line for line in lines if "are not trained" in line]
    assert len(untrained) == 1 and "stopping at step 5 of the re-balanced epoch" in untrained[0], err
    doc = json.loads(summary.read_text())
    assert untrained[0].removeprefix("omnibal train: ") in doc["notices"]
    assert any("step_00000003" in line for line in doc["skipped_checkpoints"])
    assert any("skipped corrupt checkpoint" in n for n in doc["notices"])


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    """The real example (annotations, images, tokenizer, a tiny Llava), made once."""
    pytest.importorskip("transformers")
    from omnibal.examples.real_example import make_real_example

    root = tmp_path_factory.mktemp("example")
    make_real_example(root, num_records=48, seed=0)
    return root


def _image_of(root: Path, line: int) -> Path:
    record = json.loads((root / "annotations.jsonl").read_text().splitlines()[line])
    return root / "images" / record["image"]


def _copy_example(example: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ex"
    shutil.copytree(example, root)
    return root


def test_quiet_on_error_skip_reports_every_skipped_record_and_sample(example, tmp_path, capfd):
    """``--on-error skip --quiet --summary-json S`` skipped a record with a corrupt image and neither stderr nor
    the summary said so; a truncated image (its header readable) stopped the run instead of being skipped."""
    root = _copy_example(example, tmp_path)
    _image_of(root, 2).write_bytes(b"not an image at all")  # the statistics skip this record
    truncated = _image_of(root, 0)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) * 6 // 10])  # the header passes; decoding in a step fails
    summary, ledger = tmp_path / "summary.json", tmp_path / "ledger.jsonl"
    code = main(["train", "--annotations", str(root / "annotations.jsonl"), "--image-root", str(root / "images"),
                 "--tokenizer", str(root / "tokenizer"), "--hf-model", str(root / "llava"), "--microbatches", "1",
                 "--steps", "0", "--on-error", "skip", "--quiet", "--summary-json", str(summary),
                 "--ledger", str(ledger)])
    out, err = capfd.readouterr()
    assert code == 0 and out == "", err
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].startswith("omnibal train: skipped record (--on-error skip): ") and "line 3" in lines[0]
    assert "skipped sample" in lines[1] and "line 1" in lines[1] and "image file is truncated" in lines[1]
    doc = json.loads(summary.read_text())
    assert doc["notices"] == [lines[0].removeprefix("omnibal train: ")]
    assert [s["error"] for s in doc["skipped_samples"]] == [lines[1].split("(--on-error skip): ", 1)[1]]
    assert sum(trained_counts(ledger).values()) == 46  # 48 records, 2 skipped, every other one once
    assert set(Counter(trained_counts(ledger)).values()) == {1}


# ------------------------------------------------------------------------------------ item 6: inputs, outputs


def _limited(limit: int):
    """A child whose files cannot grow past ``limit`` bytes (what a full disk does to a write: it fails with
    no file name; ``EFBIG`` here, ``ENOSPC`` there)."""
    import resource

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.multiprocess)])
def test_a_full_disk_names_the_file_and_leaves_nothing_half_written(stats480, tmp_path, dp):
    """A full disk while a checkpoint was written named no path (an OSError traceback, and from the ranks their
    peers' tracebacks first). Now one line naming the file first, exit 2, no partial file, no empty step folder,
    and the ranks' failure lines have no traceback."""
    import subprocess
    import sys

    from test_train_output import ENV

    ck = tmp_path / "ck"
    proc = subprocess.run([sys.executable, "-m", "omnibal", "train", "--stats", str(stats480), "--dp", str(dp),
                           "--steps", "1", "--checkpoint-dir", str(ck), "--quiet", "--timeout", "10"], env=ENV,
                          capture_output=True, text=True, timeout=300, preexec_fn=_limited(1 << 20))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert str(ck / "step_00000001" / "stage_0.pt") in lines[0] and "File too large" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and len(lines) == dp, proc.stderr
    assert not ck.exists() or not any(ck.iterdir())


@pytest.mark.parametrize("where", ["/proc/omnibal-x", "loop", "loop/sub", "dangling"])
def test_output_folders_that_cannot_be_written_are_refused_before_any_work(stats480, tmp_path, capsys,
                                                                         monkeypatch, where):
    """``--save-dir /proc/x`` failed after 88 s of training naming a temporary path, a symlink loop after the
    ledger and metrics were written: both now fail before any work, one line naming the flag and the path."""
    monkeypatch.chdir(tmp_path)
    Path("loop").symlink_to("loop")
    Path("dangling").symlink_to("nowhere/x")
    for flag in ("--checkpoint-dir", "--metrics-log"):
        code = main(["train", "--stats", str(stats480), "--steps", "1", "--ledger", "ledger.jsonl", flag, where])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and where in err and flag in err, err
        assert not Path("ledger.jsonl").exists()


def test_a_cut_short_hf_checkpoint_is_one_line_before_any_rank_starts(example, tmp_path, capsys):
    """``--hf-model`` with a truncated ``model.safetensors``: a SafetensorError traceback, exit 1."""
    root = _copy_example(example, tmp_path)
    weights = root / "llava" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    code = main(["train", "--annotations", str(root / "annotations.jsonl"), "--tokenizer", str(root / "tokenizer"),
                 "--hf-model", str(root / "llava"), "--dp", "2", "--steps", "1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(weights) in err and "truncated" in err, err
    weights.unlink()
    assert main(["train", "--annotations", str(root / "annotations.jsonl"), "--tokenizer", str(root / "tokenizer"),
                 "--hf-model", str(root / "llava"), "--steps", "1", "--quiet"]) == 2
    assert "no weights" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1e-300", "0.01"])
def test_balance_with_a_target_no_schedule_can_have_is_a_named_error(stats480, tmp_path, capsys, value):
    """``balance --target-samples 1e-300``: a ValueError traceback (the cap search tried ~1e302 steps)."""
    out = tmp_path / "b.json"
    assert main(["balance", "--stats", str(stats480), "--dp", "2", "--target-samples", value, "--out", str(out),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--target-samples" in err and "0.125" in err and not out.exists(), err


# ------------------------------------------------------------------------------------ the old launch module


def test_the_old_launch_module_is_gone():
    """``-m omnibal.train`` was kept for one release as a deprecated spelling of ``-m omnibal train``; it is
    removed (CHANGELOG.md), so nothing answers to it."""
    import importlib.util

    assert importlib.util.find_spec("omnibal.train.__main__") is None


# ------------------------------------------------------------------------------------ item 5: HF Trainer resume


def test_hf_trainer_resumes_from_the_newest_complete_checkpoint(tmp_path, capfd):
    """A SIGKILL inside the Trainer's save leaves the newest ``checkpoint-N`` without weights: every rank raised
    "Can't find a valid checkpoint" with a traceback. ``train(resume_from_checkpoint=True)`` now takes the
    newest complete folder, names the ones it skipped (and what they lack), and the run ends as an uninterrupted
    one: the same losses, every sample once per epoch. A folder given by name must be complete."""
    pytest.importorskip("transformers")
    from hf_trainer_worker import run, varied_stats
    from test_hf_integration import _ledger, _losses, _per_epoch_counts, _steps_per_epoch

    common = ["--samples=16", "--save-steps=1", "--epochs=2"]
    steps = _steps_per_epoch(varied_stats(16, tokens_per_tile=16), world=1)
    run([f"--out={tmp_path / 'full'}", *common])
    part = tmp_path / "part"
    run([f"--out={part}", f"--stop-at={steps + 2}", *common])
    (part / f"checkpoint-{steps + 2}" / "model.safetensors").unlink()  # killed inside save_model
    (part / f"checkpoint-{steps + 1}" / "omnibal_sampler_rank0.json").unlink()  # killed before the callbacks
    broken = tmp_path / "broken"
    shutil.copytree(part / f"checkpoint-{steps + 2}", broken)
    first = _ledger(part)
    capfd.readouterr()
    trainer = run([f"--out={part}", "--resume=latest", *common])
    err = capfd.readouterr().err
    assert [line.split(":")[0] for line in trainer.skipped_checkpoints] == [
        f"skipped incomplete checkpoint {part / f'checkpoint-{steps + 2}'}",
        f"skipped incomplete checkpoint {part / f'checkpoint-{steps + 1}'}"]
    assert "no weights" in trainer.skipped_checkpoints[0] and "sampler state" in trainer.skipped_checkpoints[1]
    assert all(f"OmnibalTrainer: {line}" in err for line in trainer.skipped_checkpoints)
    assert "Traceback" not in err
    from omnibal.train.ledger import read_ledger

    starts = [e["resumed_at"] for e in read_ledger(part / "ledger-rank0.jsonl") if e["event"] == "start"]
    assert starts == [0, steps]  # the resumed run replaces what the first logged from `steps` on
    final = _ledger(part)
    kept = [rec for rec in first if rec["step"] < steps]  # what the checkpoint of step `steps` holds
    assert final[:len(kept)] == kept and final == _ledger(tmp_path / "full")
    assert all(set(c.values()) == {1} and len(c) == 16 for c in _per_epoch_counts(final).values())
    assert _losses(part, after=steps) == pytest.approx(_losses(tmp_path / "full", after=steps), rel=1e-5)
    with pytest.raises(InputError, match="not a complete checkpoint: no weights") as err:
        run([f"--out={tmp_path / 'other'}", f"--resume={broken}", *common])
    assert err.value.field == "resume_from_checkpoint"


# ------------------------------------------------------------------------------------ item 4: resume and reshard


def _counts(ledger: Path) -> Counter:
    return Counter(trained_counts(ledger).values())


@pytest.fixture(scope="module")
def hbp_run(tmp_path_factory) -> dict:
    """A two-level schedule file for dp 2 (1024 tokens at SP 1, 4096 at SP 2, micro-batches per level by tokens:
    what ``plan --hbp`` writes as ``hbp_schedule.json``), trained 3 steps at dp 2 with a checkpoint per step."""
    import numpy as np

    from omnibal.hbp.balance import balance_hbp
    from omnibal.hbp.levels import HBPConfig, LevelCostModel
    from omnibal.stats.io import load_stats, save_stats
    from omnibal.stats.table import SampleStats

    root = tmp_path_factory.mktemp("hbp")
    rng = np.random.default_rng(0)
    tiles = rng.integers(1, 3, 120)
    tokens = np.where(rng.random(120) < 0.25, rng.integers(900, 1800, 120), tiles * 256 + rng.integers(20, 120, 120))
    stats = save_stats(SampleStats.from_arrays(tiles=tiles, tokens=tokens, source="hbp-r3"), root / "s.jsonl")
    config = HBPConfig(model=LevelCostModel(sp_degrees=(1, 2), a2a_per_token=(0.0, 0.0)), pack_lengths=(1024, 4096),
                       level_sp=(1, 2), microbatches="tokens")
    sched = balance_hbp(load_stats(stats), dp_size=2, num_microbatches=2, seed=0, config=config)
    assert sched.level_sp == (1, 2) and sched.level_microbatches == (4, 2)
    sched.to_json(root / "hbp.json")
    base = ["train", "--stats", str(stats), "--schedule-file", str(root / "hbp.json"), "--microbatches", "4",
            "--quiet", "--checkpoint-every", "1"]
    assert main([*base, "--dp", "2", "--steps", "3", "--checkpoint-dir", str(root / "ck"), "--ledger",
                 str(root / "ledger.jsonl")]) == 0
    return {"root": root, "base": base, "steps": sched.num_steps}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("dp", [1, 3])
def test_an_hbp_schedule_resumes_on_another_dp_size_exactly_once(hbp_run, tmp_path, capfd, dp):
    """``plan --hbp``'s schedule file, trained at dp 2, then ``--dp 1`` or ``--dp 3 --resume --reshard``: "schedule
    is for dp_size 2", though the README promises a resume on another DP size. The untrained rows are balanced
    again at the file's levels for the new world (the SP 2 level at SP 1: said), and every row of the epoch is
    trained once. Resharding the resharded run again (back to dp 2, from its checkpoint's record) too."""
    ck, ledger = tmp_path / "ck", tmp_path / "ledger.jsonl"
    shutil.copytree(hbp_run["root"] / "ck", ck)
    shutil.copy(hbp_run["root"] / "ledger.jsonl", ledger)
    run = [*hbp_run["base"], "--checkpoint-dir", str(ck), "--ledger", str(ledger), "--resume", "--reshard"]
    capfd.readouterr()
    assert main([*run, "--dp", str(dp), "--steps", "5" if dp == 3 else "0"]) == 0
    err = capfd.readouterr().err
    assert f"the rest of the epoch re-balanced for dp {dp}" in err, err
    assert "the level of 4096 tokens runs at SP 1 (was 2)" in err, err
    if dp == 3:  # stopped inside the re-balanced epoch: the rest, from the checkpoint's record, at dp 2
        assert main([*run, "--dp", "2", "--steps", "0"]) == 0
        assert "resumed from" in capfd.readouterr().err
    assert _counts(ledger) == Counter({1: 120})


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["baseline", "online"])
def test_random_microbatches_reshard_exactly_once(stats480, tmp_path, capfd, mode):
    """``--reshard`` in online mode was refused "not the balancer's schedule, or written by an older omnibal". The
    checkpoint now records how its random micro-batches were drawn: dp 2 -> 3 -> 1 finishes the epoch with every
    drawn sample once; what does not fill a last step is said, never silent."""
    ck, ledger = tmp_path / "ck", tmp_path / "ledger.jsonl"
    base = ["train", "--stats", str(stats480), "--mode", mode, "--microbatches", "2", "--batch-size", "4", "--quiet",
            "--checkpoint-dir", str(ck), "--ledger", str(ledger), "--checkpoint-every", "1"]
    assert main([*base, "--dp", "2", "--steps", "5"]) == 0
    assert main([*base, "--dp", "3", "--steps", "12", "--resume", "--reshard"]) == 0
    assert main([*base, "--dp", "1", "--steps", "0", "--resume", "--reshard"]) == 0
    err = capfd.readouterr().err
    said = sum(int(line.split()[2]) for line in err.splitlines() if "of the rest of the epoch do not fill" in line)
    assert said == (1 if mode == "online" else 0), err
    assert _counts(ledger) == Counter({1: 480 - said}), err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_balanced_schedule_file_for_another_dp_size_reshards_and_a_hand_made_one_is_refused(stats480, tmp_path,
                                                                                            capsys):
    """A ``--schedule-file`` of ``omnibal balance --dp 2`` resumed with ``--dp 1 --resume --reshard`` was refused
    ("schedule is for dp_size 2"): it finishes the epoch once. A hand-made file records nothing to re-balance
    with: one line saying so."""
    import json as _json

    sched, ck, ledger = tmp_path / "sched.json", tmp_path / "ck", tmp_path / "ledger.jsonl"
    assert main(["balance", "--stats", str(stats480), "--dp", "2", "--microbatches", "4", "--out", str(sched),
                 "--quiet"]) == 0
    base = ["train", "--stats", str(stats480), "--schedule-file", str(sched), "--quiet", "--checkpoint-dir", str(ck),
            "--ledger", str(ledger)]
    assert main([*base, "--dp", "2", "--steps", "3", "--checkpoint-every", "1"]) == 0
    assert main([*base, "--dp", "1", "--steps", "0", "--resume", "--reshard"]) == 0
    assert _counts(ledger) == Counter({1: 480})
    plain = tmp_path / "plain.json"
    doc = _json.loads(sched.read_text())
    steps = [[[list(map(int, mb)) for mb in rank] for rank in step] for step in doc["steps"]]
    plain.write_text(_json.dumps({"dp_size": 2, "num_microbatches": 4, "steps": steps,
                                  "stats_fingerprint": doc["stats_fingerprint"]}))
    capsys.readouterr()
    assert main(["train", "--stats", str(stats480), "--schedule-file", str(plain), "--quiet", "--dp", "1",
                 "--checkpoint-dir", str(tmp_path / "ck2"), "--resume", "--reshard"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(plain) in err and "hand-made" in err, err


def test_special_files_and_save_dirs_are_refused_before_any_rank_starts(example, tmp_path, capsys, monkeypatch):
    """A FIFO given as input blocks a reader forever; ``--save-dir`` under ``/proc`` or through a symlink loop
    failed after training. Each is one line naming the flag and path, before any work, nothing written."""
    import os

    monkeypatch.chdir(tmp_path)
    os.mkfifo("fifo")
    Path("loop").symlink_to("loop")
    common = ["--tokenizer", str(example / "tokenizer"), "--hf-model", str(example / "llava"), "--steps", "1",
              "--ledger", "ledger.jsonl", "--metrics-log", "log.jsonl"]
    assert main(["train", "--annotations", "fifo", *common]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fifo" in err and "not a regular file" in err, err
    for where in ("/proc/omnibal-x", "loop/out"):
        assert main(["train", "--annotations", str(example / "annotations.jsonl"), *common, "--save-dir", where]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and where in err and "--save-dir" in err, err
    assert not Path("ledger.jsonl").exists() and not Path("log.jsonl").exists()
