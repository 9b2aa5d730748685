"""`omnibal.integrations.hf`: packed batches for HF VLMs and `OmnibalTrainer` (the real transformers Trainer).

Single process: the packed forward of tiny random-init Llava and InternVL (fp32) gives the per-sample unpacked loss
and gradients (sdpa with a bool mask, eager with an additive mask, and the flash-attention varlen kwargs through a
reference varlen attention registered with transformers); a plain causal mask over the pack, or labels whose first
token is not masked, give another loss. Multi-process (``torchrun --nproc-per-node 2``, gloo on CPU): every sample
is trained exactly once per epoch across the ranks, the loss falls, and a run stopped after a checkpoint and resumed
trains the same samples and the same losses as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_trainer_worker import IMAGE_TOKEN_ID, PatternDataset, run, synthetic, tiny_internvl, tiny_llava, varied_stats  # noqa: E402
from omnibal.data.sampler import BalancedBatchSampler  # noqa: E402
from omnibal.errors import InputError  # noqa: E402
from omnibal.integrations.hf import SAMPLE_INDEX_KEY, STATE_FILE, HFPackCollator, OmnibalTrainer, block_causal_mask  # noqa: E402
from omnibal.stats.table import SampleStats  # noqa: E402
from omnibal.train.distributed import free_port  # noqa: E402
from omnibal.train.ledger import final_steps, read_ledger  # noqa: E402

torch.set_num_threads(1)
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
EXAMPLES = ROOT / "src" / "omnibal" / "examples"
TOKENS_PER_TILE = {"llava": 16, "internvl": 4}
RUN_TIMEOUT_S = 150


def _model(kind: str, seed: int = 1, attn: str = "sdpa"):
    model = tiny_llava(seed) if kind == "llava" else tiny_internvl(seed)
    model.set_attn_implementation({"text_config": attn})
    return model


def _samples(kind: str, *, all_targets: bool = False) -> list[dict]:
    """Six samples of varied sizes: 1-3 tiles, two text-only (each with its dummy tile). ``all_targets``:
    every token of the text-only samples is a target, so the first token of a sample is one too."""
    tpt = TOKENS_PER_TILE[kind]
    stats = SampleStats.from_arrays(tiles=[1, 1, 3, 2, 1, 1], images=[1, 0, 1, 1, 0, 1],
                                    tokens=[tpt + 14, 9, 3 * tpt + 30, 2 * tpt + 6, 23, tpt + 8])
    ds = synthetic(stats, tpt, seed=3)
    samples = [ds[i] for i in range(len(ds))]
    if all_targets:
        for s in samples:
            if not (s["input_ids"] == IMAGE_TOKEN_ID).any():
                s["labels"] = s["input_ids"].clone()
    return samples


def _unpacked_reference(model, samples):
    """Each sample alone (batch of 1, no padding): cross-entropy summed over its targets, summed over the samples,
    divided by the total target count; and the gradients of that."""
    model.zero_grad(set_to_none=True)
    total = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    loss = torch.zeros(())
    for s in samples:
        has_image = bool((s["input_ids"] == IMAGE_TOKEN_ID).any())
        logits = model(input_ids=s["input_ids"][None], pixel_values=s["pixel_values"] if has_image else None).logits
        loss = loss + torch.nn.functional.cross_entropy(logits[0, :-1].float(), s["labels"][1:], ignore_index=-100,
                                                        reduction="sum")
    loss = loss / total
    loss.backward()
    return float(loss.detach()), _grads(model)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return float(out.loss.detach()), _grads(model)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _assert_grads_close(got, ref):
    assert got.keys() == ref.keys()
    scale = max(float(g.norm()) for g in ref.values())
    for name, g in got.items():
        # CLIP's key-projection biases have a true gradient of 0 (softmax ignores them): compare to the global scale
        err = float((g - ref[name]).norm())
        assert err <= 1e-5 * float(ref[name].norm()) or err <= 1e-7 * scale, name


# ------------------------------------------------------------------------------------------------ collator


def test_pack_layout_positions_labels_tiles_and_attention():
    samples = _samples("llava")
    collate = HFPackCollator(image_token_id=IMAGE_TOKEN_ID, mask_dtype=torch.bool, sample_index=True)
    batch = collate(samples)
    lengths = [len(s["input_ids"]) for s in samples]
    total = sum(lengths)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (1, total)
    assert torch.equal(batch["input_ids"][0], torch.cat([s["input_ids"] for s in samples]))
    assert torch.equal(batch["position_ids"][0], torch.cat([torch.arange(n) for n in lengths]))
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    assert (batch["labels"][0, starts] == -100).all()
    assert (batch["labels"][0][batch["input_ids"][0] == IMAGE_TOKEN_ID] == -100).all()
    # only tiles of samples with image tokens, in sample order (the text-only samples' dummy tiles are dropped)
    with_images = [s["pixel_values"] for s in samples if (s["input_ids"] == IMAGE_TOKEN_ID).any()]
    assert torch.equal(batch["pixel_values"], torch.cat(with_images))
    assert batch["pixel_values"].shape[0] == 7
    mask = batch["attention_mask"]
    assert mask.shape == (1, 1, total, total) and mask.dtype == torch.bool
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    assert torch.equal(mask[0, 0], (seg[:, None] == seg[None, :]) & torch.ones(total, total, dtype=torch.bool).tril())
    additive = block_causal_mask(lengths, torch.float32)[0, 0]
    assert torch.equal(additive == 0, mask[0, 0]) and (additive[~mask[0, 0]] == torch.finfo(torch.float32).min).all()
    assert batch[SAMPLE_INDEX_KEY].tolist() == [s["index"] for s in samples]

    flash = HFPackCollator(image_token_id=IMAGE_TOKEN_ID, attention="flash")(samples)
    assert "attention_mask" not in flash and SAMPLE_INDEX_KEY not in flash
    assert flash["cu_seq_lens_q"].dtype == torch.int32
    assert flash["cu_seq_lens_q"].tolist() == flash["cu_seq_lens_k"].tolist() == [0, *torch.tensor(lengths).cumsum(0)]
    assert flash["max_length_q"] == flash["max_length_k"] == max(lengths)
    text_only = HFPackCollator(image_token_id=IMAGE_TOKEN_ID)([samples[1], samples[4]])
    assert "pixel_values" not in text_only


def test_pack_collator_names_the_bad_sample():
    samples = _samples("llava")
    collate = HFPackCollator(image_token_id=IMAGE_TOKEN_ID, tokens_per_tile=16)
    with pytest.raises(InputError, match="empty pack"):
        collate([])
    bad = dict(samples[2], labels=samples[2]["labels"][:-1])
    with pytest.raises(InputError, match=r"sample 2.*'labels'"):
        collate([samples[0], bad])
    bad = dict(samples[3], pixel_values=samples[3]["pixel_values"][:1])  # 2 tiles of image tokens, 1 tile
    with pytest.raises(InputError, match=r"sample 3.*'input_ids'.*32 image tokens but 1 tiles"):
        collate([bad])
    with pytest.raises(InputError, match="attention"):
        HFPackCollator(image_token_id=IMAGE_TOKEN_ID, attention="ring")
    sdpa, eager = _model("llava"), _model("llava", attn="eager")
    assert HFPackCollator.for_model(sdpa).mask_dtype == torch.bool
    assert HFPackCollator.for_model(eager).mask_dtype == torch.float32
    with pytest.raises(InputError, match="mask_dtype"):
        HFPackCollator(image_token_id=IMAGE_TOKEN_ID, mask_dtype=torch.bool).check_model(eager)
    with pytest.raises(InputError, match="attention"):
        HFPackCollator(image_token_id=IMAGE_TOKEN_ID, attention="flash").check_model(sdpa)


# ------------------------------------------------------------------------------------------------ packed == unpacked


@pytest.mark.parametrize("kind", ["llava", "internvl"])
@pytest.mark.parametrize("attn,mask_dtype", [("sdpa", torch.bool), ("eager", torch.float32)])
def test_packed_loss_and_grads_equal_the_unpacked_per_sample_ones(kind, attn, mask_dtype):
    model = _model(kind, attn=attn)
    samples = _samples(kind, all_targets=True)
    ref_loss, ref_grads = _unpacked_reference(model, samples)
    collate = HFPackCollator(image_token_id=IMAGE_TOKEN_ID, mask_dtype=mask_dtype,
                             tokens_per_tile=TOKENS_PER_TILE[kind])
    collate.check_model(model)
    batch = collate(samples)
    loss, grads = _packed(model, batch)
    assert _rel(loss, ref_loss) <= 1e-5
    _assert_grads_close(grads, ref_grads)
    # HF's num_items_in_batch path (what Trainer passes) gives the same normaliser
    total = int((batch["labels"][0, 1:] != -100).sum())
    with torch.no_grad():
        summed = model(**batch, num_items_in_batch=torch.tensor(total)).loss
    assert _rel(float(summed), ref_loss) <= 1e-5

    # the bugs the test would catch: attention across samples (a plain causal mask over the pack) ...
    n = batch["input_ids"].shape[1]
    with torch.no_grad():
        crossing = model(**dict(batch, attention_mask=block_causal_mask([n], mask_dtype))).loss
    assert _rel(float(crossing), ref_loss) > 1e-3
    # ... and labels shifted twice across samples (the first token of a sample left as a target)
    raw = torch.cat([s["labels"] for s in samples])[None]
    raw[batch["input_ids"] == IMAGE_TOKEN_ID] = -100
    assert (raw != batch["labels"]).any()
    with torch.no_grad():  # (normalised by the true target count: every extra target adds ~ln(64) / total)
        crossed_labels = model(**dict(batch, labels=raw), num_items_in_batch=torch.tensor(total)).loss
    assert _rel(float(crossed_labels), ref_loss) > 1e-2


VARLEN_CALLS: list[int] = []


def _varlen_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over each [cu[i], cu[i+1]) segment alone, causal: what flash_attn_varlen_func computes, read from
    the kwargs transformers passes to a flash-attention implementation."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    assert torch.equal(cu, kwargs["cu_seq_lens_k"]) and kwargs["max_length_q"] == int(cu.diff().max())
    VARLEN_CALLS.append(len(cu) - 1)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    bounds = cu.tolist()
    out = [torch.nn.functional.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                            is_causal=True, scale=scaling)
           for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("kind", ["llava", "internvl"])
def test_flash_varlen_kwargs_reach_the_attention_and_give_the_unpacked_loss(kind):
    from transformers import AttentionInterface

    AttentionInterface.register("omnibal_test_varlen", _varlen_reference_attention)
    model = _model(kind)
    samples = _samples(kind, all_targets=True)
    ref_loss, ref_grads = _unpacked_reference(model, samples)
    model.set_attn_implementation({"text_config": "omnibal_test_varlen"})
    VARLEN_CALLS.clear()
    loss, grads = _packed(model, HFPackCollator(image_token_id=IMAGE_TOKEN_ID, attention="flash")(samples))
    assert VARLEN_CALLS == [len(samples)] * 3  # every one of the 3 decoder layers got the 6 segments
    assert _rel(loss, ref_loss) <= 1e-5
    _assert_grads_close(grads, ref_grads)


def test_real_dataset_pack_gives_the_unpacked_loss():
    pytest.importorskip("tokenizers")
    from omnibal.data.realdata import RealDataConfig, RealDataset
    from omnibal.stats.tiles import TileConfig

    cfg = RealDataConfig(tokenizer=str(EXAMPLES / "tokenizer.json"), tiles=TileConfig(tile_size=32, max_tiles=2),
                         tokens_per_tile=16)
    ds = RealDataset(EXAMPLES / "annotations.jsonl", cfg)
    samples = []
    for i in range(len(ds)):
        try:
            samples.append(ds[i])
        except InputError:  # the example file has a record whose image is missing on purpose
            continue
    assert len(samples) >= 10
    assert any(s["pixel_values"].shape[0] > 1 for s in samples)
    assert any(not (s["input_ids"] == ds.image_token_id).any() for s in samples)  # a text-only record
    model = tiny_llava(seed=2, vocab=ds.vocab_size_needed, image_token_id=ds.image_token_id)
    model.zero_grad(set_to_none=True)
    total = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    ref = 0.0
    with torch.no_grad():
        for s in samples:
            has_image = bool((s["input_ids"] == ds.image_token_id).any())
            out = model(input_ids=s["input_ids"][None], pixel_values=s["pixel_values"] if has_image else None,
                        labels=s["labels"][None], num_items_in_batch=torch.tensor(total))
            ref += float(out.loss)
        batch = HFPackCollator.for_model(model, tokens_per_tile=16)(samples)
        assert _rel(float(model(**batch).loss), ref) <= 1e-5


# ------------------------------------------------------------------------------------------------ Trainer, 1 process


def _args(out, **overrides):
    from transformers import TrainingArguments

    kw = dict(output_dir=str(out), per_device_train_batch_size=1, gradient_accumulation_steps=2, report_to=[],
              use_cpu=True, disable_tqdm=True, save_strategy="no")
    kw.update(overrides)
    return TrainingArguments(**kw)


def test_trainer_refuses_what_would_train_wrong(tmp_path):
    dataset = PatternDataset(varied_stats(16, tokens_per_tile=16))
    with pytest.raises(InputError, match="per_device_train_batch_size"):
        OmnibalTrainer(model=tiny_llava(), args=_args(tmp_path, per_device_train_batch_size=2), train_dataset=dataset)
    with pytest.raises(InputError, match="num_samples"):
        OmnibalTrainer(model=tiny_llava(), args=_args(tmp_path), train_dataset=dataset,
                       stats=varied_stats(15, tokens_per_tile=16))
    with pytest.raises(InputError, match="attention"):
        OmnibalTrainer(model=tiny_llava(), args=_args(tmp_path), train_dataset=dataset,
                       data_collator=HFPackCollator(image_token_id=IMAGE_TOKEN_ID, attention="flash"))
    with pytest.raises(InputError, match="sample_index"):
        OmnibalTrainer(model=tiny_llava(), args=_args(tmp_path), train_dataset=dataset, ledger_path=tmp_path / "l",
                       data_collator=HFPackCollator(image_token_id=IMAGE_TOKEN_ID))


def test_trainer_counts_real_tokens_and_evaluates_packs(tmp_path):
    dataset = PatternDataset(varied_stats(16, tokens_per_tile=16))
    args = _args(tmp_path, max_steps=1, per_device_eval_batch_size=4, include_num_input_tokens_seen="non_padding")
    trainer = OmnibalTrainer(model=tiny_llava(), args=args, train_dataset=dataset, eval_dataset=dataset)
    trainer.train()
    sampler = BalancedBatchSampler(dataset.stats, dp_rank=0, dp_size=1, num_microbatches=2, seed=args.seed)
    tokens = sum(int(dataset.stats.tokens[mb].sum()) for mb in list(sampler)[:2])  # the first step's 2 packs
    assert trainer.state.num_input_tokens_seen == tokens  # not the 4-D mask's T x T entries
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval_loss"]))  # eval: packs of 4 samples


def _ledger(folder: Path) -> list[dict]:
    """The micro-batches in the final weights, rank file after rank file (``omnibal.train.ledger``'s format)."""
    return [event for path in sorted(folder.glob("ledger-rank*.jsonl"))
            for events in final_steps(read_ledger(path)).values() for event in events]


def _per_epoch_counts(ledger: list[dict]) -> dict[int, Counter]:
    counts: dict[int, Counter] = {}
    for rec in ledger:
        counts.setdefault(rec["epoch"], Counter()).update(rec["rows"])
    return counts


def _losses(folder: Path, after: int = 0) -> dict[int, float]:
    history = json.loads((folder / "log.json").read_text())["log_history"]
    return {h["step"]: h["loss"] for h in history if "loss" in h and h["step"] > after}


def _steps_per_epoch(stats, world: int, microbatches: int = 2) -> int:
    sampler = BalancedBatchSampler(stats, dp_rank=0, dp_size=world, num_microbatches=microbatches, seed=0)
    return len(sampler) // microbatches


def test_single_process_resume_at_an_epoch_boundary_and_refusals(tmp_path):
    common = ["--samples=16", "--save-steps=1", "--epochs=2"]
    steps = _steps_per_epoch(varied_stats(16, tokens_per_tile=16), world=1)
    run([f"--out={tmp_path / 'full'}", *common])
    run([f"--out={tmp_path / 'part'}", f"--stop-at={steps}", *common])
    ckpt = tmp_path / "part" / f"checkpoint-{steps}"
    run([f"--out={tmp_path / 'part'}", f"--resume={ckpt}", *common])
    assert _losses(tmp_path / "part", after=steps) == pytest.approx(_losses(tmp_path / "full", after=steps),
                                                                     rel=1e-5)
    assert len(_losses(tmp_path / "full")) == 2 * steps
    full, part = _ledger(tmp_path / "full"), _ledger(tmp_path / "part")
    assert part == full
    assert all(set(c.values()) == {1} and len(c) == 16 for c in _per_epoch_counts(part).values())

    state = ckpt / STATE_FILE.format(rank=0)
    with pytest.raises(InputError, match="stats_fingerprint") as err:
        run([f"--out={tmp_path / 'other'}", f"--resume={ckpt}", "--stats-seed=1", *common])
    assert err.value.source == str(state)
    record = json.loads(state.read_text())
    state.write_text(json.dumps(dict(record, world_size=2)))
    with pytest.raises(InputError, match="world_size"):
        run([f"--out={tmp_path / 'other'}", f"--resume={ckpt}", *common])
    state.unlink()
    with pytest.raises(InputError, match="no omnibal sampler state"):
        run([f"--out={tmp_path / 'other'}", f"--resume={ckpt}", *common])


# ------------------------------------------------------------------------------------------------ Trainer, torchrun x 2


def _torchrun(out: Path, *args: str) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(TESTS / "hf_trainer_worker.py"),
           f"--out={out}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": f"{ROOT / 'src'}:{TESTS}"}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return time.monotonic() - t0


