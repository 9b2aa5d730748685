"""Ulysses sequence parallelism in the reference trainer: equal to the run without SP, levels, errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dist_helpers import pack_schedule, single_process_reference, tiny_stats
from omnibal.errors import InputError
from omnibal.train.distributed import local_world, spawn_local
from omnibal.train.sp import check_sp_degree, curriculum_order, expand_for_sp, pad_tokens, sp_schedule
from sp_helpers import (
    NUM_MICRO,
    level_schedule,
    make_sp_trainer,
    rank_level_grads,
    rank_level_run,
    rank_sp_step,
    reference_step,
)


def _values(results):
    errors = [r.error for r in results if r.error]
    assert not errors, "\n".join(errors)
    return [r.value for r in results]


def _assert_grads_equal(parts: list[dict], ref_grads: dict, tol: float = 1e-5) -> None:
    """The gradients every rank holds after the step (summed over all ranks by the flat all-reduce) equal
    the single-process ones."""
    for part in parts:
        assert set(part) == set(ref_grads)
        for name, grad in part.items():
            ref = ref_grads[name]
            err = np.linalg.norm(grad - ref) / max(np.linalg.norm(ref), 1e-30)
            assert err <= tol, (name, err)


# ------------------------------------------------------------------------------------------- pure logic


def test_bad_sp_degree_is_a_named_input_error():
    with pytest.raises(InputError, match="does not divide the 4 data-parallel") as err:
        check_sp_degree(3, dp_size=4, num_heads=4)
    assert err.value.field == "sp_degree" and err.value.source == "--sp-degree"
    with pytest.raises(InputError, match="does not divide the LLM's 6 attention heads"):
        check_sp_degree(4, dp_size=8, num_heads=6)
    with pytest.raises(InputError, match="positive integer"):
        check_sp_degree(0, dp_size=4, num_heads=4)
    check_sp_degree(2, dp_size=4, num_heads=4)


def test_schedule_errors_name_the_input():
    stats = tiny_stats()
    single = pack_schedule(stats, dp_size=2, num_microbatches=2, num_steps=2)
    with pytest.raises(InputError, match="balance it for 1") as err:
        expand_for_sp(single, 2, dp_size=2)
    assert err.value.field == "dp_size"
    levels = level_schedule(stats, dp_size=4, level_sp=(1, 2), levels=(0, 1))
    with pytest.raises(InputError, match="sets its own SP degrees"):
        expand_for_sp(levels, 2, dp_size=8)
    # a level whose degree does not divide the heads (the tiny LLM has 4)
    with pytest.raises(InputError, match="attention heads") as err:
        sp_schedule(levels, sp_degree=1, curriculum_epochs=0, dp_size=4, num_heads=1)
    assert err.value.field == "level_sp"
    # the trainer refuses --sp-degree that does not divide dp, before any process group is needed
    with pytest.raises(InputError, match="does not divide the 1 data-parallel"):
        make_sp_trainer(local_world(), pack_schedule(stats, dp_size=1, num_microbatches=2, num_steps=1), sp_degree=2)


def test_expand_and_curriculum():
    stats = tiny_stats()
    single = pack_schedule(stats, dp_size=2, num_microbatches=2, num_steps=2)
    wide = expand_for_sp(single, 2, dp_size=4)
    assert wide.dp_size == 4
    for r in range(4):
        assert np.array_equal(wide.microbatch(1, r, 0), single.microbatch(1, r // 2, 0))
    sched = level_schedule(stats, dp_size=4, level_sp=(1, 2, 4), levels=(2, 0, 1, 0, 2))
    ordered = curriculum_order(sched)
    assert list(ordered.step_sp()) == [1, 1, 2, 4, 4]
    assert np.array_equal(ordered.pack_ids[2], sched.pack_ids[2]) and np.array_equal(ordered.pack_ids[0],
                                                                                       sched.pack_ids[1])
    _, step_sp = sp_schedule(single, sp_degree=2, curriculum_epochs=1, dp_size=4, num_heads=4)
    assert list(step_sp) == [2, 2]
    # the curriculum covers the first epochs only: epoch 1 keeps the schedule's order
    from dataclasses import replace

    first, _ = sp_schedule(sched, sp_degree=1, curriculum_epochs=1, dp_size=4, num_heads=4)
    later, _ = sp_schedule(replace(sched, epoch=1), sp_degree=1, curriculum_epochs=1, dp_size=4, num_heads=4)
    assert list(first.step_sp()) == [1, 1, 2, 4, 4] and list(later.step_sp()) == list(sched.step_sp())


def test_warmup_runs_the_shortest_levels_steps_first_then_the_schedules_order():
    from dataclasses import replace

    from omnibal.train.sp import warmup_order

    sched = level_schedule(tiny_stats(), dp_size=4, level_sp=(1, 2, 4), levels=(2, 0, 1, 0, 2, 0))
    one = warmup_order(sched, 1)
    assert list(one.levels) == [0, 2, 1, 0, 2, 0]  # one warm-up step; the others keep their order
    two = warmup_order(sched, 2)
    assert list(two.levels) == [0, 0, 2, 1, 2, 0]
    assert np.array_equal(two.pack_ids[0], sched.pack_ids[1]) and np.array_equal(two.pack_ids[1], sched.pack_ids[3])
    assert np.array_equal(np.sort(two.pack_ids, axis=None), np.sort(sched.pack_ids, axis=None))  # every pack once
    assert list(warmup_order(sched, 99).levels) == [0, 0, 0, 2, 1, 2] and warmup_order(sched, 0) is sched
    # epoch 0 only; the curriculum, where it applies, decides the whole order
    first, _ = sp_schedule(sched, sp_degree=1, curriculum_epochs=0, dp_size=4, num_heads=4, warmup_steps=2)
    later, _ = sp_schedule(replace(sched, epoch=1), sp_degree=1, curriculum_epochs=0, dp_size=4, num_heads=4,
                           warmup_steps=2)
    assert list(first.levels) == list(two.levels) and list(later.levels) == list(sched.levels)


def test_warmup_is_a_train_option_checked_by_name():
    import argparse

    import pytest

    from omnibal.cli.train import add_arguments, train_config
    from omnibal.errors import InputError
    from omnibal.train.config import TrainConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert train_config(parser.parse_args(["--level-warmup", "500"])).level_warmup == 500
    with pytest.raises(InputError, match="level_warmup"):
        TrainConfig(level_warmup=-1).validate()


def test_pad_tokens_adds_an_ignored_segment():
    import torch

    from omnibal.data.collate import IGNORE_INDEX, META_IMAGE_INDEX, META_LABELS, META_SEGMENT_IDS

    meta = torch.arange(15).reshape(1, 5, 3)
    out = pad_tokens(meta, 5)
    assert out.shape == (1, 5, 5) and torch.equal(out[:, :, :3], meta)
    assert out[0, META_SEGMENT_IDS, 3:].tolist() == [-1, -1]
    assert out[0, META_LABELS, 3:].tolist() == [IGNORE_INDEX] * 2
    assert out[0, META_IMAGE_INDEX, 3:].tolist() == [-1, -1]


def test_a_resharded_remainder_longer_than_the_fresh_epoch_trains_without_sp():
    """Regression (dp 1 -> 2 reshard died with IndexError): the per-step SP degrees were built for the fresh
    epoch and not for the re-balanced remainder, which is numbered from the checkpoint's next step and can
    be longer. A run without SP must take every step of the schedule it runs, whatever its length."""
    stats = tiny_stats()
    trainer = make_sp_trainer(local_world(), pack_schedule(stats, dp_size=1, num_microbatches=NUM_MICRO,
                                                           num_steps=1))
    assert trainer.sp is None and len(trainer.step_sp) == 1
    longer = pack_schedule(stats, dp_size=1, num_microbatches=NUM_MICRO, num_steps=3)
    trainer._use_resharded(longer)
    assert list(trainer.step_sp) == [1, 1, 1]
    trainer.step = 2  # past the fresh epoch's single step
    record = trainer.train_step()
    assert trainer.step == 3 and record is not None and record.samples > 0


# ------------------------------------------------------------------------------------------- multi-process

multiprocess = pytest.mark.multiprocess


@multiprocess
@pytest.mark.parametrize("dp,sp,recompute", [(2, 2, False), (4, 4, False), (4, 2, True)])
def test_sp_step_matches_the_run_without_sp(dp, sp, recompute):
    """One step of --sp-degree sp over dp ranks (dp/sp groups, each pack split over its group's ranks) gives
    the loss and every gradient of one process running the same dp/sp ranks' packs, within 1e-5; with every
    layer recomputed too (the recomputed blocks exchange again in backward)."""
    values = _values(spawn_local(rank_sp_step, dp, args=(dp, sp, recompute), deadline_s=180, start_method="fork"))
    ref_loss, ref_grads = single_process_reference(dp_size=dp // sp, num_microbatches=NUM_MICRO)
    loss = sum(v["loss_part"] for v in values)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert len({v["targets"] for v in values}) == 1  # every rank normalises by the same global count
    _assert_grads_equal([v["grads"] for v in values], ref_grads)


LEVEL_SP = (1, 2, 4)
LEVELS = (2, 0, 1, 0, 2, 1)


@multiprocess
def test_levels_switch_sp_per_step_and_match_one_process():
    """A 3-level schedule (SP 1, 2, 4) on 4 ranks: every step's loss and gradients equal one process
    running that step's distinct packs (each SP group's once), normalised by that global batch's targets,
    so a level's loss is not scaled by its SP degree."""
    values = _values(spawn_local(rank_level_grads, 4, args=(4, LEVEL_SP, LEVELS, False), deadline_s=240,
                                 start_method="fork"))
    schedule = level_schedule(tiny_stats(), dp_size=4, level_sp=LEVEL_SP, levels=LEVELS)
    assert [s["degree"] for s in values[0]["steps"]] == [LEVEL_SP[lv] for lv in LEVELS]
    for step in range(len(LEVELS)):
        ref_loss, ref_grads = reference_step(schedule, step)
        loss = sum(v["steps"][step]["loss_part"] for v in values)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (step, loss, ref_loss)
        _assert_grads_equal([v["steps"][step]["grads"] for v in values], ref_grads)


