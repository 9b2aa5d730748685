"""Helpers for the multi-process trainer tests: a tiny model, data, schedules, and rank functions.

Rank functions run in spawned processes (``omnibal.train.distributed.spawn_local``); they return plain
picklable values (numpy arrays, floats, strings) that the test compares against a single-process run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from omnibal.cost.spec import LLMSpec, ModelSpec, VisionSpec
from omnibal.stats.table import SampleStats

TIMEOUT_S = 20.0
NUM_STEPS = 6


def tiny_spec(vision_layers: int = 2, llm_layers: int = 2) -> ModelSpec:
    return ModelSpec(
        name="dist-test-tiny",
        vision=VisionSpec(num_layers=vision_layers, hidden=32, num_heads=4, mlp_hidden=64, image_size=32,
                          patch_size=8),
        llm=LLMSpec(num_layers=llm_layers, hidden=32, num_heads=4, num_kv_heads=2, mlp_hidden=64, vocab_size=64),
        downsample_ratio=0.5,
    )


def tiny_stats(num_samples: int = 160, seed: int = 0) -> SampleStats:
    rng = np.random.default_rng(seed)
    tiles = rng.integers(1, 4, num_samples)
    tokens = tiles * 4 + 1 + rng.integers(4, 24, num_samples)
    return SampleStats.from_arrays(tiles=tiles, tokens=tokens, source="dist-test-stats")


def tiny_plan(ranges, recompute=None, *, model: str = "dist-test-tiny", names=None):
    """A real ``omnibal.plan.plan.Plan`` for the tiny model (made-up stage times): the trainer reads plans
    with ``Plan.load`` only."""
    from omnibal.plan.plan import measured_plan

    names = names or [layer.name for layer in tiny_spec().layers()]
    parts = [a for a, _ in ranges] + [ranges[-1][1]]
    return measured_plan(model=model, layer_names=names, parts=parts, stage_times_s=[1.0] * len(ranges),
                         num_samples=160, recompute=recompute, num_microbatches=4, source="test")


def tiny_dataset(spec: ModelSpec, stats: SampleStats, seed: int = 0):
    from omnibal.data.dataset import SyntheticSampleConfig, SyntheticVLMDataset

    cfg = SyntheticSampleConfig(image_size=spec.vision.image_size, tokens_per_tile=spec.llm_tokens_per_tile,
                          vocab_size=spec.llm.vocab_size, image_token_id=spec.llm.vocab_size - 1, seed=seed)
    return SyntheticVLMDataset(stats, cfg)


def pack_schedule(stats: SampleStats, *, dp_size: int, num_microbatches: int, num_steps: int, seed: int = 0):
    """Packs of 1-4 shuffled samples (uneven on purpose: the loss normalisation must not care), dealt to
    (step, rank, micro-batch) in order."""
    from omnibal.train.feed import IndexSchedule

    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(stats))
    sizes = rng.integers(1, 5, num_steps * dp_size * num_microbatches)
    assert sizes.sum() <= len(perm), (sizes.sum(), len(perm))
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    packs = [perm[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    it = iter(packs)
    steps = tuple(tuple(tuple(next(it) for _ in range(num_microbatches)) for _ in range(dp_size))
                  for _ in range(num_steps))
    return IndexSchedule(dp_size, num_microbatches, steps, None, "test packs")


def plain_schedule_doc(schedule) -> dict:
    """The hand-made single-level JSON form of a schedule: no caps, its steps as nested lists of rows."""
    return {"dp_size": schedule.dp_size, "num_microbatches": schedule.num_microbatches,
            "steps": [[[schedule.microbatch(s, r, k).tolist() for k in range(schedule.num_microbatches)]
                       for r in range(schedule.dp_size)] for s in range(schedule.num_steps)]}


def make_trainer(world, *, mode="offline", num_microbatches=4, num_steps=NUM_STEPS, pp_schedule="1f1b",
                 stage_layers=None, checkpoint_dir=None, checkpoint_every=0, lr=1e-3, recompute=None, log_path=None,
                 dp_sync="flat", precision="fp32", selective=None, schedule_seed=0, plan_path=None):
    from omnibal.train.feed import fixed_buffer
    from omnibal.train.loop import Trainer
    from omnibal.train.model import VLM
    from omnibal.train.stage_layout import resolve_layout

    spec = tiny_spec()
    stats = tiny_stats()
    dataset = tiny_dataset(spec, stats)
    schedule = pack_schedule(stats, dp_size=world.dp_size, num_microbatches=num_microbatches, num_steps=num_steps,
                             seed=schedule_seed)
    model = VLM(spec, seed=0)
    names = [s.name for s, _ in model.chain()]
    layout = resolve_layout(names, pp_size=world.pp_size, mode=mode, stage_layers=stage_layers, recompute=recompute,
                            selective=selective, plan_path=plan_path,
                            model_name=None if plan_path is None else spec.name)
    buffer = fixed_buffer(schedule, stats, mode=mode) if world.pp_size > 1 else None
    return Trainer(world=world, model=model, layout=layout, schedule=schedule, dataset=dataset, mode=mode,
                   num_microbatches=num_microbatches, pp_schedule=pp_schedule, lr=lr, buffer=buffer,
                   checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, log_path=log_path,
                   dp_sync=dp_sync, precision=precision)


def single_process_reference(*, dp_size: int, num_microbatches: int, step: int = 0, autocast=None):
    """Loss and gradients of the whole global batch of ``step`` on one process (no torch.distributed);
    ``autocast``: the forward's dtype under ``torch.autocast`` (None: fp32)."""
    from omnibal.data.collate import collate
    from omnibal.train.model import VLM

    spec = tiny_spec()
    stats = tiny_stats()
    dataset = tiny_dataset(spec, stats)
    schedule = pack_schedule(stats, dp_size=dp_size, num_microbatches=num_microbatches, num_steps=NUM_STEPS)
    model = VLM(spec, seed=0)
    base = model.collate_config(num_tiles=1, num_tokens=1)
    from dataclasses import replace

    batches = []
    for r in range(dp_size):
        for k in range(num_microbatches):
            mb = schedule.microbatch(step, r, k)
            cfg = replace(base, num_tiles=int(stats.tiles[mb].sum()), num_tokens=int(stats.tokens[mb].sum()))
            batches.append(collate([dataset[int(i)] for i in mb], cfg))
    total = sum(b.num_targets for b in batches)
    loss = torch.zeros(())
    for b in batches:
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            loss_sum, _ = model(*b.carry())
        loss = loss + loss_sum.sum()
    loss = loss / total
    loss.backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).numpy()
             for n, p in model.named_parameters()}
    return float(loss.detach()), grads


