"""HBP inside a pipeline: a two-level schedule (SP 1 with 4 micro-batches, SP 2 with 2) on dp 2 x pp 2 gloo
ranks, each level with its own recompute set, against one process; and the epoch exactly once across a
crash and a resume."""

from __future__ import annotations

import numpy as np
import pytest

from dist_helpers import tiny_stats
from hbp_pp_helpers import (
    LEVEL_MICROBATCHES,
    LEVEL_RECOMPUTE,
    LEVEL_SELECTIVE,
    LEVEL_SP,
    LEVELS,
    SPLITS,
    hbp_schedule,
    rank_hbp_pp_run,
    rank_hbp_pp_steps,
)
from omnibal.errors import InputError
from omnibal.train.distributed import spawn_local
from sp_helpers import reference_step

multiprocess = pytest.mark.multiprocess


def _values(results):
    errors = [r.error for r in results if r.error]
    assert not errors, "\n".join(errors)
    return [r.value for r in results]


def _expected_calls(layer_names, level: int, microbatches: int) -> dict:
    """Forward calls per layer in one step: once per micro-batch, twice for a recomputed layer."""
    again = set(LEVEL_RECOMPUTE[level]) | set(LEVEL_SELECTIVE[level])
    return {n: microbatches * (2 if n in again else 1) for n in layer_names}


@multiprocess
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_hbp_levels_in_a_pipeline_match_one_process(split):
    """Every step of the two-level schedule on dp 2 x pp 2 (the SP 2 level's Ulysses group inside each
    stage): the loss and every gradient equal one process running the step's distinct packs, within 1e-5;
    each step runs its level's micro-batch count and its level's recompute set (forward calls per layer)."""
    from dist_helpers import tiny_spec

    ranges = SPLITS[split]
    values = _values(spawn_local(rank_hbp_pp_steps, 4, args=(2, 2, ranges), deadline_s=300, start_method="fork"))
    schedule = hbp_schedule(tiny_stats(), dp_size=2)
    names = [layer.name for layer in tiny_spec().layers()]
    for step, level in enumerate(LEVELS):
        ref_loss, ref_grads = reference_step(schedule, step)
        loss = sum(v["steps"][step]["loss_part"] for v in values)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (step, loss, ref_loss)
        for v in values:
            got = v["steps"][step]
            assert got["degree"] == LEVEL_SP[level] and got["microbatches"] == LEVEL_MICROBATCHES[level]
            start, end = ranges[v["pp_rank"]]
            expect = _expected_calls(names[start:end], level, LEVEL_MICROBATCHES[level])
            assert got["calls"] == expect, (step, v["rank"])
            assert set(got["grads"]) <= set(ref_grads) and got["grads"]
            for name, grad in got["grads"].items():
                ref = ref_grads[name]
                err = np.linalg.norm(grad - ref) / max(np.linalg.norm(ref), 1e-30)
                assert err <= 1e-5, (step, v["rank"], name, err)
        # the two stages together hold every parameter
        held = set().union(*(v["steps"][step]["grads"] for v in values))
        assert held == set(ref_grads)


@multiprocess
def test_hbp_pipeline_epoch_exactly_once_across_a_resume(tmp_path):
    """The epoch through Trainer.run with checkpoints every 2 steps: a run that trains 3 steps (the third in
    no checkpoint) and stops, then a resumed run: the ledger's final steps hold every scheduled sample
    exactly once and the losses equal an uninterrupted run's."""
    from omnibal.train.ledger import trained_counts

    ranges = SPLITS["inside llm"]
    whole = _values(spawn_local(rank_hbp_pp_run, 4, args=(2, 2, ranges, str(tmp_path / "whole"), None),
                                deadline_s=300, start_method="fork"))
    _values(spawn_local(rank_hbp_pp_run, 4, args=(2, 2, ranges, str(tmp_path / "cut"), 2), deadline_s=300,
                        start_method="fork"))
    resumed = _values(spawn_local(rank_hbp_pp_run, 4, args=(2, 2, ranges, str(tmp_path / "cut"), None),
                                  deadline_s=300, start_method="fork"))
    assert {v["resumed_at"] for v in resumed} == {2}
    schedule = hbp_schedule(tiny_stats(), dp_size=2)
    scheduled = sorted(int(i) for i in schedule.pack_samples)
    for root in ("whole", "cut"):
        counts = trained_counts(tmp_path / root / "ledger.jsonl")
        assert len(counts) == len(scheduled) and set(counts.values()) == {1}, root
    ref = whole[0]["losses"]
    assert sorted(ref) == list(range(len(LEVELS)))
    for step, loss in resumed[0]["losses"].items():
        assert abs(loss - ref[step]) <= 1e-5 * abs(ref[step]), (step, loss, ref[step])


