"""Pure logic of the trainer's resume on another DP size (`omnibal.train.reshard`); the multi-process run is
`test_faults_resume.py::test_resume_on_another_dp_size_reshards_the_rest_of_the_epoch`."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from omnibal.data.balance import balance
from omnibal.errors import InputError
from omnibal.stats.table import SampleStats
from omnibal.train.feed import schedule_fingerprint
from omnibal.train.reshard import ResumedSchedule, balance_record, reshard_schedule


def _stats(n: int = 200, seed: int = 3) -> SampleStats:
    rng = np.random.default_rng(seed)
    tiles = rng.integers(1, 5, n)
    return SampleStats.from_arrays(tiles=tiles, tokens=tiles * 4 + 1 + rng.integers(4, 40, n), source="reshard-test")


def _manifest(schedule, next_step: int) -> dict:
    return {"sampler": {"next_step": next_step, "schedule_fingerprint": schedule_fingerprint(schedule),
                        "balance": balance_record(schedule)}}


def _samples(schedule, steps) -> Counter:
    return Counter(int(i) for s in steps for r in range(schedule.dp_size) for k in range(schedule.num_microbatches)
                   for i in schedule.microbatch(s, r, k))


def test_reshard_twice_trains_every_sample_of_the_epoch_once_and_is_deterministic():
    stats = _stats()
    first = balance(stats, dp_size=2, num_microbatches=2, seed=1)
    epoch = set(int(i) for i in np.flatnonzero(first.sample_counts() > 0))
    second = reshard_schedule(_manifest(first, 3), stats, dp_size=3, num_microbatches=2, source="ckpt",
                              fingerprint=schedule_fingerprint)
    assert isinstance(second, ResumedSchedule) and second.step_offset == 3 and second.dp_size == 3
    again = reshard_schedule(_manifest(first, 3), stats, dp_size=3, num_microbatches=2, source="ckpt",
                             fingerprint=schedule_fingerprint)
    assert schedule_fingerprint(again) == schedule_fingerprint(second)
    with pytest.raises(InputError):
        second.microbatch(2, 0, 0)  # trained by the old world
    third = reshard_schedule(_manifest(second, 5), stats, dp_size=1, num_microbatches=2, source="ckpt",
                             fingerprint=schedule_fingerprint)
    counts = _samples(first, range(3)) + _samples(second, range(3, 5)) + _samples(third, range(5, third.num_steps))
    assert set(counts) == epoch and set(counts.values()) == {1}
    # the same layout continues the checkpoint's own (resharded) stream
    same = reshard_schedule(_manifest(second, 4), stats, dp_size=3, num_microbatches=2, source="ckpt",
                            fingerprint=schedule_fingerprint)
    assert schedule_fingerprint(same) == schedule_fingerprint(second)


def test_reshard_refuses_other_stats_and_schedules_without_a_record():
    stats = _stats()
    first = balance(stats, dp_size=2, num_microbatches=2, seed=1)
    with pytest.raises(InputError, match="rebuilding"):
        reshard_schedule(_manifest(first, 1), _stats(seed=4), dp_size=1, num_microbatches=2, source="ckpt",
                         fingerprint=schedule_fingerprint)
    manifest = _manifest(first, 1)
    del manifest["sampler"]["balance"]
    with pytest.raises(InputError, match="record") as err:
        reshard_schedule(manifest, stats, dp_size=1, num_microbatches=2, source="ckpt",
                         fingerprint=schedule_fingerprint)
    assert err.value.field == "sampler.balance"
