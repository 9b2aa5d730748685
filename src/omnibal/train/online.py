"""``--mode online``: OrchMLLM-style online batch post-balancing with per-modality dispatch.

Each DP rank draws its local batch as the baseline does (a seeded permutation slice:
:func:`omnibal.train.feed.random_microbatch_schedule`, so every sample is drawn once per epoch and a resume
at step S continues the same draws). One step on every rank:

1. read the local samples; **all-gather** their sizes (tiles, tokens, target tokens, dataset index);
2. :func:`omnibal.data.online.balance_phases` on the gathered sizes (pure: every rank computes the same
   dispatch): the tiles dealt evenly to vision ranks and an LLM assignment balanced by LLM cost, placed
   to keep work on the rank that drew it where that changes no load (fewest moved bytes); the control
   run (``online_balance`` False) keeps every sample where it was drawn;
3. **all-to-all** of the samples themselves: each pixel tile goes to its vision rank (the tiles of one
   sample may go to several), token ids and labels to the rank that owns the sample's LLM phase (no shared
   dataset is assumed); pixels in the forward dtype (bf16 under ``bf16-mixed``);
4. the vision phase (``vision.embed .. projector``) runs on all tiles this rank owns, as one batch of tiles
   (a ViT attends within a tile and the projector maps each tile alone, so grouping or splitting the
   tiles of samples changes nothing);
5. **all-to-all** of the visual features, in the forward dtype, to the LLM owners
   (:class:`omnibal.train.alltoall.Exchange`, whose backward is the reverse all-to-all of the feature
   gradients), which pack their samples into up to
   ``num_microbatches`` varlen packs of similar LLM cost (block-diagonal attention) and run
   ``llm.embed .. llm.head`` on each (one backward for all of them at the end);
6. the loss is ``loss_sum / global_target_tokens`` (the count comes from the all-gather), backward runs
   through the reverse all-to-all into the vision encoder, and the trainer sums gradients over DP as in
   the other modes: the update equals the single-process gradient of the global-token-mean loss.

With pp > 1 steps 1-5 run among stage 0's ranks (which hold the vision phase) and the LLM phase runs
through each DP replica's pipeline: :mod:`omnibal.train.online_pipeline`.

Every all-to-all is flat, or node-wise with ``node_size`` (:mod:`omnibal.train.alltoall`). Model code stays
free of torch.distributed: this module calls the stage's layers by their chain position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from omnibal.data.balance.cost import DEFAULT_COST
from omnibal.data.collate import IGNORE_INDEX, NUM_META_ROWS, collate
from omnibal.data.online import balance_phases, llm_packs, phase_loads
from omnibal.data.online_owners import TransferBytes, tile_positions
from omnibal.errors import InputError
from omnibal.train.alltoall import AllToAllGroups, Exchange, all_to_all_groups, exchange_raw
from omnibal.train.distributed import caused_by_comm_error, is_comm_error, peer_failure
from omnibal.train.metrics_log import RankTimes, StepWork
from omnibal.train.online_pipeline import PackShape, bucket, check_online_layout, later_stage_step, pipes_of, share_step
from omnibal.train.samples import placeholder_sample

_COLS = 4  # gathered per sample: tiles, tokens, target tokens, dataset index


def _splits(src: np.ndarray, dst: np.ndarray, units, dp: int) -> np.ndarray:
    """``[dp, dp]`` elements each rank sends each rank: item ``i`` (a position or a tile) sends ``units[i]``
    (or ``units`` each) from ``src[i]`` to ``dst[i]`` (a rank's chunks to itself included: they stay in
    place)."""
    out = np.zeros((dp, dp), np.int64)
    np.add.at(out, (src, dst), np.broadcast_to(np.asarray(units, np.int64), np.shape(src)))
    return out


def _groups(trainer) -> AllToAllGroups:
    """The communicators of this run's all-to-alls (flat, or node-wise for ``node_size``), made on the
    first online step: every rank reaches it together, and ``new_group`` needs every rank."""
    state = trainer.online_state
    if state.groups is None:
        w = trainer.world
        dp_groups = [[d * w.pp_size + p for d in range(w.dp_size)] for p in range(w.pp_size)]
        state.groups = all_to_all_groups(dp_rank=w.dp_rank, dp_size=w.dp_size, dp_group=w.dp_group,
                                         global_ranks=dp_groups, node_size=trainer.node_size)
    return state.groups


@dataclass
class OnlineStepInfo:
    """What one online step did (every rank holds the same balance figures)."""

    vision_max_mean: float
    llm_max_mean: float
    local_vision_max_mean: float
    """The local draw's vision max/mean across ranks (what the baseline would run)."""
    local_llm_max_mean: float
    comm_s: float
    """Seconds in the all-gather and the sample all-to-all (the feature all-to-alls are inside compute)."""
    split_samples: int = 0
    """Samples whose tiles were encoded on more than one rank (the vision phase is dealt by tile)."""