NUM_SAMPLES = 48
COMMON = [f"--samples={NUM_SAMPLES}", "--epochs=2", "--save-steps=4"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf-ddp") / "full"
    _torchrun(out, *COMMON)
    return out


@pytest.mark.multiprocess
def test_ddp_trainer_trains_every_sample_once_per_epoch_and_the_loss_falls(full_run):
    ledger = _ledger(full_run)
    stats = varied_stats(NUM_SAMPLES, tokens_per_tile=16)
    counts = _per_epoch_counts(ledger)
    assert sorted(counts) == [0, 1]
    for epoch, c in counts.items():
        assert sorted(c) == list(range(NUM_SAMPLES)) and set(c.values()) == {1}, epoch
    # each rank trained exactly its own row of the schedule (not re-sharded by accelerate), 2 packs per step
    for rank in (0, 1):
        sampler = BalancedBatchSampler(stats, dp_rank=rank, dp_size=2, num_microbatches=2, seed=0)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            mine = [r["rows"] for r in ledger if r["rank"] == rank and r["epoch"] == epoch]
            assert mine == list(sampler)
    steps = _steps_per_epoch(stats, world=2)
    assert [r["step"] for r in ledger if r["rank"] == 0] == [s for s in range(2 * steps) for _ in range(2)]
    losses = list(_losses(full_run).values())
    assert len(losses) == 2 * steps and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[steps:]) / steps < sum(losses[:steps]) / steps - 0.1
    assert losses[-1] < losses[0] - 0.3


