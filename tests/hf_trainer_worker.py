"""One ``OmnibalTrainer`` run of a tiny random-init Llava on CPU (the real transformers ``Trainer``).

Launched by ``tests/test_hf_integration.py`` under ``torchrun --nproc-per-node 2`` (gloo); also imported there for
the tiny models and data. Writes, under ``--out``: ``ledger-rank{r}.jsonl`` (the samples each rank trained at each
step, written by OmnibalTrainer's ledger hook) and ``log.json`` (rank 0: the Trainer's log history).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from omnibal.data.collate import IGNORE_INDEX
from omnibal.data.dataset import SyntheticSampleConfig, SyntheticVLMDataset
from omnibal.stats.table import SampleStats

VOCAB = 64
IMAGE_TOKEN_ID = VOCAB - 1
IMAGE_SIZE = 32


def tiny_llava(seed: int = 0, vocab: int = VOCAB, image_token_id: int = IMAGE_TOKEN_ID):
    """3 CLIP layers (32 px tiles of 8 px patches: 16 image tokens per tile) + 3 Llama layers, fp32."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                          image_size=IMAGE_SIZE, patch_size=8, projection_dim=32)
    tc = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=vocab)
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=vc, text_config=tc,
                                                     image_token_id=image_token_id)).float()


def tiny_internvl(seed: int = 0, vocab: int = VOCAB, image_token_id: int = IMAGE_TOKEN_ID):
    """3 InternViT layers (pixel shuffle 0.5: 4 image tokens per 32 px tile) + 3 Qwen2 layers, fp32."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig, Qwen2Config

    vc = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=[IMAGE_SIZE, IMAGE_SIZE], patch_size=[8, 8])
    tc = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=False)
    torch.manual_seed(seed)
    cfg = InternVLConfig(vision_config=vc, text_config=tc, image_token_id=image_token_id, tie_word_embeddings=False)
    return InternVLForConditionalGeneration(cfg).float()


def varied_stats(num_samples: int, tokens_per_tile: int, seed: int = 0) -> SampleStats:
    """Samples of 1-3 tiles (a quarter text-only, with InternVL's dummy tile) and 6-40 text tokens."""
    rng = np.random.default_rng(seed)
    tiles = rng.integers(1, 4, num_samples)
    images = (rng.random(num_samples) > 0.25).astype(np.int32)
    tiles[images == 0] = 1
    tokens = tiles * tokens_per_tile * images + rng.integers(6, 41, num_samples)
    return SampleStats.from_arrays(tiles=tiles, tokens=tokens, images=images, source="hf-test-stats")


def synthetic(stats: SampleStats, tokens_per_tile: int, seed: int = 0) -> SyntheticVLMDataset:
    cfg = SyntheticSampleConfig(image_size=IMAGE_SIZE, tokens_per_tile=tokens_per_tile, vocab_size=VOCAB,
                                image_token_id=IMAGE_TOKEN_ID, seed=seed)
    return SyntheticVLMDataset(stats, cfg)


class PatternDataset(Dataset):
    """``SyntheticVLMDataset`` samples (sizes from ``stats``, random pixels, same format) whose text is learnable:
    each text token is the previous one + 1 (mod 62), from a per-sample start. ``.stats`` is the stats table."""

    def __init__(self, stats: SampleStats, tokens_per_tile: int = 16) -> None:
        self.stats = stats
        self.inner = synthetic(stats, tokens_per_tile)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict:
        s = dict(self.inner[index])
        ids = s["input_ids"].clone()
        text = ids != IMAGE_TOKEN_ID
        ids[text] = (index * 7 + torch.arange(int(text.sum()))) % (VOCAB - 2)
        s["input_ids"] = ids
        s["labels"] = torch.where(s["labels"] != IGNORE_INDEX, ids, torch.full_like(ids, IGNORE_INDEX))
        return s


def _stop_callback(step: int):
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        """Save and stop after optimizer step ``step`` (a run that is interrupted there)."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_save = True
                control.should_training_stop = True

    return StopAt()


def run(argv: list[str] | None = None):
    """Parse ``argv``, train, write the ledger and ``log.json``; returns the trainer."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="output folder (checkpoints, ledger, log)")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--stats-seed", type=int, default=0, help="seed of the sample sizes")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--stop-at", type=int, default=0, help="save and stop after this step (0: run to the end)")
    p.add_argument("--resume", default="", help="checkpoint folder to resume from (latest: the newest complete)")
    p.add_argument("--lr", type=float, default=1e-2)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import TrainingArguments

    from omnibal.integrations.hf import OmnibalTrainer

    out = Path(a.out)
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=1, gradient_accumulation_steps=a.microbatches,
        num_train_epochs=a.epochs, learning_rate=a.lr, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, logging_steps=1, save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500, report_to=[], use_cpu=True, seed=0,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0, disable_tqdm=True, ddp_find_unused_parameters=True)
    dataset = PatternDataset(varied_stats(a.samples, tokens_per_tile=16, seed=a.stats_seed))
    trainer = OmnibalTrainer(model=tiny_llava(seed=0), args=args, train_dataset=dataset,
                             ledger_path=str(out / "ledger-rank{rank}.jsonl"),
                             callbacks=[_stop_callback(a.stop_at)] if a.stop_at else None)
    trainer.train(resume_from_checkpoint=True if a.resume == "latest" else a.resume or None)
    if trainer.args.process_index == 0:
        (out / "log.json").write_text(json.dumps({"log_history": trainer.state.log_history,
                                                  "global_step": trainer.state.global_step,
                                                  "world_size": trainer.args.world_size}))
    return trainer


def main(argv: list[str] | None = None) -> int:
    run(argv)
    if torch.distributed.is_initialized():  # leave the gloo group cleanly before the interpreter exits
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Every output is written and closed and the process group is gone. Skip the interpreter's teardown: with
    # DeepSpeed installed beside transformers (as CI does for the engine tests) a native thread is sometimes
    # still joinable when static destructors run, and the process aborts ("terminate called without an active
    # exception", SIGABRT) after the run succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