# ------------------------------------------------------------------------------------------------ rank fns


def rank_forward_backward(dp: int, pp: int, pp_schedule: str, dp_sync: str = "flat", precision: str = "fp32",
                          recompute=None, selective=None):
    """One step's forward/backward + DP sync (no optimizer): this rank's loss part and stage gradients."""
    torch.set_num_threads(1)
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=dp, pp_size=pp, timeout_s=TIMEOUT_S)
    trainer = make_trainer(world, pp_schedule=pp_schedule, dp_sync=dp_sync, precision=precision,
                           recompute=recompute, selective=selective)
    result = trainer.forward_backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).numpy()
             for n, p in trainer.stage_module.named_parameters()}
    destroy_world()
    return {"rank": world.rank, "loss_part": result.loss_sum, "grads": grads}


def timed_failing_step(trainer) -> dict:
    """One step of a run whose peer is about to die: how it ended (exception type and message) and how long
    it took to end."""
    t0 = time.monotonic()
    try:
        trainer.train_step()
    except Exception as exc:
        return {"error_type": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - t0}
    return {"error_type": None, "message": "", "elapsed": time.monotonic() - t0}


def rank_dies_mid_step(dp: int, pp: int, victim: int):
    """The victim rank crashes inside step 1, in the forward of its second micro-batch (mid-pipeline)."""
    torch.set_num_threads(1)
    from omnibal.train.distributed import init_world

    world = init_world(dp_size=dp, pp_size=pp, timeout_s=TIMEOUT_S)
    trainer = make_trainer(world)
    trainer.train_step()
    if world.rank == victim:
        calls = []

        def crash(module, args):
            calls.append(1)
            if len(calls) == 2:
                os._exit(7)  # a crash: no clean-up, the sockets close

        trainer.stage_module.register_forward_pre_hook(crash)
    return timed_failing_step(trainer)


