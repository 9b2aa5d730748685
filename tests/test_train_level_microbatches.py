"""The trainer on HBP schedules whose levels run their own micro-batch counts (``level_microbatches``): each
step runs exactly its count, at pp = 1 (accumulation, SP per level) and pp = 2 (one pipeline per count)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from dist_helpers import pack_schedule, plain_schedule_doc, tiny_stats
from mb_helpers import ROWS, make_ragged_trainer, ragged_schedule, rank_ragged_epoch
from omnibal.data.balance.schedule import Schedule
from omnibal.errors import InputError
from omnibal.train.distributed import local_world, spawn_local
from omnibal.train.feed import check_schedule, check_schedule_covers, load_schedule, schedule_fingerprint
from omnibal.train.feed import step_microbatches as counts_of
from sp_helpers import reference_step

COUNTS_11 = [2, 8, 8, 8, 2, 8, 8]
"""Step counts of ``ragged_schedule(1, (1, 1))``: levels of 8 and 2 micro-batches, interleaved."""


def _values(results):
    errors = [r.error for r in results if r.error]
    assert not errors, "\n".join(errors)
    return [r.value for r in results]


def _loaded(tmp_path, schedule=None):
    path = tmp_path / "hbp.json"
    (schedule or ragged_schedule(1, (1, 1))).to_json(path)
    return path, load_schedule(path)


def _assert_close(got: float, ref: float, what) -> None:
    assert abs(got - ref) <= 1e-5 * abs(ref), (what, got, ref)


def _assert_grads(parts: list[dict], ref: dict) -> None:
    """Every parameter's gradient (the stages' together) equals the reference's within 1e-5."""
    covered = set()
    for part in parts:
        for name, grad in part.items():
            err = np.linalg.norm(grad - ref[name]) / max(np.linalg.norm(ref[name]), 1e-30)
            assert err <= 1e-5, (name, err)
            covered.add(name)
    assert covered == set(ref)


# ------------------------------------------------------------------------------------------- pure


def test_ragged_file_is_read_by_the_balancers_reader_and_checked(tmp_path):
    path, sched = _loaded(tmp_path)
    assert isinstance(sched, Schedule) and sched.level_microbatches == (8, 2) and sched.num_microbatches == 8
    assert counts_of(sched).tolist() == COUNTS_11
    check_schedule(sched, dp_size=1, num_microbatches=8, num_samples=160, source=str(path), pp_size=2)
    rows = np.asarray(sched.pack_samples)
    rest = np.setdiff1d(np.arange(160), rows)
    assert len(rows) == ROWS == len(np.unique(rows))  # the filler slots add no row
    check_schedule_covers(replace(sched, dropped=rest), stats_fingerprint=tiny_stats().fingerprint(),
                          num_samples=160, source=str(path))
    with pytest.raises(InputError, match="must be the largest, 8; the run has 2") as err:
        check_schedule(sched, dp_size=1, num_microbatches=2, num_samples=160, source=str(path))
    assert err.value.field == "num_microbatches" and err.value.source == str(path)
    # 1F1B / GPipe on 4 stages cannot run the 2-micro-batch steps: named at the first such step
    with pytest.raises(InputError, match="runs 2 micro-batches per rank; 1F1B over 4 stages") as err:
        check_schedule(sched, dp_size=1, num_microbatches=8, num_samples=None, source=str(path), pp_size=4)
    assert (err.value.record, err.value.field) == ("step 0", "level_microbatches")


@pytest.mark.parametrize("counts, record, field, match", [
    ((2, 2), "step 1 rank 0 micro-batch 2", "level_microbatches", "past the 2 micro-batches step 1 runs"),
    ((8, 8), "step 0 rank 0 micro-batch 2", "steps", "empty micro-batch"),
])
@pytest.mark.parametrize("num_samples", [160, None])
def test_slots_that_disagree_with_the_counts_are_refused(tmp_path, counts, record, field, match, num_samples):
    """A slot past its step's count that holds samples (they would never train), or a run slot that is the
    empty filler, is an InputError naming the file, step, rank, slot and field -- also on a pipeline stage
    without the dataset (num_samples None). The Schedule constructor asserts the same; this is the trainer's
    own check of whatever ScheduleLike it is given."""
    path, sched = _loaded(tmp_path)
    object.__setattr__(sched, "level_microbatches", counts)  # bypass the constructor's assertion
    with pytest.raises(InputError, match=match) as err:
        check_schedule(sched, dp_size=1, num_microbatches=8, num_samples=num_samples, source=str(path))
    assert (err.value.source, err.value.record, err.value.field) == (str(path), record, field)


