"""Loading the next step's micro-batches ahead (omnibal.train.prefetch): the same batches as a direct load,
in the same order, errors at the step that needs them, nothing loaded past the run's last step."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dist_helpers import make_trainer
from omnibal.errors import InputError
from omnibal.train.distributed import local_world
from omnibal.train.prefetch import StepPrefetcher


def test_prefetcher_returns_each_step_once_and_loads_the_next_ahead():
    calls, started = [], threading.Event()

    def load(step):
        calls.append(step)
        started.set()
        if step == 3:
            raise InputError("record 7 is broken", source="data.jsonl")
        return f"batches {step}"

    key = ["a"]
    pre = StepPrefetcher(load, key=lambda: key[0], last_step=lambda: 5)
    assert pre.get(0) == "batches 0"
    started.wait(5)
    assert pre.get(1) == "batches 1" and pre.get(2) == "batches 2"
    assert calls[:3] == [0, 1, 2]
    with pytest.raises(InputError, match="record 7"):
        pre.get(3)  # the prefetched failure surfaces at its own step, unchanged
    assert calls.count(3) == 1
    assert pre.get(4) == "batches 4"  # loaded directly (nothing in flight), step 5 starts loading
    for _ in range(500):
        if 5 in calls:
            break
        threading.Event().wait(0.01)
    key[0] = "b"  # e.g. the schedule was replaced (reshard): the load in flight is not used
    assert pre.get(5) == "batches 5"
    pre.close()
    assert calls.count(5) == 2 and 6 not in calls  # loaded again for the new key; never past the last step


def test_training_with_prefetch_equals_training_without():
    torch.set_num_threads(1)
    runs = []
    for prefetch in (False, True):
        torch.manual_seed(0)
        trainer = make_trainer(local_world(), num_microbatches=2, num_steps=3)
        trainer.prefetch = prefetch
        trainer.run(3)
        runs.append(([r.loss for r in trainer.log.records], trainer.consumed,
                     {n: p.detach().clone() for n, p in trainer.stage_module.named_parameters()}))
    (loss_a, fed_a, w_a), (loss_b, fed_b, w_b) = runs
    assert loss_a == loss_b and fed_a == fed_b
    assert all(torch.equal(w_a[n], w_b[n]) for n in w_a)
    assert np.isfinite(loss_b).all()
