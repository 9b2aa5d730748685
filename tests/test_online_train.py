"""``--mode online`` (OrchMLLM-style post-balancing, per-modality dispatch) on gloo ranks: one step equals one
process, every sample is trained once per epoch, resume continues the draws, a dead peer fails fast."""

from __future__ import annotations

import numpy as np
import pytest

from online_helpers import (rank_online_dies, rank_online_forward_backward, rank_online_train,
                            single_process_step)
from omnibal.train.distributed import spawn_local

pytestmark = pytest.mark.multiprocess


def _values(results):
    errors = [r.error for r in results if r.error]
    assert not errors, "\n".join(errors)
    return [r.value for r in results]


@pytest.mark.parametrize("dp", [2, 4])
def test_online_step_matches_single_process(dp):
    """The samples are moved (pixels to the vision owner, ids to the LLM owner, features between them) and
    the loss and every gradient still equal one process on the whole global batch within 1e-5; each sample
    is trained by exactly one rank; each phase is balanced by its own cost."""
    values = _values(spawn_local(rank_online_forward_backward, dp, args=(dp,), deadline_s=120, start_method="fork"))
    ref_loss, ref_grads, rows = single_process_step(dp)
    loss = sum(v["loss_part"] for v in values)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for v in values:
        assert set(v["grads"]) == set(ref_grads)
        for name, grad in v["grads"].items():
            ref = ref_grads[name]
            err = np.linalg.norm(grad - ref) / max(np.linalg.norm(ref), 1e-30)
            assert err <= 1e-5, (v["rank"], name, err)
    assert sorted(i for v in values for i in v["fed"]) == rows
    info = values[0]["info"]
    assert all(v["info"] == info for v in values)  # every rank computed the same dispatch
    vis, llm, local_vis, local_llm = info
    assert vis <= local_vis + 1e-9 and llm <= local_llm + 1e-9


def test_online_epoch_exactly_once_and_resume_continues_the_draws(tmp_path):
    """A whole epoch at dp 2 trains every drawn sample once (the drop-last tail aside, as the baseline);
    a run stopped after a checkpoint at step 2 and resumed reaches bit-identical weights and the same
    losses and samples as an uninterrupted one."""
    n = 60  # 5 steps of 2 ranks x 2 micro-batches x 3 samples
    full = _values(spawn_local(rank_online_train, 2, args=(2, str(tmp_path / "a"), 0, False, 0, n), deadline_s=180,
                               start_method="fork"))
    steps = full[0]["steps"]
    assert steps == 5
    trained = [i for v in full for s in v["consumed"] for i in s]
    assert sorted(trained) == list(range(n))
    first = _values(spawn_local(rank_online_train, 2, args=(2, str(tmp_path / "b"), 2, False, 2, n),
                                deadline_s=180, start_method="fork"))
    rest = _values(spawn_local(rank_online_train, 2, args=(2, str(tmp_path / "b"), 0, True, 0, n), deadline_s=180,
                               start_method="fork"))
    assert rest[0]["start"] == 2
    assert first[0]["losses"] + rest[0]["losses"] == pytest.approx(full[0]["losses"], rel=1e-6)
    for a, b in zip(full, rest):
        for name, p in a["params"].items():
            assert np.array_equal(p, b["params"][name]), name
    resumed = [i for v in first + rest for s in v["consumed"] for i in s]
    assert sorted(resumed) == list(range(n))


def test_online_dead_rank_fails_fast():
    results = spawn_local(rank_online_dies, 2, args=(2, 1), deadline_s=90, start_method="fork")
    survivor = results[0].value
    assert survivor is not None and survivor["error_type"] == "PeerFailure", results[0]
    assert "step 1" in survivor["message"] and "rank 1" in survivor["message"]
    assert survivor["elapsed"] < 45
