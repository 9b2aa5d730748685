"""Spawned ranks report how they failed as data: the InputError itself, and one line for anything else."""

from __future__ import annotations

import os

from omnibal.errors import InputError
from omnibal.train.distributed import spawn_local


def _fail_by_rank(kind: str) -> int:
    rank = int(os.environ["RANK"])
    if kind == "input" or rank == 1:
        raise InputError("no such file", source="stats.json", record="line 3", field="tiles")
    if kind == "mixed":
        raise RuntimeError("a bug")
    return rank


def test_an_input_error_arrives_whole_and_other_failures_as_one_line():
    results = spawn_local(_fail_by_rank, 2, args=("input",), deadline_s=60, start_method="fork")
    errors = [r.input_error for r in results]
    assert all(isinstance(e, InputError) for e in errors)
    assert (errors[0].source, errors[0].record, errors[0].field) == ("stats.json", "line 3", "tiles")
    assert results[0].message.endswith("stats.json: line 3: field 'tiles': no such file")
    mixed = spawn_local(_fail_by_rank, 2, args=("mixed",), deadline_s=60, start_method="fork")
    assert mixed[0].input_error is None and mixed[0].message == "RuntimeError: a bug"
    assert isinstance(mixed[1].input_error, InputError)
    ok = spawn_local(_fail_by_rank, 2, args=("ok",), deadline_s=60, start_method="fork")
    assert ok[0].message is None and ok[0].value == 0 and ok[1].input_error is not None
