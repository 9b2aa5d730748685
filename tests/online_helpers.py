"""Rank functions for the ``--mode online`` trainer tests (spawned processes return picklable values)."""

from __future__ import annotations

import torch

from dist_helpers import TIMEOUT_S, timed_failing_step, tiny_dataset, tiny_spec, tiny_stats

BATCH = 3
MICRO = 2


def online_schedule(dp: int, num_samples: int = 160):
    from omnibal.train.feed import random_microbatch_schedule

    return random_microbatch_schedule(num_samples, dp_size=dp, num_microbatches=MICRO, batch_size=BATCH, seed=0)


def make_online_trainer(world, *, checkpoint_dir=None, lr=1e-3, num_samples=160, ledger_path=None,
                        checkpoint_every=0, precision="fp32", node_size=0, online_balance=True, stage_layers=None,
                        pp_schedule="1f1b"):
    from omnibal.train.feed import fixed_buffer
    from omnibal.train.loop import Trainer
    from omnibal.train.model import VLM
    from omnibal.train.stage_layout import resolve_layout

    spec = tiny_spec()
    stats = tiny_stats(num_samples)
    model = VLM(spec, seed=0)
    layout = resolve_layout([s.name for s, _ in model.chain()], pp_size=world.pp_size, mode="online",
                            stage_layers=stage_layers)
    schedule = online_schedule(world.dp_size, num_samples)
    buffer = fixed_buffer(schedule, stats, mode="online") if world.pp_size > 1 else None
    return Trainer(world=world, model=model, layout=layout, schedule=schedule, buffer=buffer,
                   pp_schedule=pp_schedule,
                   dataset=tiny_dataset(spec, stats), mode="online", num_microbatches=MICRO, lr=lr,
                   checkpoint_dir=checkpoint_dir, ledger_path=ledger_path,
                   checkpoint_every=checkpoint_every, precision=precision, node_size=node_size,
                   online_balance=online_balance)


def single_process_step(dp: int, step: int = 0):
    """Loss and gradients of the global batch of ``step`` (every rank's local draw) on one process, each
    sample its own micro-batch."""
    from dataclasses import replace

    from omnibal.data.collate import collate
    from omnibal.train.model import VLM

    spec = tiny_spec()
    stats = tiny_stats()
    dataset = tiny_dataset(spec, stats)
    schedule = online_schedule(dp)
    model = VLM(spec, seed=0)
    base = model.collate_config(num_tiles=1, num_tokens=1)
    rows = [int(i) for r in range(dp) for k in range(MICRO) for i in schedule.microbatch(step, r, k)]
    batches = [collate([dataset[i]], replace(base, num_tiles=int(stats.tiles[i]), num_tokens=int(stats.tokens[i])))
               for i in rows]
    total = sum(b.num_targets for b in batches)
    loss = sum(model(*b.carry())[0].sum() for b in batches) / total
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).numpy()
             for n, p in model.named_parameters()}
    return float(loss.detach()), grads, sorted(rows)


def rank_online_forward_backward(dp: int, node_size: int = 0, online_balance: bool = True, pp: int = 1,
                                 stage_layers=None, pp_schedule: str = "1f1b", step: int = 0):
    """Forward + backward of schedule step ``step`` (the trainer is placed at it, nothing trained before)."""
    torch.set_num_threads(1)
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=dp, pp_size=pp, timeout_s=TIMEOUT_S)
    trainer = make_online_trainer(world, node_size=node_size, online_balance=online_balance,
                                  stage_layers=stage_layers, pp_schedule=pp_schedule)
    trainer.step = step
    result = trainer.forward_backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).numpy()
             for n, p in trainer.stage_module.named_parameters()}
    info = trainer.online_info[-1] if trainer.online_info else None
    shapes = sorted((s.tiles, s.tokens) for s in trainer.online_state.pipes._pipes) if pp > 1 else []
    destroy_world()
    local = [int(i) for k in range(MICRO) for i in trainer.schedule.microbatch(step, world.dp_rank, k)]
    return {"rank": world.rank, "pp_rank": world.pp_rank, "loss_part": result.loss_sum, "grads": grads,
            "fed": result.fed, "local": local, "shapes": shapes,
            "info": None if info is None else (info.vision_max_mean, info.llm_max_mean, info.local_vision_max_mean,
                                               info.local_llm_max_mean),
            "split_samples": None if info is None else info.split_samples}