@pytest.mark.parametrize("caps", ["absent", None])
def test_a_level_file_without_caps_is_refused_naming_caps(tmp_path, caps):
    """Only a single-level file may leave out its caps: a multi-level one was packed to them."""
    doc = ragged_schedule(1, (1, 1)).to_dict()
    del doc["caps"]
    if caps is None:
        doc["caps"] = None
    path = tmp_path / "nocaps.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InputError, match="caps") as err:
        load_schedule(path)
    assert err.value.source == str(path) and err.value.field == "caps"


def test_fingerprint_follows_the_counts_and_keeps_single_level_ones(tmp_path):
    path, sched = _loaded(tmp_path)
    assert schedule_fingerprint(sched) == schedule_fingerprint(load_schedule(path))
    other = replace(sched, pack_ids=sched.pack_ids[::-1], levels=sched.levels[::-1])
    assert schedule_fingerprint(other) != schedule_fingerprint(sched)
    # a single-level schedule hashes as before (its checkpoints still resume): header + the CSR arrays
    single = Schedule.from_dict(_single_level_doc())
    h = hashlib.sha256(f"{single.dp_size},{single.num_microbatches},{single.num_steps}".encode())
    for arr in (single.pack_samples, single.pack_offsets, single.pack_ids):
        h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    assert schedule_fingerprint(single) == h.hexdigest()[:32]


def _single_level_doc() -> dict:
    doc = plain_schedule_doc(pack_schedule(tiny_stats(), dp_size=2, num_microbatches=2, num_steps=2))
    return doc | {"caps": {"tiles": 64, "tokens": 512}}