def rank_train_steps(dp: int, pp: int, checkpoint_dir: str, num_steps: int, resume: bool, every: int):
    torch.set_num_threads(1)
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=dp, pp_size=pp, timeout_s=TIMEOUT_S)
    trainer = make_trainer(world, checkpoint_dir=checkpoint_dir, checkpoint_every=every)
    resumed_from = trainer.step
    if resume:
        trainer.maybe_resume()
        resumed_from = trainer.step
    losses = []
    while trainer.step < num_steps:
        record = trainer.train_step()
        losses.append(None if record is None else record.loss)
        if every and trainer.step % every == 0:
            trainer.save_checkpoint()
    destroy_world()
    return {"rank": world.rank, "resumed_from": resumed_from, "losses": losses, "consumed": trainer.consumed,
            "skipped": trainer.skipped_checkpoints}


def rank_schedule_mismatch(odd_rank: int):
    """Rank ``odd_rank`` builds its trainer's schedule and its sampler with another seed (as a node given other
    inputs would); how the first step and the sampler's first micro-batch ended on this rank:
    ``(error type, ranks named, message)`` each (None: it went on)."""
    torch.set_num_threads(1)
    from omnibal.data.sampler import BalancedBatchSampler
    from omnibal.errors import ScheduleMismatch
    from omnibal.train.distributed import destroy_world, fingerprint_exchange, init_world

    world = init_world(dp_size=2, pp_size=1, timeout_s=TIMEOUT_S)
    seed = 1 if world.rank == odd_rank else 0
    trainer = make_trainer(world, num_microbatches=2, schedule_seed=seed)
    out = {"trainer": None, "sampler": None}
    try:
        trainer.train_step()
    except ScheduleMismatch as exc:
        out["trainer"] = (type(exc).__name__, exc.ranks, str(exc))
    out["steps"] = trainer.step
    sampler = BalancedBatchSampler(tiny_stats(), dp_rank=world.dp_rank, dp_size=world.dp_size, seed=seed,
                                   exchange=fingerprint_exchange(world.dp_group))
    try:
        next(iter(sampler))
    except ScheduleMismatch as exc:
        out["sampler"] = (type(exc).__name__, exc.ranks, str(exc))
    destroy_world()
    return out