def rank_online_train(dp: int, checkpoint_dir: str, num_steps: int, resume: bool, every: int, num_samples: int,
                      ledger_path: str | None = None, pp: int = 1):
    """``Trainer.run`` in online mode (checkpoints every ``every`` steps and at the end, the ledger written)."""
    torch.set_num_threads(1)
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=dp, pp_size=pp, timeout_s=TIMEOUT_S)
    trainer = make_online_trainer(world, checkpoint_dir=checkpoint_dir, num_samples=num_samples,
                                  ledger_path=ledger_path, checkpoint_every=every)
    if resume:
        trainer.maybe_resume()
    start = trainer.step
    trainer.run(num_steps or None)
    losses = [r.loss for r in trainer.log.records]
    params = {n: p.detach().clone().numpy() for n, p in trainer.stage_module.named_parameters()}
    keys = [int(k) for k in trainer.dataset.stats.keys]
    shapes = len(trainer.online_state.pipes._pipes) if pp > 1 else 0
    destroy_world()
    return {"rank": world.rank, "start": start, "losses": losses, "consumed": trainer.consumed, "params": params,
            "steps": trainer.schedule.num_steps, "keys": keys, "shapes": shapes}


def rank_online_dies(dp: int, victim: int):
    """The victim exits in the middle of step 1 (after the all-gather, before the all-to-alls)."""
    import os

    torch.set_num_threads(1)
    from omnibal.train.distributed import init_world

    world = init_world(dp_size=dp, pp_size=1, timeout_s=TIMEOUT_S)
    trainer = make_online_trainer(world)
    trainer.train_step()
    if world.rank == victim:
        import omnibal.train.online as online

        real = online.balance_phases

        def crash(*a, **k):
            os._exit(7)
        online.balance_phases = crash
        del real
    return timed_failing_step(trainer)


def rank_online_bf16_step(dp: int, pp: int = 1, stage_layers=None):
    """One ``bf16-mixed`` online step; records the dtype of every all-to-all payload."""
    torch.set_num_threads(1)
    import omnibal.train.alltoall as online
    from omnibal.train.distributed import destroy_world, init_world

    sent = []
    real = online._a2a

    def spy(x, send, recv, group):
        sent.append(str(x.dtype))
        return real(x, send, recv, group)

    online._a2a = spy
    world = init_world(dp_size=dp, pp_size=pp, timeout_s=TIMEOUT_S)
    trainer = make_online_trainer(world, precision="bf16-mixed", stage_layers=stage_layers)
    result = trainer.forward_backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).float().numpy()
             for n, p in trainer.stage_module.named_parameters()}
    destroy_world()
    online._a2a = real
    return {"rank": world.rank, "pp_rank": world.pp_rank, "loss_part": result.loss_sum, "dtypes": sent,
            "grads": grads}


def rank_two_level_matches_flat(dp: int, node_sizes: tuple[int, ...], seed: int):
    """For random split matrices (zeros included): what every node size's exchange delivers, and the
    gradient it returns, next to the flat one's."""
    torch.set_num_threads(1)
    import numpy as np

    from omnibal.train.alltoall import Exchange, all_to_all_groups
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=dp, pp_size=1, timeout_s=TIMEOUT_S)
    me = world.dp_rank
    kinds = {s: all_to_all_groups(dp_rank=me, dp_size=dp, dp_group=world.dp_group, global_ranks=[range(dp)],
                                  node_size=s) for s in (0, *node_sizes)}
    out = {s: [] for s in kinds}
    rng = np.random.default_rng(seed)
    for trial in range(4):
        splits = rng.integers(0, 4, (dp, dp)) * (rng.random((dp, dp)) < 0.8)
        # element value = 1000 * source + 100 * destination + index within the chunk: any misroute shows
        x = torch.cat([torch.arange(int(splits[me, d]), dtype=torch.float32) + 1000 * me + 100 * d
                       for d in range(dp)])
        for s, groups in kinds.items():
            leaf = x.clone().requires_grad_(True)
            got = Exchange.apply(leaf, splits, groups)
            (got * torch.arange(len(got), dtype=torch.float32)).sum().backward()
            out[s].append((got.detach().numpy().tolist(), leaf.grad.numpy().tolist(), trial))
    bf = torch.arange(6, dtype=torch.bfloat16).repeat(dp)
    half = {s: Exchange.apply(bf, np.full((dp, dp), 6), g).dtype for s, g in kinds.items()}
    destroy_world()
    return {"rank": world.rank, "out": out, "bf16": {s: str(t) for s, t in half.items()}}
