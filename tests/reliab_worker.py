"""One rank of the fault tests' training job: the real trainer (``omnibal.train.loop.Trainer``) on the real
balancer's schedule, a tiny model so a step takes milliseconds.

Launched by ``torchrun`` (``python -m torch.distributed.run ... tests/reliab_worker.py ARGS``) or as plain
processes with the env:// variables set. Every rank always tries to resume from the checkpoint folder, so
torchrun's ``--max-restarts`` restarts the job from the last good checkpoint after a rank dies.

It writes a *ledger* (one JSONL file per rank and attempt, each line flushed and fsynced):

``{"event": "start", "attempt", "rank", "pid", "step", "skipped"}``   after resuming (``step``: first step to run)
``{"event": "step", "attempt", "rank", "dp_rank", "step", "samples"}``  after each step (stage-0 ranks only)
``{"event": "checkpoint", "attempt", "rank", "step"}``                 after each checkpoint (``step`` = next step)
``{"event": "done", "attempt", "rank", "params"}``                       at the end (``params``: path of the weights)
``{"event": "error", "attempt", "rank", "type", "message", "elapsed"}``  when a step fails (then exit 3)

These events drive the tests (when to kill whom, where each attempt resumed, what it refused). Which samples
are in the final model is read from the trainer's own per-sample ledger (``Trainer(ledger_path=...)``, the
``omnibal train --ledger`` file), ``LEDGER/trainer.jsonl``, shared by every attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def tiny_spec():
    from omnibal.cost.spec import LLMSpec, ModelSpec, VisionSpec

    return ModelSpec(
        name="reliab-tiny",
        vision=VisionSpec(num_layers=2, hidden=32, num_heads=4, mlp_hidden=64, image_size=32, patch_size=8),
        llm=LLMSpec(num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, mlp_hidden=64, vocab_size=64),
        downsample_ratio=0.5,
    )


def tiny_stats(num_samples: int, seed: int = 0):
    from omnibal.stats.table import SampleStats

    rng = np.random.default_rng(seed)
    tiles = rng.integers(1, 4, num_samples)
    tokens = tiles * 4 + 1 + rng.integers(4, 24, num_samples)
    return SampleStats.from_arrays(tiles=tiles, tokens=tokens, source="reliab-tiny")


def epoch_schedule(stats, *, dp_size: int, num_microbatches: int, seed: int = 0, epoch: int = 0):
    from omnibal.data.balance import balance

    return balance(stats, dp_size=dp_size, num_microbatches=num_microbatches, seed=seed, epoch=epoch)


class Ledger:
    def __init__(self, folder: str, rank: int, attempt: int) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.base = {"attempt": attempt, "rank": rank}
        self.file = open(Path(folder) / f"rank{rank}.attempt{attempt}.jsonl", "a", encoding="utf-8")

    def write(self, **fields) -> None:
        self.file.write(json.dumps({**self.base, "t": time.time(), **fields}) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--steps", type=int, default=0, help="0: the whole epoch")
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--ledger", required=True)
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to wait after each step (gives a "
                   "killer time to aim at a step)")
    p.add_argument("--attempt", type=int, default=None, help="attempt number (default: torchrun's restart count)")
    p.add_argument("--reshard", action="store_true", help="resume on another DP size (the intended interface: "
                   "Trainer.maybe_resume(reshard=True))")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from omnibal.data.dataset import SyntheticSampleConfig, SyntheticVLMDataset
    from omnibal.train.distributed import destroy_world, init_world
    from omnibal.train.feed import fixed_buffer
    from omnibal.train.loop import Trainer
    from omnibal.train.model import VLM
    from omnibal.train.stage_layout import resolve_layout

    attempt = args.attempt if args.attempt is not None else int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    ledger = Ledger(args.ledger, rank, attempt)
    ledger.write(event="launched", pid=os.getpid())
    world = init_world(dp_size=args.dp, pp_size=args.pp, timeout_s=args.timeout)
    spec = tiny_spec()
    stats = tiny_stats(args.samples)
    schedule = epoch_schedule(stats, dp_size=args.dp, num_microbatches=args.microbatches)
    dataset = SyntheticVLMDataset(stats, SyntheticSampleConfig(
        image_size=spec.vision.image_size, tokens_per_tile=spec.llm_tokens_per_tile, vocab_size=spec.llm.vocab_size,
        image_token_id=spec.llm.vocab_size - 1, seed=0))
    model = VLM(spec, seed=0)
    layout = resolve_layout([s.name for s, _ in model.chain()], pp_size=args.pp, mode="offline")
    buffer = fixed_buffer(schedule, stats, mode="offline") if args.pp > 1 else None
    trainer = Trainer(world=world, model=model, layout=layout, schedule=schedule, dataset=dataset, mode="offline",
                      num_microbatches=args.microbatches, lr=1e-3, buffer=buffer,
                      checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.every,
                      ledger_path=str(Path(args.ledger) / "trainer.jsonl"))
    if args.reshard:
        trainer.maybe_resume(reshard=True)
    else:
        trainer.maybe_resume()
    ledger.write(event="start", pid=os.getpid(), step=trainer.step, skipped=trainer.skipped_checkpoints,
                 num_steps=schedule.num_steps)

    step_fn, save_fn = trainer.train_step, trainer.save_checkpoint

    def guarded(fn, step):
        t0 = time.monotonic()
        try:
            return fn()
        except Exception as exc:
            ledger.write(event="error", step=step, type=type(exc).__name__, message=str(exc),
                         elapsed=time.monotonic() - t0)
            print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            os._exit(3)  # like a real job: the error is reported, the process ends (no teardown with dead peers)

    def logged_step():
        step = trainer.step
        record = guarded(step_fn, step)
        if world.is_first_stage:
            ledger.write(event="step", step=step, dp_rank=world.dp_rank, samples=trainer.consumed[-1])
        if args.step_sleep:
            time.sleep(args.step_sleep)
        return record

    def logged_save():
        guarded(save_fn, trainer.step)
        ledger.write(event="checkpoint", step=trainer.step)

    trainer.train_step, trainer.save_checkpoint = logged_step, logged_save  # the real run() loop, observed
    trainer.run(args.steps or None)  # None: to the end of the (possibly re-balanced) epoch
    params = Path(args.ledger) / f"params.rank{rank}.attempt{attempt}.pt"
    if world.dp_rank == 0:
        torch.save(trainer.stage_module.state_dict(), params)
    ledger.write(event="done", params=str(params) if world.dp_rank == 0 else None, stage=world.pp_rank)
    destroy_world()
    return 0


if __name__ == "__main__":
    sys.exit(main())
