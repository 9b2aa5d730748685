"""The installed torch's gloo errors on a peer's death and on a timeout are told apart from user errors by
``is_comm_error``: gloo raises them as plain ``RuntimeError``, so the backend's words are what says so."""

from __future__ import annotations

import datetime
import os

import pytest

from omnibal.train.distributed import is_comm_error


def _peer_fails(case: str) -> dict | None:
    """Rank 1 dies (``death``) or stalls past the group timeout (``timeout``) after one all-reduce; rank 0
    reports the exception its next all-reduce raised."""
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    t = torch.ones(2)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        if case == "timeout":
            time.sleep(10)
        os._exit(0)  # no teardown: the peer simply goes away
    try:
        dist.all_reduce(t)
    except Exception as exc:  # noqa: BLE001 -- the exception is what the test looks at
        return {"type": type(exc).__name__, "comm": is_comm_error(exc), "text": str(exc)[:300]}
    return {"type": None, "comm": False, "text": "the all-reduce did not fail"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["death", "timeout"])
def test_gloo_peer_death_and_timeout_are_comm_errors(case):
    from omnibal.train.distributed import spawn_local

    results = spawn_local(_peer_fails, 2, args=(case,), deadline_s=120, start_method="fork",
                          env={"OMP_NUM_THREADS": "1"})
    got = results[0].value
    assert results[0].error is None and got is not None, results[0].error
    assert got["comm"], got
    assert got["type"] == "RuntimeError", got  # were it a DistError, the type alone would say so


def test_user_errors_are_not_comm_errors():
    assert not is_comm_error(ValueError("gloo"))  # only a RuntimeError carries the backend's words
    assert not is_comm_error(RuntimeError("shape mismatch in layer 3"))
    assert is_comm_error(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"))


def _raises(kind: str) -> None:
    from omnibal.errors import InputError

    if kind == "bug":
        raise KeyError("missing-key")
    raise InputError("bad value", source="data.jsonl", record="line 3", field="tiles")


@pytest.mark.multiprocess
def test_a_ranks_exception_arrives_with_its_stack_as_its_cause():
    """A rank's bug reaches the parent as the exception it raised, its formatted stack the exception's
    ``RemoteTraceback`` cause (not a separate text); an omnibal error's one line needs none."""
    from omnibal.errors import InputError
    from omnibal.train.distributed import spawn_local
    from omnibal.train.rank_exceptions import RemoteTraceback, remote_traceback

    for kind, kind_type in (("bug", KeyError), ("input", InputError)):
        (result,) = spawn_local(_raises, 1, args=(kind,), deadline_s=120, print_tracebacks=False)
        assert type(result.exception) is kind_type and result.exitcode == 1
        trace = remote_traceback(result.exception)
        if kind == "bug":
            assert isinstance(result.exception.__cause__, RemoteTraceback)
            assert "in _raises" in trace and "KeyError: 'missing-key'" in trace, trace
        else:
            assert trace is None and result.exception.record == "line 3"