def test_level_recompute_sets_are_checked_by_name():
    from omnibal.train.level_recompute import LevelRecompute, level_layout
    from omnibal.train.stage_layout import StageLayout

    names = ["a", "b", "c", "d"]
    layout = StageLayout(((0, 2), (2, 4)), ((), ()))
    split = level_layout(layout, names, level_recompute=[["a", "c"], []], level_selective=[["d"], ["b"]])
    assert split.level_recompute == ((("a",), ("c",)), ((), ()))
    assert split.level_selective == (((), ("d",)), (("b",), ()))
    with pytest.raises(InputError) as err:
        level_layout(layout, names, level_recompute=[["x"]])
    assert err.value.field == "level_recompute" and err.value.record == "level 0"
    with pytest.raises(InputError) as err:
        level_layout(layout, names, level_recompute=[["a"]], level_selective=[["a"]])
    assert err.value.field == "level_selective"
    with pytest.raises(InputError) as err:  # one set per level of the schedule
        LevelRecompute(split, _three_levels(), stage_indices=[0])
    assert err.value.field == "level_recompute"


def _three_levels():
    from dataclasses import replace

    sched = hbp_schedule(tiny_stats())
    return replace(sched, level_sp=(1, 2, 2), level_microbatches=(4, 2, 2))


def test_the_schedules_level_sets_reach_the_layout_of_their_model_only():
    """``omnibal plan --hbp`` records each level's sets in the schedule's ``meta.hbp``; the run applies them
    when it trains the model they were planned for, and says so when it does not."""
    from dataclasses import replace

    from dist_helpers import tiny_spec
    from omnibal.train.level_recompute import schedule_level_layout
    from omnibal.train.stage_layout import resolve_layout

    names = [layer.name for layer in tiny_spec().layers()]
    layout = resolve_layout(names, pp_size=2, mode="offline", stage_layers=SPLITS["inside llm"])
    sched = hbp_schedule(tiny_stats())
    assert schedule_level_layout(layout, sched, names, model_name="dist-test-tiny") is layout  # none recorded
    recorded = {"model": "dist-test-tiny", "level_recompute": [list(s) for s in LEVEL_RECOMPUTE],
                "level_selective": [list(s) for s in LEVEL_SELECTIVE]}
    planned = replace(sched, meta={"hbp": recorded})
    got = schedule_level_layout(layout, planned, names, model_name="dist-test-tiny")
    assert got.level_recompute == ((("vision.blocks.0",), ()), (("vision.blocks.1", "llm.blocks.0"), ()))
    assert got.level_selective == (((), ()), ((), ("llm.blocks.1",)))
    told = []
    assert schedule_level_layout(layout, planned, names, model_name="other", notify=told.append) is layout
    assert told and "dist-test-tiny" in told[0]


def test_level_recompute_sets_reach_every_chunk_of_an_interleaved_rank():
    """An interleaved rank (2 chunks of a 2-stage pipeline: virtual stages 0 and 2) gets each level's sets on
    both of its chunks, each chunk its own virtual stage's share."""
    from dataclasses import replace

    from dist_helpers import tiny_spec
    from omnibal.train.level_recompute import LevelRecompute, level_layout
    from omnibal.train.model import VLM
    from omnibal.train.stage import build_rank_stages
    from omnibal.train.stage_layout import StageLayout, even_split

    model = VLM(tiny_spec(), seed=0)
    names = [layer.name for layer, _ in model.chain()]
    ranges = even_split(len(names), 4)
    layout = StageLayout(ranges, tuple(() for _ in ranges), num_chunks=2)
    sched = replace(hbp_schedule(tiny_stats()), level_sp=(1, 1))
    first, third = names[ranges[0][0]], names[ranges[2][0]]
    split = level_layout(layout, names, level_recompute=[[first, third], []], level_selective=[[], [third]])
    stages, _ = build_rank_stages(model, split, 0, 2)
    levels = LevelRecompute(split, sched, stage_indices=[0, 2])
    step = {level: int(np.flatnonzero(np.asarray(sched.levels) == level)[0]) for level in (0, 1)}
    assert levels.apply(stages, sched, step[0]) == 0
    assert (stages[0].recompute, stages[1].recompute) == ({first}, {third})
    assert levels.apply(stages, sched, step[1]) == 1
    assert (stages[0].recompute, stages[1].recompute, stages[1].selective) == (set(), set(), {third})


def test_sequence_parallelism_refuses_interleaved_chunks():
    from types import SimpleNamespace

    from torch import nn

    from dist_helpers import tiny_spec
    from omnibal.train.model import VLM
    from omnibal.train.sp_pipe import build_sp

    model = VLM(tiny_spec(), seed=0)
    world = SimpleNamespace(pp_size=2)
    with pytest.raises(InputError) as err:
        build_sp(model, nn.ModuleList([nn.Linear(1, 1)]), world=world, runner=None, step_sp=[1, 2], mode="offline",
                 dp_sync="flat", buffer=None, dtype=None)
    assert err.value.field == "num_chunks" and "--chunks 1" in str(err.value)