def _target_count(sample: dict, image_token_id: int) -> int:
    ids, labels = sample["input_ids"], sample["labels"]
    return int(((labels[1:] != IGNORE_INDEX) & (ids[1:] != image_token_id)).sum())


def _run_layers(stage, start: int, end: int, carry):
    """Layers [start, end) of the stage's chain, each recomputed as the stage says."""
    return stage.run_layers(start, end, *carry)


def online_forward_backward(trainer) -> StepWork:
    """One ``--mode online`` step (see :func:`_online_step`); a failed collective becomes a PeerFailure naming
    this rank, the step and the silent peer, as in the other modes."""
    try:
        return _online_step(trainer)
    except InputError:
        raise
    except Exception as exc:
        if is_comm_error(exc) or caused_by_comm_error(exc):
            raise peer_failure(trainer.world, f"step {trainer.step}", exc) from exc
        raise


@dataclass
class _Dispatch:
    """Step 2's outcome, the same on every rank: the gathered sizes and each position's phase owners.
    A position is ``data owner * n_local + local index``; tiles are numbered in position order."""

    tiles: np.ndarray
    tokens: np.ndarray
    targets: np.ndarray
    index: np.ndarray
    owner: np.ndarray
    """Data owner (the rank that drew it) of every position."""
    v_tile: np.ndarray
    """Vision-phase owner of every tile."""
    l_own: np.ndarray
    """LLM-phase owner of every position."""
    n_local: int
    me: int
    dp: int
    info: OnlineStepInfo

    @property
    def tile_pos(self) -> np.ndarray:
        """Position of every tile."""
        return tile_positions(self.tiles)

    @property
    def v_mine(self) -> np.ndarray:
        """Tiles whose vision phase runs here, ascending = ordered by data owner, then position."""
        return np.flatnonzero(self.v_tile == self.me)

    @property
    def l_mine(self) -> np.ndarray:
        """Positions whose LLM phase runs here, ascending."""
        return np.flatnonzero(self.l_own == self.me)


