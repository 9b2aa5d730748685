"""Helpers for the HBP-inside-a-pipeline tests: a two-level schedule with per-level micro-batch counts and
recompute sets, and rank functions (forked by ``omnibal.train.distributed.spawn_local``) of a dp 2 x pp 2
world whose SP 2 level runs Ulysses inside each pipeline stage."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from dist_helpers import TIMEOUT_S, tiny_dataset, tiny_spec, tiny_stats

LEVEL_SP = (1, 2)
LEVEL_MICROBATCHES = (4, 2)
"""The short level runs more micro-batches (HBP's token rule); 1F1B on 2 stages needs at least 2."""
LEVELS = (1, 0, 1, 0)
LEVEL_RECOMPUTE = (("vision.blocks.0",), ("vision.blocks.1", "llm.blocks.0"))
"""Per level, the layers recomputed whole (the long SP level recomputes more)."""
LEVEL_SELECTIVE = ((), ("llm.blocks.1",))
SPLITS = {"vision|llm": ((0, 4), (4, 8)), "inside llm": ((0, 6), (6, 8))}
"""Stage ranges of the tiny chain: the boundary right before ``llm.embed`` (tile chunks cross it) or after
``llm.blocks.0`` (token shards cross it)."""


def hbp_schedule(stats, *, dp_size: int = 2, seed: int = 0):
    """A balancer ``Schedule`` with the levels above: a level-``l`` step has ``dp_size / LEVEL_SP[l]`` groups,
    each group's ranks hold the same ``LEVEL_MICROBATCHES[l]`` packs of 1-4 shuffled samples; the slots a
    step does not run hold an empty filler pack."""
    from omnibal.data.balance.schedule import Caps, Schedule

    rng = np.random.default_rng(seed)
    perm = iter(rng.permutation(len(stats)).tolist())
    most = max(LEVEL_MICROBATCHES)
    packs: list[list[int]] = []
    ids = np.zeros((len(LEVELS), dp_size, most), np.int64)
    for s, level in enumerate(LEVELS):
        d = LEVEL_SP[level]
        for g in range(dp_size // d):
            for k in range(LEVEL_MICROBATCHES[level]):
                packs.append([next(perm) for _ in range(int(rng.integers(1, 5)))])
                ids[s, g * d:(g + 1) * d, k] = len(packs) - 1
    filler = len(packs)
    unused = np.arange(most)[None, :] >= np.asarray(LEVEL_MICROBATCHES)[np.asarray(LEVELS)][:, None]
    ids[np.broadcast_to(unused[:, None, :], ids.shape)] = filler
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in packs]), [sum(len(p) for p in packs)]])
    return Schedule(dp_size=dp_size, num_microbatches=most, caps=Caps(tiles=48, tokens=384),
                    pack_samples=np.concatenate(packs), pack_offsets=offsets, pack_ids=ids, num_samples=len(stats),
                    levels=LEVELS, level_sp=LEVEL_SP, level_microbatches=LEVEL_MICROBATCHES,
                    stats_fingerprint=stats.fingerprint())


def make_hbp_trainer(world, ranges, *, checkpoint_dir=None, checkpoint_every=0, ledger_path=None, lr=1e-3):
    from omnibal.train.feed import fixed_buffer
    from omnibal.train.level_recompute import level_layout
    from omnibal.train.loop import Trainer
    from omnibal.train.model import VLM
    from omnibal.train.stage_layout import resolve_layout

    spec, stats = tiny_spec(), tiny_stats()
    model = VLM(spec, seed=0)
    names = [s.name for s, _ in model.chain()]
    schedule = hbp_schedule(stats, dp_size=world.dp_size)
    layout = resolve_layout(names, pp_size=world.pp_size, mode="offline", stage_layers=ranges)
    layout = level_layout(layout, names, level_recompute=LEVEL_RECOMPUTE, level_selective=LEVEL_SELECTIVE)
    buffer = fixed_buffer(schedule, stats, mode="offline") if world.pp_size > 1 else None
    return Trainer(world=world, model=model, layout=layout, schedule=schedule, dataset=tiny_dataset(spec, stats),
                   mode="offline", num_microbatches=schedule.num_microbatches, lr=lr, buffer=buffer,
                   checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, ledger_path=ledger_path)


def _count_forwards(stage) -> Counter:
    """Forward calls per layer of ``stage`` (a recomputed layer runs again in the backward)."""
    calls: Counter = Counter()
    for name in stage.layer_names:
        module = stage.get_submodule(name)
        module.register_forward_pre_hook(lambda m, a, name=name: calls.update([name]))
    return calls


def rank_hbp_pp_steps(dp: int, pp: int, ranges):
    """Every step of the two-level schedule at the initial weights (no optimizer step): per step this rank's
    loss part, its stage's gradients (summed over DP), SP degree, micro-batches and forward calls per layer."""
    torch.set_num_threads(1)
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=dp, pp_size=pp, timeout_s=TIMEOUT_S)
    trainer = make_hbp_trainer(world, ranges)
    calls = _count_forwards(trainer.stage_module)
    steps = []
    while trainer.step < trainer.schedule.num_steps:
        calls.clear()
        result = trainer.forward_backward()
        grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).numpy()
                 for n, p in trainer.stage_module.named_parameters()}
        steps.append({"loss_part": result.loss_sum, "grads": grads, "degree": int(trainer.step_sp[trainer.step]),
                      "microbatches": int(trainer.step_mbs[trainer.step]), "calls": dict(calls)})
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.step += 1
    destroy_world()
    return {"rank": world.rank, "pp_rank": world.pp_rank, "dp_rank": world.dp_rank, "steps": steps}


def rank_hbp_pp_run(dp: int, pp: int, ranges, root: str, stop_after: int | None):
    """``Trainer.run`` of the epoch with a ledger and checkpoints every 2 steps. ``stop_after``: train that
    many steps, then one more step that no checkpoint keeps, and stop (a crash); None: resume from the
    newest checkpoint (or start) and train to the end. Rank 0 returns its step losses."""
    torch.set_num_threads(1)
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=dp, pp_size=pp, timeout_s=TIMEOUT_S)
    trainer = make_hbp_trainer(world, ranges, checkpoint_dir=f"{root}/ckpt", checkpoint_every=2,
                               ledger_path=f"{root}/ledger.jsonl")
    trainer.maybe_resume()
    resumed_at = trainer.step
    if stop_after is None:
        trainer.run(0)
    else:
        trainer.run(stop_after)
        trainer.checkpoint_dir = None
        trainer.run(stop_after + 1)  # trained and in the ledger, in no checkpoint
    losses = {r.step: r.loss for r in trainer.log.records} if world.rank == 0 else None
    destroy_world()
    return {"rank": world.rank, "resumed_at": resumed_at, "losses": losses}
