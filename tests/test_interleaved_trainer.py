"""Interleaved 1F1B in the reference trainer's ``StageRunner``: two gloo ranks, each running two model chunks
(virtual stages ``c * 2 + rank``) under torch's ``ScheduleInterleaved1F1B``, give the loss and every gradient
of one process on the same global batch; the runner keeps one schedule per micro-batch count."""

from __future__ import annotations

import numpy as np
import pytest

from dist_helpers import (
    interleaved_tiny_plan,
    rank_interleaved_forward_backward,
    rank_interleaved_trainer,
    single_process_reference,
)
from omnibal.errors import InputError
from omnibal.train.distributed import spawn_local

pytestmark = pytest.mark.multiprocess


def test_interleaved_step_matches_single_process():
    results = spawn_local(rank_interleaved_forward_backward, 2, args=(2, 4), deadline_s=120, start_method="fork")
    errors = [r.error for r in results if r.error]
    assert not errors, "\n".join(errors)
    values = sorted((r.value for r in results), key=lambda v: v["rank"])
    assert [v["stage_indices"] for v in values] == [[0, 2], [1, 3]]
    assert all(v["reused"] for v in values)
    ref_loss, ref_grads = single_process_reference(dp_size=1, num_microbatches=4)
    assert abs(sum(v["loss_part"] for v in values) - ref_loss) <= 1e-5 * abs(ref_loss)
    covered = set()
    for v in values:
        for name, grad in v["grads"].items():
            ref = ref_grads[name]
            assert np.linalg.norm(grad - ref) <= 1e-5 * max(np.linalg.norm(ref), 1e-30), (v["rank"], name)
            covered.add(name)
    assert covered == set(ref_grads), "every parameter is on exactly one chunk"


def test_runner_refuses_chunks_it_cannot_run():
    import torch
    from torch import nn

    from omnibal.train.pipeline import StageRunner

    two = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    kw = dict(stage_index=0, num_stages=2, device=torch.device("cpu"), num_microbatches=4)
    with pytest.raises(InputError, match="only 'interleaved' runs"):
        StageRunner(two, pp_schedule="1f1b", num_chunks=2, **kw)
    with pytest.raises(InputError, match="one module per chunk"):
        StageRunner(nn.Linear(2, 2), pp_schedule="interleaved", num_chunks=2, **kw)
    with pytest.raises(InputError, match="flat all-reduce"):
        StageRunner(two, pp_schedule="interleaved", num_chunks=2, dp_sync="ddp", dp_size=2, **kw)


def test_the_trainer_runs_an_interleaved_plan_file(tmp_path):
    """``omnibal train --plan`` on a plan of 2 ranks x 2 chunks: the trainer switches to interleaved 1F1B, and
    its step gives the single-process loss and gradients; further steps train."""
    path = interleaved_tiny_plan(tmp_path / "plan.json")
    results = spawn_local(rank_interleaved_trainer, 2, args=(str(path),), deadline_s=120, start_method="fork")
    errors = [r.error for r in results if r.error]
    assert not errors, "\n".join(errors)
    values = sorted((r.value for r in results), key=lambda v: v["rank"])
    assert all(v["pp_schedule"] == "interleaved" for v in values)
    ref_loss, ref_grads = single_process_reference(dp_size=1, num_microbatches=4)
    assert abs(sum(v["loss_part"] for v in values) - ref_loss) <= 1e-5 * abs(ref_loss)
    assert {n for v in values for n in v["grads"]} == set(ref_grads)
    for v in values:
        for name, grad in v["grads"].items():
            ref = ref_grads[name]
            assert np.linalg.norm(grad - ref) <= 1e-5 * max(np.linalg.norm(ref), 1e-30), (v["rank"], name)
    losses = values[0]["records"]
    assert len(losses) == 2 and all(np.isfinite(x) for x in losses)
