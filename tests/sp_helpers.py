"""Helpers for the sequence-parallel trainer tests: long packs, a multi-level schedule, and rank functions
(run in forked processes by ``omnibal.train.distributed.spawn_local``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from dist_helpers import NUM_STEPS, TIMEOUT_S, pack_schedule, tiny_dataset, tiny_spec, tiny_stats

NUM_MICRO = 2


def level_schedule(stats, *, dp_size: int, level_sp: tuple[int, ...], levels: tuple[int, ...], seed: int = 0):
    """A balancer ``Schedule`` with HBP levels: step s of level l has dp_size / level_sp[l] groups, each
    group's ranks hold the same packs of 1-4 shuffled samples (SP groups share pack ids)."""
    from omnibal.data.balance.schedule import Caps, Schedule

    rng = np.random.default_rng(seed)
    perm = iter(rng.permutation(len(stats)).tolist())
    packs, ids = [], np.zeros((len(levels), dp_size, NUM_MICRO), np.int64)
    for s, level in enumerate(levels):
        d = level_sp[level]
        for g in range(dp_size // d):
            for k in range(NUM_MICRO):
                packs.append([next(perm) for _ in range(int(rng.integers(1, 5)))])
                ids[s, g * d:(g + 1) * d, k] = len(packs) - 1
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in packs])])
    return Schedule(dp_size=dp_size, num_microbatches=NUM_MICRO, caps=Caps(tiles=64, tokens=512),
                    pack_samples=np.concatenate(packs), pack_offsets=offsets, pack_ids=ids, num_samples=len(stats),
                    levels=levels, level_sp=level_sp, stats_fingerprint=stats.fingerprint())


def reference_step(schedule, step: int, *, seed: int = 0):
    """Loss and gradients of the distinct packs of one step (each SP group's once, the micro-batches the step
    runs) on one process."""
    from omnibal.data.collate import collate
    from omnibal.train.feed import step_microbatches
    from omnibal.train.model import VLM

    spec, stats = tiny_spec(), tiny_stats()
    dataset = tiny_dataset(spec, stats)
    model = VLM(spec, seed=seed)
    base = model.collate_config(num_tiles=1, num_tokens=1)
    d = int(schedule.step_sp()[step]) if getattr(schedule, "levels", None) is not None else 1
    batches = []
    for r in range(0, schedule.dp_size, d):
        for k in range(int(step_microbatches(schedule)[step])):
            mb = schedule.microbatch(step, r, k)
            cfg = replace(base, num_tiles=int(stats.tiles[mb].sum()), num_tokens=int(stats.tokens[mb].sum()))
            batches.append(collate([dataset[int(i)] for i in mb], cfg))
    total = sum(b.num_targets for b in batches)
    loss = sum(model(*b.carry())[0].sum() for b in batches) / total
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).numpy()
             for n, p in model.named_parameters()}
    return float(loss.detach()), grads


def make_sp_trainer(world, schedule, *, sp_degree: int = 1, recompute=None, ledger_path=None, curriculum=False,
                    lr: float = 1e-3):
    from omnibal.train.loop import Trainer
    from omnibal.train.model import VLM
    from omnibal.train.stage_layout import resolve_layout

    spec, stats = tiny_spec(), tiny_stats()
    model = VLM(spec, seed=0)
    names = [s.name for s, _ in model.chain()]
    layout = resolve_layout(names, pp_size=1, mode="offline", recompute=recompute)
    return Trainer(world=world, model=model, layout=layout, schedule=schedule, dataset=tiny_dataset(spec, stats),
                   mode="offline", num_microbatches=schedule.num_microbatches, lr=lr, ledger_path=ledger_path,
                   sp_degree=sp_degree, level_curriculum=int(curriculum))


def _grads(module) -> dict:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).numpy()
            for n, p in module.named_parameters()}


def rank_sp_step(dp: int, sp: int, recompute: bool):
    """One step with a single-level schedule for dp/sp groups and --sp-degree sp: loss part and gradients."""
    torch.set_num_threads(1)
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=dp, pp_size=1, timeout_s=TIMEOUT_S)
    schedule = pack_schedule(tiny_stats(), dp_size=dp // sp, num_microbatches=NUM_MICRO, num_steps=NUM_STEPS)
    names = [layer.name for layer in tiny_spec().layers()]
    trainer = make_sp_trainer(world, schedule, sp_degree=sp, recompute=[names] if recompute else None)
    result = trainer.forward_backward()
    out = {"rank": world.rank, "loss_part": result.loss_sum, "grads": _grads(trainer.stage_module),
           "targets": result.counts["targets"]}
    destroy_world()
    return out


def rank_level_grads(dp: int, level_sp: tuple, levels: tuple, curriculum: bool):
    """Every step of a multi-level schedule at the initial weights (no optimizer step): per step this rank's
    loss part, gradients and SP degree."""
    torch.set_num_threads(1)
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=dp, pp_size=1, timeout_s=TIMEOUT_S)
    schedule = level_schedule(tiny_stats(), dp_size=dp, level_sp=level_sp, levels=levels)
    trainer = make_sp_trainer(world, schedule, curriculum=curriculum)
    steps = []
    while trainer.step < trainer.schedule.num_steps:
        result = trainer.forward_backward()
        steps.append({"loss_part": result.loss_sum, "grads": _grads(trainer.stage_module),
                      "degree": int(trainer.step_sp[trainer.step]), "targets": result.counts["targets"]})
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.step += 1
    order = trainer.schedule.pack_ids.tolist()
    destroy_world()
    return {"rank": world.rank, "steps": steps, "pack_ids": order}


def rank_level_run(dp: int, level_sp: tuple, levels: tuple, ledger_path: str, curriculum: bool):
    """The whole multi-level epoch through ``Trainer.run`` with a ledger; rank 0 returns the step losses."""
    torch.set_num_threads(1)
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=dp, pp_size=1, timeout_s=TIMEOUT_S)
    schedule = level_schedule(tiny_stats(), dp_size=dp, level_sp=level_sp, levels=levels)
    trainer = make_sp_trainer(world, schedule, ledger_path=ledger_path, curriculum=curriculum)
    trainer.run(0)
    losses = [r.loss for r in trainer.log.records] if world.rank == 0 else None
    destroy_world()
    return {"rank": world.rank, "losses": losses, "scheduled": sorted(int(i) for i in schedule.pack_samples)}