@pytest.mark.multiprocess
def test_ddp_resume_mid_epoch_trains_each_sample_once_and_equals_the_uninterrupted_run(full_run, tmp_path):
    stats = varied_stats(NUM_SAMPLES, tokens_per_tile=16)
    steps = _steps_per_epoch(stats, world=2)
    stop = 4
    assert stop % steps != 0  # inside the second epoch: Trainer skips the trained micro-batches of it
    part = tmp_path / "part"
    _torchrun(part, *COMMON, f"--stop-at={stop}")
    assert _losses(part).keys() == set(range(1, stop + 1))
    for rank in (0, 1):
        saved = json.loads((part / f"checkpoint-{stop}" / STATE_FILE.format(rank=rank)).read_text())
        assert saved["sampler"]["epoch"] == stop // steps
        assert saved["sampler"]["consumed_microbatches"] == (stop % steps) * 2
    _torchrun(part, *COMMON, f"--resume={part / f'checkpoint-{stop}'}")
    ledger = _ledger(part)
    assert ledger == _ledger(full_run)  # same samples on the same rank at the same step, none twice
    for epoch, c in _per_epoch_counts(ledger).items():
        assert sorted(c) == list(range(NUM_SAMPLES)) and set(c.values()) == {1}, epoch
    resumed, uninterrupted = _losses(part, after=stop), _losses(full_run, after=stop)
    assert resumed.keys() == uninterrupted.keys() == set(range(stop + 1, 2 * steps + 1))
    for step, loss in uninterrupted.items():
        assert _rel(resumed[step], loss) <= 1e-5, step
