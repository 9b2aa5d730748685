"""``--mode online`` (OrchMLLM-style post-balancing, per-modality dispatch) on gloo ranks: one step equals one
process, every sample is trained once per epoch, resume continues the draws, a dead peer fails fast."""

from __future__ import annotations

import numpy as np
import pytest

from omnibal.train.distributed import spawn_local
from online_helpers import (
    rank_online_bf16_step,
    rank_online_dies,
    rank_online_forward_backward,
    rank_online_train,
    single_process_step,
)

pytestmark = pytest.mark.multiprocess


def _values(results):
    errors = [r.error for r in results if r.error]
    assert not errors, "\n".join(errors)
    return [r.value for r in results]


@pytest.mark.parametrize(("dp", "node_size", "balance"), [(2, 0, True), (4, 0, True), (4, 2, True), (2, 0, False)])
def test_online_step_matches_single_process(dp, node_size, balance):
    """The samples are moved (pixels to the vision owner, ids to the LLM owner, features between them; flat,
    or node-wise with 2 ranks per node) and the loss and every gradient still equal one process on the whole
    global batch within 1e-5; each sample is trained by exactly one rank; each phase is balanced by its own
    cost. The control (no re-deal) trains each rank's own draw, at the draw's balance. At dp 4 the
    re-deal of step 1 encodes a sample's tiles on two ranks (the vision phase is dealt by tile) and the
    gradients still agree."""
    step = 1
    values = _values(spawn_local(rank_online_forward_backward, dp, deadline_s=120, start_method="fork",
                                 args=(dp, node_size, balance, 1, None, "1f1b", step)))
    ref_loss, ref_grads, rows = single_process_step(dp, step)
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
    if balance and dp == 4:  # this draw: a sample's tiles are split over two vision ranks
        assert values[0]["split_samples"] >= 1
    if not balance:
        assert (vis, llm) == (local_vis, local_llm)
        assert all(sorted(v["fed"]) == sorted(v["local"]) for v in values)


@pytest.mark.parametrize(("balance", "stage_layers", "kind"), [(True, None, "1f1b"), (True, ((0, 6), (6, 8)), "gpipe"),
                                                               (False, None, "1f1b")])
