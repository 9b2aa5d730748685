"""Helpers for the trainer tests of HBP levels with their own micro-batch counts: a ragged schedule from
``balance_hbp`` on the tiny statistics, and rank functions (forked by ``omnibal.train.distributed.spawn_local``)."""

from __future__ import annotations

import numpy as np
import torch

from dist_helpers import TIMEOUT_S, tiny_dataset, tiny_spec, tiny_stats

ROWS = 48
"""Rows of the tiny statistics the schedule trains (few steps, both levels filled)."""
LENGTHS = (32, 128)
"""Level lengths: 32 tokens per rank and 128 per SP group, so the short level runs 4x (SP 1/1) or 2x (SP 1/2)
the long level's 2 micro-batches."""


def ragged_schedule(dp_size: int, level_sp: tuple[int, int], *, stats=None, reverse: bool = False):
    """``balance_hbp`` with ``microbatches='tokens'`` on ``ROWS`` rows: levels of their own micro-batch counts
    (``reverse``: the steps in reverse order)."""
    from dataclasses import replace

    from omnibal.hbp.balance import balance_hbp
    from omnibal.hbp.levels import HBPConfig, LevelCostModel

    stats = tiny_stats() if stats is None else stats
    model = LevelCostModel(sp_degrees=(1, 2), a2a_per_token=(0.0, 0.0))
    rows = np.sort(np.random.default_rng(0).choice(len(stats), ROWS, replace=False))
    config = HBPConfig(model=model, pack_lengths=LENGTHS, level_sp=level_sp, microbatches="tokens")
    sched = balance_hbp(stats, dp_size=dp_size, num_microbatches=2, seed=0, rows=rows, config=config)
    return replace(sched, pack_ids=sched.pack_ids[::-1], levels=sched.levels[::-1]) if reverse else sched


def make_ragged_trainer(world, schedule, *, pp_schedule="1f1b", checkpoint_dir=None, ledger_path=None,
                        lr: float = 1e-3):
    from omnibal.train.feed import fixed_buffer
    from omnibal.train.loop import Trainer
    from omnibal.train.model import VLM
    from omnibal.train.stage_layout import resolve_layout

    spec, stats = tiny_spec(), tiny_stats()
    model = VLM(spec, seed=0)
    layout = resolve_layout([s.name for s, _ in model.chain()], pp_size=world.pp_size, mode="offline")
    buffer = fixed_buffer(schedule, stats, mode="offline") if world.pp_size > 1 else None
    return Trainer(world=world, model=model, layout=layout, schedule=schedule,
                   dataset=tiny_dataset(spec, stats) if world.is_first_stage else None, mode="offline",
                   num_microbatches=schedule.num_microbatches, pp_schedule=pp_schedule, lr=lr,
                   buffer=buffer, checkpoint_dir=checkpoint_dir, checkpoint_every=1 if checkpoint_dir else 0,
                   ledger_path=ledger_path)


def _grads(module) -> dict:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).numpy()
            for n, p in module.named_parameters()}


def rank_ragged_epoch(dp: int, pp: int, level_sp: tuple, checkpoint_dir, ledger_path, resume: bool,
                      grads_first: bool, reverse: bool = False, pp_schedule: str = "1f1b"):
    """On ``dp x pp`` ranks: (``grads_first``) every step's forward/backward at the initial weights (loss part,
    stage gradients, the count the step ran), then the epoch through ``Trainer.run`` with a checkpoint per
    step and the ledger (``resume``: from the newest checkpoint). Rank 0 returns the logged step records."""
    torch.set_num_threads(1)
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=dp, pp_size=pp, timeout_s=TIMEOUT_S)
    trainer = make_ragged_trainer(world, ragged_schedule(dp, level_sp, reverse=reverse),
                                  pp_schedule=pp_schedule, checkpoint_dir=checkpoint_dir,
                                  ledger_path=ledger_path)
    steps = []
    if grads_first:
        while trainer.step < trainer.schedule.num_steps:
            result = trainer.forward_backward()
            steps.append({"loss_part": result.loss_sum, "grads": _grads(trainer.stage_module),
                          "count": int(trainer.step_mbs[trainer.step]),
                          "fed": len(result.fed), "targets": result.counts["targets"]})
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer.step += 1
        trainer.step = 0
    if resume:
        trainer.maybe_resume()
    start = trainer.step
    trainer.run(0)
    records = [{"step": r.step, "loss": r.loss, "microbatches": r.microbatches, "samples": r.samples}
               for r in trainer.log.records] if world.rank == 0 else None
    destroy_world()
    return {"rank": world.rank, "steps": steps, "records": records, "start": start,
            "pipes": sorted(count for count, _ in trainer.runner._pipes)}