def rank_interleaved_forward_backward(num_chunks: int = 2, num_microbatches: int = 4):
    """One step of interleaved 1F1B over pp 2 x ``num_chunks`` virtual stages (the tiny model's chain split
    evenly; rank ``d`` runs chunks ``d``, ``d + 2``, ...) through ``StageRunner``: this rank's loss part, its
    chunks' gradients, and whether the runner reused its cached schedule on a second step of the same count."""
    torch.set_num_threads(1)
    from torch import nn

    from omnibal.data.collate import collate
    from omnibal.train.distributed import destroy_world, init_world
    from omnibal.train.feed import fixed_buffer
    from omnibal.train.model import VLM
    from omnibal.train.pipeline import StageRunner
    from omnibal.train.stage import build_stage, example_carry
    from omnibal.train.stage_layout import even_split

    pp = 2
    world = init_world(dp_size=1, pp_size=pp, timeout_s=TIMEOUT_S)
    spec, stats = tiny_spec(), tiny_stats()
    dataset = tiny_dataset(spec, stats)
    schedule = pack_schedule(stats, dp_size=1, num_microbatches=num_microbatches, num_steps=NUM_STEPS)
    model = VLM(spec, seed=0)
    ranges = even_split(len(model.chain()), pp * num_chunks)
    mine = [ranges[c * pp + world.pp_rank] for c in range(num_chunks)]
    chunks = nn.ModuleList([build_stage(model, a, b) for a, b in mine])
    buffer = fixed_buffer(schedule, stats, mode="offline")
    kw = dict(num_tiles=buffer.tiles, num_tokens=buffer.tokens, device=world.device)
    runner = StageRunner(chunks, stage_index=world.pp_rank, num_stages=pp, device=world.device,
                         num_microbatches=num_microbatches, pp_schedule="interleaved", pp_group=world.pp_group,
                         example_inputs=[example_carry(model, a, **kw) for a, _ in mine],
                         example_outputs=[example_carry(model, b, **kw) for _, b in mine], num_chunks=num_chunks)
    base = model.collate_config(num_tiles=buffer.tiles, num_tokens=buffer.tokens)
    batches = [collate([dataset[int(i)] for i in schedule.microbatch(0, 0, k)], base)
               for k in range(num_microbatches)]
    total = sum(b.num_targets for b in batches)
    result = runner.run_step([b.carry() for b in batches] if world.pp_rank == 0 else None, global_targets=total)
    own = {id(p) for p in chunks.parameters()}
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).numpy()
             for n, p in model.named_parameters() if id(p) in own}
    first = runner._pipes[num_microbatches, 1]
    runner.run_step([b.carry() for b in batches] if world.pp_rank == 0 else None, global_targets=total)
    reused = runner._pipes[num_microbatches, 1] is first and len(runner._pipes) == 1
    destroy_world()
    return {"rank": world.rank, "loss_part": result.loss_sum, "grads": grads, "reused": reused,
            "stage_indices": [s.stage_index for s in first[0]]}


def interleaved_tiny_plan(path, *, pp: int = 2, chunks: int = 2, recompute=None):
    """A real plan file for the tiny model with ``pp x chunks`` virtual stages (even split), written to
    ``path``: what ``omnibal plan`` writes for an interleaved plan, as the trainer reads it."""
    import dataclasses

    from omnibal.train.stage_layout import even_split

    names = [layer.name for layer in tiny_spec().layers()]
    plan = tiny_plan(list(even_split(len(names), pp * chunks)), recompute)
    inputs = dataclasses.replace(plan.inputs, layout=dataclasses.replace(plan.inputs.layout, pp_size=pp),
                                 num_chunks=chunks)
    plan = dataclasses.replace(plan, inputs=inputs, search={"pp_schedule": "interleaved", "num_chunks": chunks})
    plan.save(path)
    return path


def rank_interleaved_trainer(plan_path: str, num_steps: int = 2):
    """The Trainer on an interleaved plan file (pp 2): its schedule, the first step's loss part and chunk
    gradients (model names), and the losses of ``num_steps`` optimizer steps."""
    torch.set_num_threads(1)
    from omnibal.train.distributed import destroy_world, init_world

    world = init_world(dp_size=1, pp_size=2, timeout_s=TIMEOUT_S)
    trainer = make_trainer(world, plan_path=plan_path)
    result = trainer.forward_backward()
    grads = {n.split(".", 1)[1]: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)).numpy()
             for n, p in trainer.stage_module.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.step = 0
    losses = [trainer.train_step() for _ in range(num_steps)]
    destroy_world()
    return {"rank": world.rank, "pp_schedule": trainer.pp_schedule, "loss_part": result.loss_sum, "grads": grads,
            "records": [None if r is None else r.loss for r in losses]}


def rank_pids(parent: int) -> list[int]:
    """The ranks ``omnibal train`` started as local processes under ``parent``, first rank first: its children
    (forked on CPU, spawned on CUDA), never multiprocessing's resource tracker. Needs /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"resource_tracker" not in cmdline:
            out.append(int(entry.name))
    return sorted(out)