@pytest.fixture
def one_thread():
    """One torch thread, as the trainer's ranks use (two threads on this shared 2-core host spin ~10x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_one_process_runs_each_steps_count_and_matches_the_reference(one_thread):
    """pp = 1 (gradient accumulation): every step feeds exactly its count's micro-batches, its loss equals
    one process on those micro-batches normalised by their targets (1e-5), and the log records the count."""
    sched = ragged_schedule(1, (1, 1))
    trainer = make_ragged_trainer(local_world(), sched)
    assert trainer.step_mbs.tolist() == COUNTS_11
    for step, count in enumerate(COUNTS_11):
        result = trainer.forward_backward()
        rows = [int(i) for k in range(count) for i in sched.microbatch(step, 0, k)]
        assert result.fed == rows  # the run slots in order, nothing from the filler
        _assert_close(result.loss_sum, reference_step(sched, step)[0], step)
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.step += 1
    trainer.step = 0
    trainer.run(0)
    assert [r.microbatches for r in trainer.log.records] == COUNTS_11
    assert sum(r.samples for r in trainer.log.records) == ROWS


def test_online_mode_refuses_a_ragged_schedule():
    from dist_helpers import tiny_dataset, tiny_spec
    from omnibal.train.loop import Trainer
    from omnibal.train.model import VLM
    from omnibal.train.stage_layout import resolve_layout

    model = VLM(tiny_spec(), seed=0)
    layout = resolve_layout([s.name for s, _ in model.chain()], pp_size=1, mode="online")
    with pytest.raises(InputError, match="own micro-batch counts is for offline mode") as err:
        Trainer(world=local_world(), model=model, layout=layout, schedule=ragged_schedule(1, (1, 1)),
                dataset=tiny_dataset(tiny_spec(), tiny_stats()), mode="online", num_microbatches=8)
    assert err.value.field == "level_microbatches"


def test_cli_trains_a_ragged_schedule_file_and_names_the_count(tmp_path, capsys):
    """`omnibal train --schedule-file` of an HBP file: --microbatches must be the largest level count (said in
    the error); with it, the epoch trains every row once, each step at its own count."""
    from omnibal.cli import main
    from omnibal.hbp.balance import balance_hbp
    from omnibal.hbp.levels import HBPConfig, LevelCostModel
    from omnibal.stats.io import load_stats
    from test_trainloop import _stats_file

    stats_path = _stats_file(tmp_path)
    config = HBPConfig(model=LevelCostModel(), pack_lengths=(640, 2048), level_sp=(1, 1), microbatches="tokens")
    sched = balance_hbp(load_stats(stats_path), dp_size=1, num_microbatches=2, seed=0, config=config)
    assert sched.level_microbatches == (6, 2)
    path = tmp_path / "hbp.json"
    sched.to_json(path)
    base = ["train", "--stats", str(stats_path), "--schedule-file", str(path), "--quiet", "--steps", "0"]
    assert main(base + ["--microbatches", "2"]) == 2
    assert "levels run [6, 2] micro-batches per rank: the run's micro-batch count must be the largest, 6" in (
        capsys.readouterr().err)
    log = tmp_path / "log.jsonl"
    assert main(base + ["--microbatches", "6", "--metrics-log", str(log)]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    assert [r["microbatches"] for r in records] == sched.step_microbatches().tolist()
    assert sum(r["samples"] for r in records) == 40


# ------------------------------------------------------------------------------------------- gloo, 2 ranks

multiprocess = pytest.mark.multiprocess


@multiprocess
def test_pipeline_runs_each_count_and_matches_one_process(tmp_path):
    """pp = 2 (1F1B) on the 8/2 schedule in reverse order: one pipeline per count, switched 8 -> 2 -> 8 (one
    PipelineStage shared by both counts fails there: the 2-micro-batch schedule resizes it, "Chunk id 2 is out
    of range [0, 2)"). Every step's loss and every gradient equal one process on the micro-batches the step runs
    (1e-5); then the epoch through Trainer.run trains each row once, each step at its count."""
    from omnibal.train.ledger import trained_counts

    ledger = tmp_path / "ledger.jsonl"
    values = _values(spawn_local(rank_ragged_epoch, 2, args=(1, 2, (1, 1), None, str(ledger), False, True, True),
                                 deadline_s=120, start_method="fork"))
    sched = ragged_schedule(1, (1, 1), reverse=True)
    assert counts_of(sched).tolist() == COUNTS_11[::-1]
    assert values[0]["pipes"] == values[1]["pipes"] == [2, 8]
    for step, count in enumerate(COUNTS_11[::-1]):
        assert values[0]["steps"][step]["count"] == values[1]["steps"][step]["count"] == count
        ref_loss, ref_grads = reference_step(sched, step)
        _assert_close(sum(v["steps"][step]["loss_part"] for v in values), ref_loss, step)
        _assert_grads([v["steps"][step]["grads"] for v in values], ref_grads)
    assert [r["microbatches"] for r in values[0]["records"]] == COUNTS_11[::-1]
    counts = trained_counts(ledger)
    assert len(counts) == ROWS and set(counts.values()) == {1}


@multiprocess
def test_sp_levels_with_own_counts_match_and_resume_exactly_once(tmp_path):
    """dp = 2, levels SP 1 (4 micro-batches) and SP 2 (2): every step's loss and gradients equal one process
    on its distinct packs; the epoch with a checkpoint per step; then a crash after step 3 (later checkpoints
    gone) and a resume: the resumed steps repeat the uninterrupted losses and the ledger holds every row once."""
    from omnibal.train.ledger import read_ledger, trained_counts

    ck, ledger = tmp_path / "ck", tmp_path / "ledger.jsonl"
    full = _values(spawn_local(rank_ragged_epoch, 2, args=(2, 1, (1, 2), str(ck), str(ledger), False, True),
                               deadline_s=120, start_method="fork"))
    sched = ragged_schedule(2, (1, 2))
    counts = counts_of(sched).tolist()
    assert sorted(set(counts)) == [2, 4] and [r["microbatches"] for r in full[0]["records"]] == counts
    for step in range(sched.num_steps):
        ref_loss, ref_grads = reference_step(sched, step)
        _assert_close(sum(v["steps"][step]["loss_part"] for v in full), ref_loss, step)
        _assert_grads([v["steps"][step]["grads"] for v in full], ref_grads)
    for later in sorted(ck.glob("step_*"))[3:]:
        shutil.rmtree(later)
    resumed = _values(spawn_local(rank_ragged_epoch, 2, args=(2, 1, (1, 2), str(ck), str(ledger), True, False),
                                  deadline_s=120, start_method="fork"))
    assert resumed[0]["start"] == 3
    for old, new in zip(full[0]["records"][3:], resumed[0]["records"], strict=True):
        assert old["microbatches"] == new["microbatches"]
        assert abs(old["loss"] - new["loss"]) <= 1e-6 * abs(old["loss"]), (old, new)
    trained = trained_counts(ledger)
    assert len(trained) == ROWS and set(trained.values()) == {1}
    rows = Counter(i for e in read_ledger(ledger) if e["event"] == "step" for i in e["rows"])
    assert len(rows) == ROWS  # every row logged, by the first run or the resumed one
