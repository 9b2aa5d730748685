"""Multi-process gloo tests of the DP x PP trainer: equivalence with one process, fail-fast, resume."""

from __future__ import annotations

import numpy as np
import pytest

from dist_helpers import (
    NUM_STEPS,
    TIMEOUT_S,
    rank_dies_mid_step,
    rank_forward_backward,
    rank_train_steps,
    single_process_reference,
)
from omnibal.train.distributed import spawn_local

pytestmark = pytest.mark.multiprocess


def _values(results):
    errors = [r.error for r in results if r.error]
    assert not errors, "\n".join(errors)
    return [r.value for r in results]


def test_selective_and_full_recompute_in_a_pipeline_match_single_process():
    """pp 2: stage 0 recomputes a vision block whole and the other selectively, stage 1 an LLM block each way:
    loss and every gradient equal one process without recompute."""
    from dist_helpers import tiny_spec

    names = [layer.name for layer in tiny_spec().layers()]
    half = len(names) // 2
    vision = [n for n in names[:half] if ".blocks." in n]
    llm = [n for n in names[half:] if ".blocks." in n]
    recompute, selective = [vision[:1], llm[:1]], [vision[1:2], llm[1:2]]
    assert all(recompute) and all(selective)
    values = _values(spawn_local(rank_forward_backward, 2, args=(1, 2, "1f1b", "flat", "fp32", recompute, selective),
                                 deadline_s=120, start_method="fork"))
    ref_loss, ref_grads = single_process_reference(dp_size=1, num_microbatches=4)
    assert abs(sum(v["loss_part"] for v in values) - ref_loss) <= 1e-5 * abs(ref_loss)
    for v in values:
        for name, grad in v["grads"].items():
            ref = ref_grads[name]
            assert np.linalg.norm(grad - ref) <= 1e-5 * max(np.linalg.norm(ref), 1e-30), (v["rank"], name)


@pytest.mark.parametrize("dp,pp,pp_schedule", [(1, 2, "1f1b"), (2, 1, "1f1b")])
def test_bf16_mixed_step_matches_single_process_under_autocast(dp, pp, pp_schedule):
    """``precision="bf16-mixed"``: fp32 weights and gradients, the forward under bf16 autocast, activations
    crossing pipeline stages in bf16; loss and gradients equal one process running the same autocast forward
    (bf16 rounding of the same ops in the same order, so far inside bf16's own resolution)."""
    values = _values(spawn_local(rank_forward_backward, dp * pp, args=(dp, pp, pp_schedule, "flat", "bf16-mixed"),
                                 deadline_s=120, start_method="fork"))
    import torch

    ref_loss, ref_grads = single_process_reference(dp_size=dp, num_microbatches=4, autocast=torch.bfloat16)
    _, fp32_grads = single_process_reference(dp_size=dp, num_microbatches=4)
    loss = sum(v["loss_part"] for v in values)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)

    def rel(a, b):
        return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)

    assert max(rel(fp32_grads[n], ref_grads[n]) for n in ref_grads) > 1e-3  # autocast really ran in bf16
    for v in values:
        for name, grad in v["grads"].items():
            assert grad.dtype == np.float32, name  # fp32 weights and gradients
            assert rel(grad, ref_grads[name]) <= 1e-4, (v["rank"], name, rel(grad, ref_grads[name]))


@pytest.mark.parametrize("dp,pp,pp_schedule,dp_sync", [(1, 2, "gpipe", "flat"), (2, 1, "1f1b", "flat"),
                                                    (2, 2, "1f1b", "flat"), (2, 1, "1f1b", "ddp"),
                                                    (2, 2, "1f1b", "ddp")])
def test_step_matches_single_process(dp, pp, pp_schedule, dp_sync):
    """Loss and every parameter's gradient after one DP x PP step equal one process on the same global
    batch (uneven packs, so a per-micro-batch or per-rank mean would differ), with the flat all-reduce and
    with DistributedDataParallel (which averages: the loss is scaled to make its average a sum)."""
    values = _values(spawn_local(rank_forward_backward, dp * pp, args=(dp, pp, pp_schedule, dp_sync), deadline_s=120,
                                 start_method="fork"))
    ref_loss, ref_grads = single_process_reference(dp_size=dp, num_microbatches=4)
    loss = sum(v["loss_part"] for v in values)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    covered = set()
    for v in values:
        for name, grad in v["grads"].items():
            ref = ref_grads[name]
            err = np.linalg.norm(grad - ref) / max(np.linalg.norm(ref), 1e-30)
            assert err <= 1e-5, (v["rank"], name, err)
            covered.add(name)
    assert covered == set(ref_grads)  # the stages hold every parameter of the model exactly once per replica


def test_dead_rank_fails_fast_with_clear_error():
    """Rank 1 crashes in the middle of step 1's pipeline; rank 0 must raise a PeerFailure naming itself and
    the step within the timeout, not hang."""
    results = spawn_local(rank_dies_mid_step, 2, args=(1, 2, 1), deadline_s=90, start_method="fork")
    assert results[1].exitcode == 7
    survivor = results[0]
    assert survivor.error is None, survivor.error
    out = survivor.value
    assert out["error_type"] == "PeerFailure", out
    assert "rank 0 (dp 0/1, pp 0/2): step 1" in out["message"]
    assert "died or stopped responding" in out["message"]
    assert out["elapsed"] < TIMEOUT_S + 5


def test_resume_skips_corrupt_checkpoint_and_continues_the_stream(tmp_path):
    """4 steps in one go (checkpoint after each), the newest checkpoint truncated, resume: the run restarts
    from step 3's checkpoint and its step 4 repeats the uninterrupted run's step 4 exactly."""
    ckdir = tmp_path / "ck"
    full = _values(spawn_local(rank_train_steps, 2, args=(1, 2, str(ckdir), 4, False, 1), deadline_s=120,
                               start_method="fork"))
    assert len(full[0]["consumed"]) == 4
    stage1 = ckdir / "step_00000004" / "stage_1.pt"
    stage1.write_bytes(stage1.read_bytes()[:-100])  # truncated newest checkpoint
    resumed = _values(spawn_local(rank_train_steps, 2, args=(1, 2, str(ckdir), 4, True, 0), deadline_s=120,
                                  start_method="fork"))
    assert resumed[0]["resumed_from"] == 3
    assert any("step_00000004" in line and "truncated" in line for line in resumed[0]["skipped"])
    # stage 0 fed exactly the samples of step 4 (index 3) of the uninterrupted run, none lost or repeated
    assert resumed[0]["consumed"] == full[0]["consumed"][3:]
    # and the model + optimizer state came back: the loss of step 4 equals the uninterrupted run's
    assert abs(resumed[0]["losses"][0] - full[0]["losses"][3]) <= 1e-6 * abs(full[0]["losses"][3])
    assert NUM_STEPS >= 4