@multiprocess
def test_levels_exactly_once_in_the_ledger(tmp_path):
    """The whole multi-level epoch through Trainer.run, in curriculum order: the trainer's ledger holds every
    scheduled sample exactly once (an SP group's packs counted once, not once per rank)."""
    from omnibal.train.ledger import read_ledger, trained_counts

    ledger = tmp_path / "ledger.jsonl"
    values = _values(spawn_local(rank_level_run, 4, args=(4, LEVEL_SP, LEVELS, str(ledger), True), deadline_s=240,
                                 start_method="fork"))
    counts = trained_counts(ledger)
    scheduled = values[0]["scheduled"]
    rows = Counter(i for e in read_ledger(ledger) if e.get("event") == "step" for i in e["rows"])
    assert sorted(rows) == scheduled and set(rows.values()) == {1}
    assert len(counts) == len(scheduled) and set(counts.values()) == {1}
    losses = values[0]["losses"]
    assert len(losses) == len(LEVELS) and all(np.isfinite(losses))


def test_config_and_cli_refuse_what_sp_does_not_run():
    from dataclasses import replace

    from omnibal.cli import main
    from omnibal.train.config import TRAIN_LAYOUT, TrainConfig

    assert TrainConfig(layout=replace(TRAIN_LAYOUT, dp_size=4), sp_degree=2).sp_degree == 2
    pipe = replace(TRAIN_LAYOUT, dp_size=2, pp_size=2, num_microbatches=4)
    assert TrainConfig(layout=pipe, sp_degree=2).world_size == 4  # SP inside stages
    for dp, kwargs, match in ((3, {"sp_degree": 2}, "does not divide the 3"),
                              (2, {"sp_degree": 2, "dp_sync": "ddp"}, "dp_sync flat"),
                              (2, {"sp_degree": 0}, "positive integer")):
        with pytest.raises(InputError, match=match) as err:
            TrainConfig(layout=replace(TRAIN_LAYOUT, dp_size=dp), **kwargs)
        assert err.value.field == "sp_degree"
    assert main(["train", "--dp", "3", "--sp-degree", "2", "--steps", "1", "--quiet"]) == 2


def test_exactly_once_check_counts_an_sp_group_once():
    """``omnibal train --schedule-file`` checks a file schedules every row once: a level's SP group shares its
    packs and counts once (before, every rank of a group counted and a valid HBP schedule was refused)."""
    from dataclasses import replace

    from omnibal.train.feed import check_schedule_covers

    stats = tiny_stats()
    sched = level_schedule(stats, dp_size=4, level_sp=(1, 2, 4), levels=LEVELS)
    rest = np.setdiff1d(np.arange(len(stats)), np.asarray(sched.pack_samples))
    check_schedule_covers(replace(sched, dropped=rest), stats_fingerprint=stats.fingerprint(),
                          num_samples=len(stats), source="levels")
    with pytest.raises(InputError, match="not scheduled exactly once"):
        check_schedule_covers(replace(sched, dropped=rest[1:]), stats_fingerprint=stats.fingerprint(),
                              num_samples=len(stats), source="levels")