def _online_step(trainer) -> StepWork:
    """One ``--mode online`` step of ``trainer`` (an :class:`omnibal.train.loop.Trainer`): leaves this rank's
    gradients (of the global-token-mean loss) in the model, summed over DP, and returns the step's work. With pp > 1 the
    stage-0 ranks run the vision phase and the LLM phase runs through each replica's pipeline
    (:mod:`omnibal.train.online_pipeline`)."""
    w = trainer.world
    if trainer.runner.ddp:
        raise InputError("online mode sums gradients with the flat all-reduce (dp_sync 'flat'): its layers are "
                         "called outside a DDP wrapper", source="dp_sync", field="dp_sync")
    if w.pp_size > 1:
        check_online_layout(trainer, _llm_start(trainer))
    comm = _groups(trainer) if w.dp_size > 1 else None  # every rank: node-wise groups are made collectively
    if not w.is_first_stage:
        return later_stage_step(trainer, _llm_start(trainer))
    group = w.dp_group if w.dp_size > 1 else None
    times = RankTimes()
    t0, cpu_start = time.perf_counter(), time.process_time()
    local = [int(i) for k in range(trainer.num_microbatches)
             for i in np.asarray(trainer.schedule.microbatch(trainer.step, w.dp_rank, k))]
    kept = [(i, s) for i in local for s in trainer.reader.read([i], step=trainer.step)]  # --on-error skip
    local, samples = [i for i, _ in kept], [s for _, s in kept]
    times.data_s = time.perf_counter() - t0

    t_comm = time.perf_counter()
    d = _gather_and_dispatch(trainer, samples, local, group)
    pix_flat, tok_flat = _send_samples(trainer, d, samples, comm)
    comm_s = time.perf_counter() - t_comm

    t_compute = time.perf_counter()
    with trainer.runner.precision():
        feats = _vision_phase(trainer, d, pix_flat)
        img = _features_to_llm_owners(trainer, d, feats, comm)
        if w.pp_size == 1:
            loss_sum, global_targets = _llm_phase(trainer, d, img, tok_flat)
    if w.pp_size == 1:
        loss = loss_sum / max(global_targets, 1.0)
        loss.backward()
        loss_value = float(loss.detach())
        wait_s = 0.0
    else:  # the schedule's time outside its stage's forward/backward is waiting on the pipeline
        loss_value, global_targets, wait_s = _llm_pipeline(trainer, d, img, tok_flat)
    compute_s = time.perf_counter() - t_compute - wait_s

    t_sync = time.perf_counter()
    trainer.grad_sync()
    times.dp_sync_s = time.perf_counter() - t_sync
    times.compute_s = compute_s
    tokens_all, tiles_all = float(d.tokens.sum()), float(d.tiles.sum())
    counts = {"targets": global_targets, "samples": float(len(d.tiles)), "tokens": tokens_all,
              "tiles": tiles_all, "buffer_tokens": tokens_all, "buffer_tiles": tiles_all}
    trainer.online_info.append(replace(d.info, comm_s=comm_s))
    fed = [int(d.index[p]) for p in d.l_mine]  # the samples whose loss this rank computed
    return StepWork(loss_sum=loss_value, times=times, counts=counts, fed=fed, t_start=t0, cpu_start=cpu_start)


def _gather_and_dispatch(trainer, samples: list[dict], local: list[int], group) -> _Dispatch:
    """Steps 1-2: all-gather every rank's sample sizes, then the per-phase dispatch (identical everywhere)."""
    w = trainer.world
    dp, me = w.dp_size, w.dp_rank
    image_id = trainer.collate_base.image_token_id
    mine = torch.tensor([[int(s["pixel_values"].shape[0]), int(s["input_ids"].shape[0]), _target_count(s, image_id),
                          i] for s, i in zip(samples, local)], dtype=torch.int64).reshape(-1, _COLS)
    if dp > 1:
        dev = mine.to(w.device)  # NCCL collectives take device tensors
        parts = [torch.empty_like(dev) for _ in range(dp)]
        dist.all_gather(parts, dev, group=group)
        table = torch.cat(parts).cpu().numpy()
    else:
        table = mine.numpy()
    n_local = len(local)
    tiles, tokens, targets, index = (table[:, c] for c in range(_COLS))
    owner = np.repeat(np.arange(dp), n_local)
    lv, ll = phase_loads([range(r * n_local, (r + 1) * n_local) for r in range(dp)], tiles, tokens)
    local_mm = (float(lv.max() / lv.mean()), float(ll.max() / ll.mean()))
    if not trainer.online_balance:  # the control: nothing moves
        v_tile, l_own = owner[tile_positions(tiles)], owner
        info = OnlineStepInfo(*local_mm, *local_mm, 0.0)
    else:
        plan = balance_phases(tiles, tokens, dp_size=dp, owner=owner, transfer=_transfer_bytes(trainer),
                              num_packs=trainer.num_microbatches)
        v_tile, l_own = plan.vision_tiles, plan.llm_owner
        pos = tile_positions(tiles)
        first = np.r_[0, np.cumsum(tiles)[:-1]][pos]  # each tile's sample's first tile
        split = np.unique(pos[v_tile != v_tile[first]]).size
        info = OnlineStepInfo(plan.vision_max_mean, plan.llm_max_mean, *local_mm, 0.0, split)
    return _Dispatch(tiles=tiles, tokens=tokens, targets=targets, index=index,
                     owner=owner, v_tile=v_tile, l_own=l_own, n_local=n_local, me=me,
                     dp=dp, info=info)


