"""Issue 20: the trainer's inputs -- checkpoint manifest, schedule file, plan file -- and a resume that reshards.
Exactly-once is checked from the trainer's own per-sample ledger (``ledger_path`` / ``omnibal train --ledger``).

Promises (docs/guarantees.md): a manifest's fields are inside what its checksum covers and cross-checked (an
edited ``next_step`` is a corrupt checkpoint: skipped, the previous good one resumed); a schedule is bound to the
statistics it was balanced from and must schedule each of their rows once; the trainer reads plans with
``Plan.load`` only and refuses keys the format does not have; a resharded resume never ends having trained
nothing without saying so.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dist_helpers import make_trainer, tiny_dataset, tiny_plan, tiny_spec, tiny_stats
from omnibal.cli import main
from omnibal.errors import InputError
from omnibal.train import checkpoint as ckpt
from omnibal.train.distributed import local_world
from omnibal.train.ledger import final_steps, read_ledger, trained_counts
from omnibal.train.stage_layout import load_plan_layout

NAMES = [layer.name for layer in tiny_spec().layers()]
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])


# ------------------------------------------------------------------------------------ case 1: the manifest


def _run(tmp_path, steps, *, resume=False, every=2, ledger=None):
    trainer = make_trainer(local_world(), num_microbatches=2, num_steps=10, checkpoint_dir=str(tmp_path / "ck"),
                           checkpoint_every=every, lr=1e-3)
    trainer.ledger_path = str(ledger or tmp_path / "ledger.jsonl")
    if resume:
        trainer.maybe_resume()
    trainer.run(steps)
    return trainer


def _edit_manifest(root: Path, step: int, edit, *, resign: bool = False) -> None:
    path = ckpt.step_dir(root, step) / ckpt.MANIFEST
    doc = json.loads(path.read_text())
    edit(doc)
    if resign:  # a forger who recomputes the checksum: the cross-checks still hold
        doc["manifest_sha256"] = ckpt.manifest_digest(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("next_step", [9, 1000])
def test_edited_next_step_in_a_manifest_is_skipped_and_the_previous_checkpoint_resumed(tmp_path, next_step):
    """Editing ``"next_step": 6`` to 9 silently skipped steps 6-8 (exit 0, other weights); 1000 trained nothing.
    The manifest's own SHA-256 covers its fields: the edited checkpoint is corrupt, resume takes step 4, and
    the ledger shows every scheduled sample of steps 0..9 in the final model exactly once."""
    first = _run(tmp_path, 6)
    _edit_manifest(tmp_path / "ck", 6, lambda d: d["sampler"].update(next_step=next_step))
    resumed = _run(tmp_path, 10, resume=True)
    assert resumed.resumed_from == str(ckpt.step_dir(tmp_path / "ck", 4))
    assert any("step_00000006" in line and "manifest_sha256" in line for line in resumed.skipped_checkpoints)
    expected = {int(first.dataset.stats.keys[i]) for s in range(10) for k in range(2)
                for i in first.schedule.microbatch(s, 0, k)}
    counts = trained_counts(tmp_path / "ledger.jsonl")
    assert set(counts) == expected and set(counts.values()) == {1}
    assert sorted(final_steps(read_ledger(tmp_path / "ledger.jsonl"))) == list(range(10))


@pytest.mark.parametrize("forgery", ["next_step-only", "step-and-next_step", "past-the-schedule"])
def test_a_resigned_manifest_is_still_cross_checked(tmp_path, forgery):
    """A manifest whose checksum was recomputed after the edit: its step must be its folder's and the sampler's
    next_step, the stage files must hold that step, and next_step must be inside the schedule."""
    _run(tmp_path, 6)
    root = tmp_path / "ck"
    if forgery == "next_step-only":
        _edit_manifest(root, 6, lambda d: d["sampler"].update(next_step=9), resign=True)
    elif forgery == "step-and-next_step":
        _edit_manifest(root, 6, lambda d: (d.update(step=9), d["sampler"].update(next_step=9)), resign=True)
        ckpt.step_dir(root, 6).rename(ckpt.step_dir(root, 9))
    else:
        _edit_manifest(root, 6, lambda d: (d.update(step=1000), d["sampler"].update(next_step=1000)), resign=True)
        ckpt.step_dir(root, 6).rename(ckpt.step_dir(root, 1000))
    trainer = make_trainer(local_world(), num_microbatches=2, num_steps=10, checkpoint_dir=str(root))
    if forgery == "next_step-only":
        assert trainer.maybe_resume() and trainer.step == 4  # skipped as corrupt
        return
    with pytest.raises(InputError) as err:
        trainer.maybe_resume()
    assert err.value.field in ("step", "sampler.next_step"), err.value


# ------------------------------------------------------------------------------------ case 2: resharded resume


def _balanced_trainer(dp_world, stats, ckdir, ledger):
    from omnibal.data.balance import balance
    from omnibal.train.loop import Trainer
    from omnibal.train.model import VLM
    from omnibal.train.stage_layout import resolve_layout

    spec = tiny_spec()
    model = VLM(spec, seed=0)
    layout = resolve_layout([s.name for s, _ in model.chain()], pp_size=1, mode="offline")
    schedule = balance(stats, dp_size=dp_world.dp_size, num_microbatches=2)
    return Trainer(world=dp_world, model=model, layout=layout, schedule=schedule, dataset=tiny_dataset(spec, stats),
                   mode="offline", num_microbatches=2, lr=1e-3, checkpoint_dir=str(ckdir), ledger_path=str(ledger))


def _dp2_checkpoint(tmp_path, stats, next_step: int):
    """What a dp 2 run leaves at ``next_step`` (pp 1: one stage file, replicated weights), with its ledger."""
    from omnibal.data.balance import balance
    from omnibal.train.feed import schedule_fingerprint
    from omnibal.train.ledger import LedgerWriter
    from omnibal.train.reshard import balance_record

    one = _balanced_trainer(local_world(), stats, tmp_path / "ck", tmp_path / "unused.jsonl")
    old = balance(stats, dp_size=2, num_microbatches=2)
    ledger = LedgerWriter(tmp_path / "ledger.jsonl", {"resumed_at": 0})
    for s in range(next_step):
        rows = [int(i) for r in range(2) for k in range(2) for i in old.microbatch(s, r, k)]
        ledger.step(s, [int(stats.keys[i]) for i in rows], rows)
    ledger.close()
    rec = ckpt.write_stage_file(tmp_path / "ck", next_step, 0, model=one.stage_module, optimizer=one.optimizer)
    ckpt.write_manifest(tmp_path / "ck", next_step, stage_records=[rec], world={"dp_size": 2, "pp_size": 1},
                        model_id=one.model_id, stage_layers=[list(r) for r in one.layout.ranges],
                        sampler={"next_step": next_step, "schedule_fingerprint": schedule_fingerprint(old),
                                 "balance": balance_record(old)})
    return old


def test_resharded_resume_that_would_train_nothing_is_refused_and_the_rest_trains_once(tmp_path):
    """A dp 2 checkpoint at step 6 resumed on another dp size with ``--steps 6`` trained nothing (262 of 480
    samples missed, exit 0). Now: refused, naming the steps the re-balanced epoch has; ``--steps 0`` (the rest
    of the epoch) trains every remaining sample once, as the ledger shows."""
    stats = tiny_stats(160)
    old = _dp2_checkpoint(tmp_path, stats, 6)
    trainer = _balanced_trainer(local_world(), stats, tmp_path / "ck", tmp_path / "ledger.jsonl")
    assert trainer.maybe_resume(reshard=True) and trainer.resharded and trainer.step == 6
    with pytest.raises(InputError, match="leaves nothing to train") as err:
        trainer.run(6)
    assert err.value.field == "num_steps"
    trainer.run(0)
    assert trainer.step == trainer.schedule.num_steps
    counts = trained_counts(tmp_path / "ledger.jsonl")
    expected = {int(stats.keys[i]) for i in np.flatnonzero(old.sample_counts() > 0)}
    assert set(counts) == expected and set(counts.values()) == {1}


def test_cli_resume_prints_where_it_resumed(tmp_path, capsys):
    """Issue 20, case 13: a successful ``--resume`` printed no "resumed from" line."""
    stats = tmp_path / "s.jsonl"
    assert main(["stats", "--synthetic", "64", "--out", str(stats), "--quiet"]) == 0
    base = ["train", "--stats", str(stats), "--microbatches", "1", "--checkpoint-dir", str(tmp_path / "ck"),
            "--checkpoint-every", "1", "--max-samples", "32"]
    assert main(base + ["--steps", "1", "--quiet"]) == 0
    capsys.readouterr()
    assert main(base + ["--steps", "2", "--resume"]) == 0
    assert f"resumed from {ckpt.step_dir(tmp_path / 'ck', 1)} at step 1" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ case 3: schedule binding


def _stats(path: Path, n: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    tiles = rng.integers(1, 3, n)
    path.write_text("".join(json.dumps({"key": i, "tiles": int(t), "tokens": int(t * 256 + rng.integers(20, 200)),
                                        "images": 1}) + "\n" for i, t in enumerate(tiles)))
    return path


def test_schedule_balanced_from_other_stats_is_refused(tmp_path, capsys):
    """``omnibal train --stats s480 --schedule-file <balanced for a 240-row file>`` trained 240 of 480 rows, exit 0:
    a schedule is bound to the fingerprint of the statistics it was balanced from."""
    big, small = _stats(tmp_path / "s480.jsonl", 480), _stats(tmp_path / "s240.jsonl", 240, seed=1)
    sched = tmp_path / "sched.json"
    assert main(["balance", "--stats", str(small), "--dp", "1", "--microbatches", "2", "--out", str(sched),
                 "--quiet"]) == 0
    rc = main(["train", "--stats", str(big), "--schedule-file", str(sched), "--microbatches", "2", "--steps", "1",
               "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "stats_fingerprint" in err and str(sched) in err
    # the same schedule with the statistics it was made from is accepted
    assert main(["train", "--stats", str(small), "--schedule-file", str(sched), "--microbatches", "2", "--steps", "1",
                 "--quiet"]) == 0


@pytest.mark.parametrize("edit", ["duplicate-row", "missing-row", "empty-microbatch", "no-fingerprint",
                                  "misspelt-key"])
def test_schedule_must_schedule_each_row_once(tmp_path, capsys, edit):
    stats = _stats(tmp_path / "s.jsonl", 100)
    sched = tmp_path / "sched.json"
    assert main(["balance", "--stats", str(stats), "--dp", "1", "--microbatches", "2", "--out", str(sched),
                 "--quiet"]) == 0
    doc = json.loads(sched.read_text())
    first = doc["steps"][0][0]
    if edit == "duplicate-row":
        first[0].append(first[1][0])
    elif edit == "missing-row":
        first[1].pop() if len(first[1]) > 1 else first[0].pop()
    elif edit == "empty-microbatch":
        first[1].clear()
    elif edit == "no-fingerprint":
        del doc["stats_fingerprint"]
    else:
        doc["droped"] = doc.pop("dropped")
    sched.write_text(json.dumps(doc))
    assert main(["train", "--stats", str(stats), "--schedule-file", str(sched), "--microbatches", "2", "--steps", "1",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert str(sched) in err and "Traceback" not in err


_SCHEDULE_TEXT: list[str] = []


def _good_schedule() -> str:
    if not _SCHEDULE_TEXT:
        from omnibal.data.balance import balance

        _SCHEDULE_TEXT.append(balance(tiny_stats(40), dp_size=2, num_microbatches=2).to_json())
    return _SCHEDULE_TEXT[0]


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=4),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids, max_size=2),
                     max_leaves=6)


def _mutate(doc, path: list[int], value, delete: bool):
    """Replace (or delete) the node that ``path`` walks to (indices taken modulo each container's size)."""
    node = doc
    for depth, k in enumerate(path):
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys:
            return doc
        key = keys[k % len(keys)]
        child = node[key]
        if depth == len(path) - 1 or not isinstance(child, (dict, list)) or not child:
            if delete:
                node.pop(key) if isinstance(node, dict) else node.pop(key)
            else:
                node[key] = value
            return doc
        node = child
    return doc


@FUZZ
@given(path=st.lists(st.integers(0, 50), min_size=1, max_size=6), value=_JSON, delete=st.booleans(),
       cut=st.none() | st.integers(0, 10**6), byte=st.none() | st.binary(min_size=1, max_size=2))
def test_any_schedule_file_loads_or_is_refused_by_name(tmp_path_factory, path, value, delete, cut, byte):
    """Fuzzing the trainer's schedule reader (issue 20): a mutated ``omnibal balance`` file either loads into a
    schedule whose micro-batches are non-empty lists of rows inside the statistics, scheduled once each, or is
    refused with an InputError naming the file; never another exception."""
    from omnibal.train.feed import check_schedule_covers, load_schedule

    stats = tiny_stats(40)
    text = json.dumps(_mutate(json.loads(_good_schedule()), path, value, delete)).encode()
    if cut is not None:
        text = text[: cut % (len(text) + 1)]
    if byte is not None:
        text = text[: len(text) // 2] + byte + text[len(text) // 2:]
    f = tmp_path_factory.mktemp("sched") / "s.json"
    f.write_bytes(text)
    try:
        schedule = load_schedule(f)
        check_schedule_covers(schedule, stats_fingerprint=stats.fingerprint(), num_samples=len(stats), source=str(f))
    except InputError as exc:
        assert str(f) in str(exc)
        return
    rows = [int(i) for s in range(schedule.num_steps) for r in range(schedule.dp_size)
            for k in range(schedule.num_microbatches) for i in schedule.microbatch(s, r, k)]
    assert all(0 <= i < len(stats) for i in rows) and len(set(rows)) == len(rows)


# ------------------------------------------------------------------------------------ case 10: the plan reader


def _tiny_preset_names() -> list[str]:
    from omnibal.cost.presets import get_model_preset

    return [layer.name for layer in get_model_preset("tiny").layers()]


def _plan_file(tmp_path, edit=None, raw: bytes | None = None) -> Path:
    """A plan for the ``tiny`` preset (what ``omnibal train --model tiny`` builds), edited."""
    names = _tiny_preset_names()
    doc = json.loads(tiny_plan([(0, 3), (3, len(names))], [["vision.blocks.0"], []], model="tiny",
                               names=names).to_json())
    if edit is not None:
        edit(doc)
    path = tmp_path / "plan.json"
    path.write_bytes(raw if raw is not None else json.dumps(doc).encode())
    return path


def _set(path, value):
    def edit(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


def _rename(path, new):
    def edit(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[new] = node.pop(path[-1])
    return edit


PLAN_CASES = {
    "byte-0xff": dict(raw=b'{"format": "omnibal.plan", \xff}'),
    "recompute-5": dict(edit=_set(["stages", 0, "recompute"], 5)),
    "recompute-null": dict(edit=_set(["stages", 0, "recompute"], None)),
    "modules-5": dict(edit=_set(["stages", 1, "modules"], 5)),
    "stage-index--1": dict(edit=_set(["stages", 1, "stage"], -1)),
    "pp_size--2": dict(edit=_set(["inputs", "pp_size"], -2)),
    "time-NaN": dict(raw=None, edit=_set(["stages", 0, "compute_time_s"], float("nan"))),
    "misspelt-recompute": dict(edit=_rename(["stages", 0, "recompute"], "recomptue")),
    "unknown-top-key": dict(edit=_set(["recompute_all"], True)),
    "unknown-stage-key": dict(edit=_set(["stages", 1, "checkpoint"], ["llm.blocks.0"])),
    "unknown-inputs-key": dict(edit=_set(["inputs", "dp"], 2)),
    "top-model-differs": dict(edit=_set(["model"], "other")),
    "inputs-model-differs": dict(edit=lambda d: (d["inputs"].update(model="other"), d.update(model="other"))),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_trainer_plan_reader_refuses_what_plan_load_refuses_and_unknown_keys(tmp_path, capsys, case):
    """``omnibal train --plan`` had its own loose reader: a 0xff byte gave a UnicodeDecodeError, ``"recompute": 5``
    / ``null`` and ``"modules": 5`` TypeErrors; a stage index of -1, ``pp_size`` -2 and a NaN time were trained;
    a misspelt ``recompute`` meant no recompute. Now: ``Plan.load`` plus a refusal of unknown keys, an InputError
    naming the plan file (exit 2 from the CLI, before any rank starts)."""
    names = _tiny_preset_names()
    good = load_plan_layout(_plan_file(tmp_path), names, pp_size=2, model_name="tiny")
    assert good.recompute == (("vision.blocks.0",), ())
    path = _plan_file(tmp_path, **PLAN_CASES[case])
    with pytest.raises(InputError) as err:
        load_plan_layout(path, names, pp_size=2, model_name="tiny")
    assert str(path) in str(err.value)
    stats = _stats(tmp_path / "s.jsonl", 64)
    rc = main(["train", "--stats", str(stats), "--pp", "2", "--plan", str(path), "--model", "tiny", "--quiet"])
    err_text = capsys.readouterr().err
    assert rc == 2 and str(path) in err_text and "Traceback" not in err_text


@FUZZ
@given(path=st.lists(st.integers(0, 50), min_size=1, max_size=5), value=_JSON, delete=st.booleans(),
       cut=st.none() | st.integers(0, 10**6))
def test_trainer_plan_reader_agrees_with_plan_load_on_fuzzed_plans(tmp_path_factory, path, value, delete, cut):
    """Pinned against ``Plan.load`` (issue 20): on any mutated plan, what ``Plan.load`` refuses the trainer
    refuses; what the trainer accepts has exactly the plan's stage ranges and recompute sets."""
    from omnibal.plan.plan import Plan

    good = json.loads(tiny_plan([(0, 3), (3, 8)], [["vision.blocks.0"], ["llm.blocks.1"]]).to_json())
    text = json.dumps(_mutate(good, path, value, delete)).encode()
    if cut is not None:
        text = text[: cut % (len(text) + 1)]
    f = tmp_path_factory.mktemp("plan") / "plan.json"
    f.write_bytes(text)
    try:
        plan = Plan.load(f)
    except InputError:
        plan = None
    try:
        layout = load_plan_layout(f, NAMES, pp_size=2, model_name="dist-test-tiny")
    except InputError as exc:
        assert str(f) in str(exc)
        return
    assert plan is not None, "the trainer accepted a plan Plan.load refuses"
    assert [list(r) for r in layout.ranges] == [list(s.layers) for s in plan.stages]
    assert [list(r) for r in layout.recompute] == [list(s.recompute) for s in plan.stages]
def test_train_bad_output_paths_fail_before_training(tmp_path, capsys):
    """``train --checkpoint-dir`` under a file failed only after training; every output path is checked first."""
    stats = _stats(tmp_path / "s.jsonl", 120)
    (tmp_path / "afile").write_text("x")
    base = ["train", "--stats", str(stats), "--steps", "1", "--quiet", "--microbatches", "1"]
    for flag in ("--checkpoint-dir", "--log", "--summary-json", "--ledger"):
        t0 = time.monotonic()
        assert main(base + [flag, str(tmp_path / "afile" / "sub")]) == 2
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err
        assert time.monotonic() - t0 < 30


# ------------------------------------------------------------------------------------ case 12: under torchrun


def test_every_train_option_passes_through_torchrun_as_documented():
    """``torchrun ... -m omnibal train ... --log x.jsonl`` failed: torchrun's ``--log-dir``/``--logs-specs`` make
    ``--log`` ambiguous to its parser, although docs/train.md says torchrun takes the same arguments. Every
    option of ``omnibal train`` (``--nproc`` aside: torchrun starts the ranks) has a spelling torchrun passes
    through untouched, and the torchrun lines of docs/train.md parse."""
    import argparse
    import shlex

    from torch.distributed.run import get_args_parser

    from omnibal.cli import train as cli_train

    torchrun = get_args_parser()
    ours = argparse.ArgumentParser()
    cli_train.add_arguments(ours)
    for action in ours._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest in ("help", "nproc"):
            continue
        value = [] if action.nargs == 0 else ["v"]
        passed = torchrun.parse_args(["--nproc-per-node", "2", "-m", "omnibal", "train", longs[0], *value])
        assert passed.training_script_args == ["train", longs[0], *value], longs[0]
    assert ours.parse_args(["--metrics-log", "x.jsonl"]).log_path == "x.jsonl"
    assert ours.parse_args(["--log", "x.jsonl"]).log_path == "x.jsonl"  # omnibal train still takes --log
    docs = (Path(__file__).resolve().parents[1] / "docs" / "train.md").read_text()
    lines = [ln.split("#")[0].strip().rstrip("\\").strip() for ln in docs.splitlines() if ln.startswith("torchrun ")]
    assert lines and any("--metrics-log" in ln for ln in lines)
    for line in lines:
        args = [a for a in shlex.split(line)[1:] if a != "..."]
        passed = torchrun.parse_args(args)
        assert passed.module and passed.training_script == "omnibal" and passed.training_script_args[0] == "train"
        ours.parse_args(passed.training_script_args[1:])