def test_online_pipeline_step_matches_single_process(balance, stage_layers, kind):
    """dp 2 x pp 2: the vision phase runs on stage 0's ranks (re-dealt among them), the LLM phase through each
    replica's pipeline in fixed-shape padded packs; the loss and every gradient (each parameter on the stage
    that holds it) equal one process on the whole global batch within 1e-5, and each sample is trained by
    exactly one replica. Stage 0 holds the vision phase alone (the even split: the features cross the
    boundary) or also LLM layers; 1F1B and GPipe; the control too."""
    values = _values(spawn_local(rank_online_forward_backward, 4, args=(2, 0, balance, 2, stage_layers, kind),
                                 deadline_s=180, start_method="fork"))
    ref_loss, ref_grads, rows = single_process_step(2)
    loss = sum(v["loss_part"] for v in values)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert all(v["loss_part"] == 0.0 for v in values if v["pp_rank"] == 0)  # the loss is the last stage's
    for dp_rank in range(2):
        mine = [v for v in values if v["rank"] // 2 == dp_rank]
        assert sorted(n for v in mine for n in v["grads"]) == sorted(ref_grads)  # the stages split the model
        assert mine[0]["shapes"] == mine[1]["shapes"] and len(mine[0]["shapes"]) == 1
    for v in values:
        for name, grad in v["grads"].items():
            ref = ref_grads[name]
            err = np.linalg.norm(grad - ref) / max(np.linalg.norm(ref), 1e-30)
            assert err <= 1e-5, (v["rank"], name, err)
    first = [v for v in values if v["pp_rank"] == 0]
    assert sorted(i for v in first for i in v["fed"]) == rows
    assert all(v["fed"] == [] for v in values if v["pp_rank"] == 1)
    assert first[0]["info"] == first[1]["info"]
    if not balance:
        assert all(sorted(v["fed"]) == sorted(v["local"]) for v in first)


def test_online_epoch_exactly_once_and_resume_continues_the_draws(tmp_path):
    """Counted from the trainer's ledger: a whole epoch at dp 2 trains every sample once (60 samples = 5
    whole steps of 2 ranks x 2 x 3); a run stopped after its checkpoint at step 2 and resumed, appending to the
    same ledger, trains every sample once too and reaches bit-identical weights and the same losses."""
    from omnibal.train.ledger import trained_counts

    n = 60
    full = _values(spawn_local(rank_online_train, 2, args=(2, str(tmp_path / "a"), 0, False, 0, n,
                                                           str(tmp_path / "a.jsonl")), deadline_s=180,
                               start_method="fork"))
    assert full[0]["steps"] == 5
    keys = full[0]["keys"]
    assert trained_counts(tmp_path / "a.jsonl") == {k: 1 for k in keys}
    assert sorted(i for v in full for s in v["consumed"] for i in s) == list(range(n))
    ledger = str(tmp_path / "b.jsonl")
    first = _values(spawn_local(rank_online_train, 2, args=(2, str(tmp_path / "b"), 2, False, 2, n, ledger),
                                deadline_s=180, start_method="fork"))
    rest = _values(spawn_local(rank_online_train, 2, args=(2, str(tmp_path / "b"), 0, True, 0, n, ledger),
                               deadline_s=180, start_method="fork"))
    assert rest[0]["start"] == 2
    assert first[0]["losses"] + rest[0]["losses"] == pytest.approx(full[0]["losses"], rel=1e-6)
    for a, b in zip(full, rest):
        for name, p in a["params"].items():
            assert np.array_equal(p, b["params"][name]), name
    assert trained_counts(ledger) == {k: 1 for k in keys}


def test_online_pipeline_epoch_matches_data_parallel(tmp_path):
    """A whole epoch (5 steps, AdamW updates between them) at dp 2 x pp 2 trains every sample once (the ledger)
    and follows the dp 2, pp 1 run: the same losses and, stage by stage, the same weights within 1e-5; the
    steps' pack shapes differ, so several pipeline shapes ran."""
    from omnibal.train.ledger import trained_counts

    n = 60
    flat = _values(spawn_local(rank_online_train, 2, args=(2, str(tmp_path / "a"), 0, False, 0, n),
                               deadline_s=180, start_method="fork"))
    piped = _values(spawn_local(rank_online_train, 4, args=(2, str(tmp_path / "b"), 0, False, 0, n,
                                                            str(tmp_path / "b.jsonl"), 2),
                                deadline_s=240, start_method="fork"))
    assert trained_counts(tmp_path / "b.jsonl") == {k: 1 for k in flat[0]["keys"]}
    assert piped[0]["losses"] == pytest.approx(flat[0]["losses"], rel=1e-5)
    assert piped[0]["shapes"] >= 2
    for v in piped:
        for name, p in v["params"].items():
            ref = flat[v["rank"] // 2]["params"][name]
            assert np.linalg.norm(p - ref) <= 1e-5 * max(np.linalg.norm(ref), 1e-30), (v["rank"], name)


def test_online_dead_rank_fails_fast():
    results = spawn_local(rank_online_dies, 2, args=(2, 1), deadline_s=90, start_method="fork")
    survivor = results[0].value
    assert survivor is not None and survivor["error_type"] == "PeerFailure", results[0]
    assert "step 1" in survivor["message"] and "rank 1" in survivor["message"]
    assert survivor["elapsed"] < 45


def test_online_mode_config_is_checked():
    from dataclasses import replace

    from omnibal.errors import InputError
    from omnibal.train.config import TRAIN_LAYOUT, TrainConfig

    TrainConfig(mode="online", layout=replace(TRAIN_LAYOUT, dp_size=2, pp_size=2))  # vision on stage 0's ranks
    with pytest.raises(InputError, match="flat"):
        TrainConfig(mode="online", layout=replace(TRAIN_LAYOUT, dp_size=2), dp_sync="ddp")
    TrainConfig(mode="online", layout=replace(TRAIN_LAYOUT, dp_size=2))
    TrainConfig(mode="online", layout=replace(TRAIN_LAYOUT, dp_size=4), node_size=2)
    for node_size in (3, -1):
        with pytest.raises(InputError, match="node_size"):
            TrainConfig(mode="online", layout=replace(TRAIN_LAYOUT, dp_size=4), node_size=node_size)
    with pytest.raises(InputError, match="node_size"):
        TrainConfig(mode="baseline", layout=replace(TRAIN_LAYOUT, dp_size=4), node_size=2)
    TrainConfig(mode="online", layout=replace(TRAIN_LAYOUT, dp_size=2), online_balance=False)
    with pytest.raises(InputError, match="online_balance"):
        TrainConfig(mode="baseline", layout=replace(TRAIN_LAYOUT, dp_size=2), online_balance=False)


def test_online_bf16_moves_pixels_and_features_in_bf16():
    """Under ``bf16-mixed`` the pixels and the visual features (and their gradients) travel as bf16, half
    the bytes of fp32, and the step still matches the fp32 single-process loss and gradients to bf16's
    precision; token ids stay int64."""
    values = _values(spawn_local(rank_online_bf16_step, 2, args=(2,), deadline_s=120, start_method="fork"))
    ref_loss, ref_grads, _ = single_process_step(2)
    for v in values:
        # pixels, tokens, features forward, feature gradients backward
        assert v["dtypes"] == ["torch.bfloat16", "torch.int64", "torch.bfloat16", "torch.bfloat16"], v["dtypes"]
    loss = sum(v["loss_part"] for v in values)
    assert abs(loss - ref_loss) <= 2e-2 * abs(ref_loss)
    for v in values:
        for name, grad in v["grads"].items():
            ref = ref_grads[name]
            err = np.linalg.norm(grad - ref) / max(np.linalg.norm(ref), 1e-30)
            assert err <= 0.1, (name, err)


def test_online_pipeline_bf16():
    """dp 2 x pp 2 under ``bf16-mixed`` with a boundary inside the LLM (its fp32 residual stream crosses in
    bf16, the pipeline's fixed buffer dtype): stage 0's ranks move pixels and features in bf16, the later
    stage moves none, and the step matches the fp32 single process to bf16's precision."""
    values = _values(spawn_local(rank_online_bf16_step, 4, args=(2, 2, ((0, 6), (6, 8))), deadline_s=180,
                                 start_method="fork"))
    ref_loss, ref_grads, _ = single_process_step(2)
    for v in values:
        want = ["torch.bfloat16", "torch.int64", "torch.bfloat16", "torch.bfloat16"] if v["pp_rank"] == 0 else []
        assert v["dtypes"] == want, v["dtypes"]
    loss = sum(v["loss_part"] for v in values)
    assert abs(loss - ref_loss) <= 2e-2 * abs(ref_loss)
    for v in values:
        for name, grad in v["grads"].items():
            ref = ref_grads[name]
            err = np.linalg.norm(grad - ref) / max(np.linalg.norm(ref), 1e-30)
            assert err <= 0.1, (name, err)


def test_train_cli_passes_node_size_and_the_control_flag():
    import argparse

    from omnibal.cli.train import add_arguments, train_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = train_config(parser.parse_args(["--mode", "online", "--dp", "4", "--node-size", "2",
                                          "--no-online-balance"]))
    assert (cfg.node_size, cfg.online_balance) == (2, False)
    cfg = train_config(parser.parse_args(["--mode", "online", "--dp", "4"]))
    assert (cfg.node_size, cfg.online_balance) == (0, True)


def test_online_pp2_layout_checks():
    """An online run's default layout keeps the vision phase on stage 0; a given layout that splits it is
    refused before any collective, naming stage_layers; so is an interleaved layout (one range per stage)."""
    from types import SimpleNamespace

    from omnibal.errors import InputError
    from omnibal.train.online_pipeline import bucket, check_online_layout, online_stage_layers

    assert online_stage_layers(8, 4, 2) == ((0, 4), (4, 8))  # the even split already does
    assert online_stage_layers(30, 12, 3) == ((0, 12), (12, 21), (21, 30))  # vision alone, the LLM split evenly
    assert online_stage_layers(30, 6, 3) == ((0, 10), (10, 20), (20, 30))
    with pytest.raises(InputError, match="stage 0 holds") as err:
        check_online_layout(SimpleNamespace(layout=SimpleNamespace(ranges=((0, 3), (3, 8)), num_chunks=1)), 4)
    assert err.value.field == "stage_layers"
    interleaved = SimpleNamespace(ranges=((0, 4), (4, 5), (5, 6), (6, 8)), num_chunks=2)
    with pytest.raises(InputError, match="--chunks 1") as err:
        check_online_layout(SimpleNamespace(layout=interleaved), 4)
    assert err.value.field == "num_chunks"
    assert [bucket(n) for n in (0, 1, 7, 8, 9, 17, 100, 257)] == [1, 1, 7, 8, 10, 20, 112, 320]
    assert all(n <= bucket(n) <= 1.25 * n for n in range(8, 5000))


def test_train_cli_online_with_a_pipeline(tmp_path):
    """``omnibal train --mode online --pp 2`` end to end on the tiny preset: steps run, the loss is finite, the
    per-stage checkpoint is written, and the default layout put the vision phase on stage 0."""
    import json
    import math

    from omnibal.cli import main
    from omnibal.cost.presets import get_model_preset
    from test_trainloop import _stats_file

    stats = _stats_file(tmp_path)
    rc = main(["train", "--mode", "online", "--stats", str(stats), "--dp", "1", "--pp", "2", "--model", "tiny",
               "--steps", "2", "--microbatches", "2", "--batch-size", "2", "--summary-json", str(tmp_path / "s.json"),
               "--checkpoint-dir", str(tmp_path / "ck"), "--quiet"])
    assert rc == 0
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["summary"]["steps"] == 1 and math.isfinite(doc["summary"]["final_loss"])
    assert doc["stage_layers"][0][1] >= get_model_preset("tiny").vision.num_layers + 2
    assert (tmp_path / "ck" / "step_00000002" / "manifest.json").is_file()