def transfer_dtype(trainer) -> torch.dtype:
    """The dtype pixels and visual features travel in: the forward dtype (bf16 under ``bf16-mixed``, where
    the encoder reads its input and the LLM its features in bf16 anyway), else fp32."""
    return trainer.autocast or torch.float32


def _transfer_bytes(trainer) -> TransferBytes:
    """What one tile's pixels, one token's id + label and one tile's features occupy on the wire."""
    elem = torch.empty((), dtype=transfer_dtype(trainer)).element_size()
    base = trainer.collate_base
    return TransferBytes.of(image_size=base.image_size, tokens_per_tile=base.tokens_per_tile,
                            hidden=trainer.spec.llm.hidden, element_bytes=elem)


def _send_samples(trainer, d: _Dispatch, samples: list[dict], comm) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: samples to their phase owners: each tile's pixels to its vision owner, token ids + labels to
    the LLM owner. Returns the pixels (device) and the ids/labels (host: the collator builds its tensors
    there) received."""
    w, me, n_local, dp = trainer.world, d.me, d.n_local, d.dp
    side, dtype = trainer.collate_base.image_size, transfer_dtype(trainer)
    pos_mine = np.arange(me * n_local, (me + 1) * n_local)
    tile_pos, tile_first = d.tile_pos, int(d.tiles[:me * n_local].sum())
    my_tiles = np.arange(tile_first, tile_first + int(d.tiles[pos_mine].sum()))
    pix_mine = torch.cat([samples[p - me * n_local]["pixel_values"] for p in pos_mine if d.tiles[p]]) \
        if len(my_tiles) else torch.zeros(0, 3, side, side)
    tok_send = []
    send_order = my_tiles[np.argsort(d.v_tile[my_tiles], kind="stable")] - tile_first  # by destination
    pix_flat = pix_mine[torch.as_tensor(send_order, dtype=torch.long)].reshape(-1).to(dtype)
    for r in range(dp):  # chunks in destination order
        for p in (p for p in pos_mine if d.l_own[p] == r):
            s = samples[p - me * n_local]
            tok_send += [s["input_ids"].to(torch.int64), s["labels"].to(torch.int64)]
    pix_flat = pix_flat.to(w.device)
    tok_flat = (torch.cat(tok_send) if tok_send else torch.zeros(0, dtype=torch.int64)).to(w.device)
    if dp > 1:  # received in source order = ascending tile / position
        pix_flat = exchange_raw(pix_flat, _splits(d.owner[tile_pos], d.v_tile, 3 * side * side, dp), comm)
        tok_flat = exchange_raw(tok_flat, _splits(d.owner, d.l_own, 2 * d.tokens, dp), comm)
    return pix_flat, tok_flat.cpu()


def _llm_start(trainer) -> int:
    """Chain index of ``llm.embed``: the vision phase is the layers before it."""
    return trainer.spec.vision.num_layers + 2


def _vision_phase(trainer, d: _Dispatch, pix_flat: torch.Tensor) -> torch.Tensor:
    """Step 4: the vision phase on every tile this rank owns (ascending tiles): ``[tiles, tpt, D]``."""
    w, side = trainer.world, trainer.collate_base.image_size
    num_tiles = len(d.v_mine)
    pixels = pix_flat.reshape(1, num_tiles, 3, side, side).to(w.device)
    if num_tiles == 0:  # no tile here: one zero tile keeps the encoder's graph (zero gradients), as InternVL's dummy
        pixels = torch.zeros(1, 1, 3, side, side, device=w.device, dtype=pix_flat.dtype)
    meta = torch.zeros(1, NUM_META_ROWS, 1, dtype=torch.int64, device=w.device)
    sizes = torch.tensor([[num_tiles, 1]], dtype=torch.int64, device=w.device)
    return _run_layers(trainer.stage_module, 0, _llm_start(trainer), (pixels, meta, sizes))[0][0, :num_tiles]


def _features_to_llm_owners(trainer, d: _Dispatch, feats: torch.Tensor, comm) -> torch.Tensor:
    """Step 5: visual features to the LLM owners (differentiable all-to-all); returns this rank's LLM samples'
    features ``[tiles, tpt, D]`` in ascending tile order (= position order)."""
    tpt, width, dp = trainer.collate_base.tokens_per_tile, feats.shape[-1], d.dp
    l_tile = d.l_own[d.tile_pos]
    v_mine = d.v_mine
    rows = np.argsort(l_tile[v_mine], kind="stable")  # by (destination, tile) on the way out
    # to the wire dtype (differentiable: the gradients come back in it and return to the encoder's dtype)
    send = feats[torch.as_tensor(rows, dtype=torch.long, device=feats.device)].reshape(-1).to(transfer_dtype(trainer))
    recv = Exchange.apply(send, _splits(d.v_tile, l_tile, tpt * width, dp), comm) if dp > 1 else send
    # received rows are ordered by (vision owner, tile); the packs want ascending tiles
    mine = np.flatnonzero(l_tile == d.me)
    arrival = mine[np.argsort(d.v_tile[mine], kind="stable")]
    order = np.argsort(arrival, kind="stable")
    return recv.reshape(len(mine), tpt, width)[torch.as_tensor(order, dtype=torch.long, device=recv.device)]


def _llm_samples(trainer, d: _Dispatch, tok_flat: torch.Tensor) -> tuple[dict, dict]:
    """This rank's LLM samples by position (ids and labels arrived ordered by (data owner, position) =
    ascending position; pixels are placeholders: the features replace them) and each one's first feature
    row."""
    side, tiles, tokens, l_mine = trainer.collate_base.image_size, d.tiles, d.tokens, d.l_mine
    samples_of, at = {}, 0
    for p in l_mine:
        n = int(tokens[p])
        samples_of[int(p)] = {"input_ids": tok_flat[at:at + n], "labels": tok_flat[at + n:at + 2 * n],
                              "index": int(d.index[p]),
                              "pixel_values": torch.zeros(1, 3, side, side).expand(int(tiles[p]), 3, side, side)}
        at += 2 * n
    img_start = dict(zip(l_mine.tolist(), np.concatenate([[0], np.cumsum(tiles[l_mine])])[:-1].tolist()))
    return samples_of, img_start


def _pack_rows(d: _Dispatch, group, img_start: dict) -> list[int]:
    """The feature rows (tiles) of a pack's samples, in order."""
    return [row for p in group for row in range(int(img_start[p]), int(img_start[p]) + int(d.tiles[p]))]


def _llm_phase(trainer, d: _Dispatch, img: torch.Tensor, tok_flat: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The LLM phase (pp = 1): ``(loss sum over this rank's packs, global target tokens)``.

    The rank's samples form up to ``num_microbatches`` varlen packs of similar LLM cost (attention kernels
    that cost the square of the pack length, such as the HF path's block mask, pay per pack, not per rank)."""
    cfg_base, stage, device = trainer.collate_base, trainer.stage_module, trainer.world.device
    tpt, width = cfg_base.tokens_per_tile, img.shape[-1]
    tiles, tokens = d.tiles, d.tokens
    samples_of, img_start = _llm_samples(trainer, d, tok_flat)
    llm_cost = DEFAULT_COST.sample_costs(tiles, tokens)[1]
    loss_sum = img.new_zeros(())
    for group in llm_packs(d.l_mine, llm_cost, trainer.num_microbatches):
        rows = _pack_rows(d, group, img_start)
        feats_g = img[torch.as_tensor(rows, dtype=torch.long, device=img.device)]
        n_tiles = int(tiles[group].sum())
        if n_tiles == 0:  # a text-only pack: one zero tile slot (nothing reads it)
            feats_g = torch.cat([feats_g, img.new_zeros(1, tpt, width)])
        cfg = replace(cfg_base, num_tiles=max(n_tiles, 1), num_tokens=int(tokens[group].sum()), mode="pack",
                      source=getattr(trainer.schedule, "source", "schedule"))
        mb = collate([samples_of[int(p)] for p in group], cfg).to(device)
        part, _ = _run_layers(stage, _llm_start(trainer), len(stage.layer_names),
                              (feats_g.unsqueeze(0), mb.token_meta, mb.sizes))
        loss_sum = loss_sum + part.sum()
    return loss_sum, float(d.targets.sum())


def _llm_pipeline(trainer, d: _Dispatch, img: torch.Tensor, tok_flat: torch.Tensor) -> tuple[float, float, float]:
    """The LLM phase through this replica's pipeline (stage 0, pp > 1): exactly ``num_microbatches`` packs
    (empty ones a placeholder sample) padded to the step's bucketed shape, the features as a leaf tensor;
    after the schedule its gradient goes back once through the feature all-to-all into the encoder.
    Returns ``(loss on this rank: 0 unless it is also the last stage; global target tokens; seconds the
    schedule spent outside this stage's compute)``."""
    cfg_base, device, count = trainer.collate_base, trainer.world.device, trainer.num_microbatches
    tpt, width = cfg_base.tokens_per_tile, img.shape[-1]
    samples_of, img_start = _llm_samples(trainer, d, tok_flat)
    groups = llm_packs(d.l_mine, DEFAULT_COST.sample_costs(d.tiles, d.tokens)[1], count)
    groups += [np.zeros(0, np.int64)] * (count - len(groups))
    shape = PackShape(bucket(max(max(int(d.tiles[g].sum()), 1) for g in groups)),
                      bucket(max(max(int(d.tokens[g].sum()), 1) for g in groups)))
    shape, global_targets = share_step(trainer, shape, float(d.targets.sum()))
    cfg = replace(cfg_base, num_tiles=shape.tiles, num_tokens=shape.tokens, mode="pack",
                  source=getattr(trainer.schedule, "source", "schedule"))
    feats, metas, sizes = [], [], []
    for group in groups:
        rows = torch.as_tensor(_pack_rows(d, group, img_start), dtype=torch.long, device=img.device)
        feats.append(torch.cat([img[rows], img.new_zeros(shape.tiles - len(rows), tpt, width)]))
        mb = collate([samples_of[int(p)] for p in group] or [placeholder_sample(cfg.image_size)], cfg)
        metas.append(mb.token_meta)
        sizes.append(mb.sizes)
    packed = torch.stack(feats)
    leaf = packed.detach().requires_grad_(True)
    args = (leaf, torch.cat(metas).to(device), torch.cat(sizes).to(device))
    t0 = time.perf_counter()
    loss, compute_s = pipes_of(trainer, _llm_start(trainer)).run(shape, global_targets, args)
    wait_s = max(0.0, time.perf_counter() - t0 - compute_s)
    packed.backward(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
    return loss, global_targets, wait_s
