"""Ulysses-style sequence parallelism (SP) for the reference trainer, applied from outside the model.

An SP group is ``d`` consecutive DP ranks (ranks ``r`` with the same ``r // d``) that hold the *same*
micro-batches (the schedule says so, see :class:`omnibal.data.balance.schedule.Schedule`); each rank runs
1/d of every pack:

- **vision**: the pack's tiles are dealt in ``d`` contiguous chunks, each rank encodes its chunk (ViT +
  projector), and the image features are all-gathered (backward: the gradients of the whole feature tensor
  are summed over the group and each rank keeps its chunk's). Tiles are independent in the ViT (attention
  inside a tile), so splitting them is exact and costs one all-gather per micro-batch instead of every
  rank encoding every tile.
- **LLM**: rank ``j`` holds tokens ``[j*n/d, (j+1)*n/d)`` of the pack (padded to a multiple of ``d`` with
  ignored tokens of their own segment), with its own slice of position ids and shifted labels, so RoPE and
  the loss need nothing from the others. Inside every decoder block one all-to-all turns
  ``[H, n/d, hd]`` (all heads, own tokens) into ``[H/d, n, hd]`` (own heads, all tokens), the packed
  block-diagonal causal attention runs on the full sequence (varlen per segment), and a second all-to-all
  turns it back. An all-to-all with equal chunks is its own transpose, so its backward is the same exchange
  of the gradient.

Each rank's loss is the sum over its token shard; the trainer counts a pack's targets once per group, sums
the loss parts and (with the flat DP all-reduce over all ranks) the partial gradients: the update equals the
run without SP (tested to 1e-5).

    sp = SequenceParallel(stage, world=world, degrees={2, 4}, spec=spec)   # all ranks, same order
    module = sp.activate(2)          # this step's SP degree (1: the plain stage)
    loss_sum, num_targets = module(*micro_batch.carry())

Model code (:mod:`omnibal.train.layers`) stays free of torch.distributed: this module puts an exchange
object into the layers' shared ``Options.sequence_parallel``.
"""

from __future__ import annotations

import datetime
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from omnibal.data.collate import IGNORE_INDEX, META_IMAGE_INDEX, META_LABELS, META_SEGMENT_IDS, SIZE_TILES, SIZE_TOKENS
from omnibal.errors import InputError
from omnibal.train.layers import packed_causal_attention
from omnibal.validate import is_int


def check_sp_degree(degree: int, *, dp_size: int, num_heads: int, source: str = "--sp-degree",
                    field: str = "sp_degree") -> None:
    """An SP degree must be a positive integer dividing the DP size and the LLM's attention heads."""
    if not is_int(degree) or degree < 1:
        raise InputError(f"must be a positive integer, got {degree!r}", source=source, field=field)
    if dp_size % degree:
        raise InputError(f"SP degree {degree} does not divide the {dp_size} data-parallel ranks (an SP group is "
                         f"{degree} consecutive ranks)", source=source, field=field)
    if num_heads % degree:
        raise InputError(f"SP degree {degree} does not divide the LLM's {num_heads} attention heads (Ulysses "
                         f"gives each rank heads/d of them)", source=source, field=field)


# ------------------------------------------------------------------------------------------- collectives


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """All-to-all over dim 0 (size d): chunk i goes to group rank i, chunk i of the result came from it."""
    x = x.contiguous()  # before empty_like: it copies a permuted input's strides, the backend writes row-major
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def gather_ids(ids: torch.Tensor, group, degree: int) -> torch.Tensor:
    """The group's equal-length integer shards concatenated in group-rank order (no gradient)."""
    ids = ids.contiguous()
    parts = [torch.empty_like(ids) for _ in range(degree)]
    dist.all_gather(parts, ids, group=group)
    return torch.cat(parts)


class _AllToAll(torch.autograd.Function):
    """The exchange with autograd: the gradient of chunk i sent to rank i comes back from it by the same
    exchange (equal chunks make it its own transpose)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


class _GatherChunks(torch.autograd.Function):
    """All-gather equal chunks along dim 0; backward sums the whole gradient over the group (every rank used
    every chunk) and keeps this rank's chunk. gloo has no reduce-scatter, so all-reduce + slice."""

    @staticmethod
    def forward(ctx, x, group, index, degree):
        ctx.group, ctx.index, ctx.rows = group, index, x.shape[0]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(degree)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = ctx.index * ctx.rows
        return grad[start:start + ctx.rows], None, None, None


class UlyssesAttention:
    """The exchange the LLM blocks call (``Options.sequence_parallel``) for one SP group."""

    def __init__(self, group, degree: int, *, gather_segments: bool = False) -> None:
        self.group = group
        self.degree = degree
        self.gather_segments = gather_segments
        """Gather the pack's segment ids from the group's shards at every call (inside a pipeline: the
        schedule runs other micro-batches' forwards before a recomputed block re-runs in a backward, so no
        per-micro-batch state can be kept here); False: :attr:`segment_ids`."""
        self.segment_ids: torch.Tensor | None = None
        """Segment ids of the whole padded pack of the current micro-batch (set by the wrapper's forward;
        still valid when a recomputed block re-runs in that micro-batch's backward: pp = 1 runs each
        micro-batch's forward and backward together)."""

    def attention(self, q, k, v, segment_ids, impl: str):
        """q [H, n/d, hd], k/v [Hkv, n/d, hd] of this rank's tokens -> attention output [H, n/d, hd]."""
        d, heads, n_local, hd = self.degree, q.shape[0], q.shape[1], q.shape[2]
        if k.shape[0] % d:  # too few KV heads to split: send each query head its own copy
            k = k.repeat_interleave(heads // k.shape[0], dim=0)
            v = v.repeat_interleave(heads // v.shape[0], dim=0)
        kv = k.shape[0]
        # one exchange for q, k and v: chunk i holds the heads rank i will own
        packed = torch.cat([q.reshape(d, heads // d, n_local, hd), k.reshape(d, kv // d, n_local, hd),
                            v.reshape(d, kv // d, n_local, hd)], dim=1)
        got = _AllToAll.apply(packed, self.group)  # [d (token shard of rank i), heads', n/d, hd]

        def full_sequence(t):
            return t.permute(1, 0, 2, 3).reshape(t.shape[1], d * n_local, hd)

        qf = full_sequence(got[:, :heads // d])
        kf = full_sequence(got[:, heads // d:heads // d + kv // d])
        vf = full_sequence(got[:, heads // d + kv // d:])
        segments = gather_ids(segment_ids, self.group, d) if self.gather_segments else self.segment_ids
        out = packed_causal_attention(qf, kf, vf, segments, impl)  # [H/d, n, hd]
        back = _AllToAll.apply(out.reshape(heads // d, d, n_local, hd).permute(1, 0, 2, 3), self.group)
        return back.reshape(heads, n_local, hd)


# ------------------------------------------------------------------------------------------- the wrapper


class SequenceParallelStage(nn.Module):
    """Runs a whole-chain :class:`~omnibal.train.stage.Stage` (pp = 1) on this rank's share of each pack.
    ``forward(*carry)`` takes the full micro-batch's carry and returns this rank's ``(loss_sum, num_targets)``
    (its token shard's part)."""

    def __init__(self, stage: nn.Module, *, group, degree: int, index: int) -> None:
        super().__init__()
        self.stage = stage
        self.group, self.degree, self.index = group, degree, index
        self.exchange = UlyssesAttention(group, degree)
        self._split = stage.layer_names.index("llm.embed")

    def forward(self, pixels: torch.Tensor, token_meta: torch.Tensor, sizes: torch.Tensor):
        d, j = self.degree, self.index
        n_tiles, n_tokens = int(sizes[0, SIZE_TILES]), int(sizes[0, SIZE_TOKENS])
        per_tile = max(1, -(-n_tiles // d))
        lo, hi = min(j * per_tile, n_tiles), min((j + 1) * per_tile, n_tiles)
        mine = pixels[:, lo:hi]
        if mine.shape[1] < per_tile:  # equal chunks for the all-gather; the model skips the tail slots
            mine = torch.cat([mine, mine.new_zeros(1, per_tile - mine.shape[1], *mine.shape[2:])], dim=1)
        tile_sizes = torch.tensor([[hi - lo, 0]], dtype=sizes.dtype, device=sizes.device)
        features = self.stage.run_layers(0, self._split, mine, token_meta, tile_sizes)[0]
        features = _GatherChunks.apply(features[0], self.group, j, d).unsqueeze(0)  # tile t at row t

        per_token = max(1, -(-n_tokens // d))
        meta = pad_tokens(token_meta[:, :, :n_tokens], per_token * d)
        self.exchange.segment_ids = meta[0, META_SEGMENT_IDS]
        local = meta[:, :, j * per_token:(j + 1) * per_token].contiguous()
        token_sizes = torch.tensor([[n_tiles, per_token]], dtype=sizes.dtype, device=sizes.device)
        return self.stage.run_layers(self._split, len(self.stage.layer_names), features, local, token_sizes)


def pad_tokens(token_meta: torch.Tensor, length: int) -> torch.Tensor:
    """The active tokens' meta padded to ``length``: padding is one segment of its own (-1) whose tokens
    are no targets and fill no image slot, so it never attends to nor changes a real token."""
    extra = length - token_meta.shape[2]
    if extra == 0:
        return token_meta
    pad = token_meta.new_zeros(1, token_meta.shape[1], extra)
    pad[0, META_SEGMENT_IDS] = -1
    pad[0, META_LABELS] = IGNORE_INDEX
    pad[0, META_IMAGE_INDEX] = -1
    return torch.cat([token_meta, pad], dim=2)


class SequenceParallel:
    """Per SP degree: this rank's group and wrapper around one shared stage. Builds the process groups of
    every degree on every rank in the same order (``dist.new_group`` is collective), so construct it on all
    ranks with the same ``degrees``. With a pipeline (``world.pp_size > 1``) the group of a degree is the
    ranks of this pipeline stage in this rank's group of consecutive DP ranks, and ``wrap(stage, group=,
    degree=, index=)`` makes the wrapper (:func:`omnibal.train.sp_pipe.build_sp`; default
    :class:`SequenceParallelStage`, the whole chain at pp = 1)."""

    def __init__(self, stage: nn.Module, *, world, degrees, num_heads: int, wrap=None) -> None:
        self.stage = stage
        self.modules: dict[int, nn.Module] = {1: stage}
        for d in sorted({int(x) for x in degrees}):
            check_sp_degree(d, dp_size=world.dp_size, num_heads=num_heads)
            if d > 1:
                self.modules[d] = (wrap or SequenceParallelStage)(stage, group=_sp_groups(world, d), degree=d,
                                                                  index=world.dp_rank % d)
        self._options = [m.opts for m in stage.modules() if hasattr(m, "opts")]

    def activate(self, degree: int) -> nn.Module:
        """Switch the layers to ``degree`` (until the next call) and return the module to run."""
        module = self.modules[degree]
        exchange = getattr(module, "exchange", None) if degree > 1 else None
        for opts in self._options:
            opts.sequence_parallel = exchange
        return module


def _sp_groups(world, degree: int):
    """Every SP group of ``degree`` (per pipeline stage, per ``degree`` consecutive DP ranks: global ranks
    ``(dp * pp_size + stage)``), created on every rank in one order; returns this rank's."""
    timeout = datetime.timedelta(seconds=world.timeout_s)
    mine = None
    for stage in range(world.pp_size):
        for first in range(0, world.dp_size, degree):
            group = dist.new_group([(first + j) * world.pp_size + stage for j in range(degree)], timeout=timeout)
            if world.pp_rank == stage and first <= world.dp_rank < first + degree:
                mine = group
    return mine


# ------------------------------------------------------------------------------------------- schedules


def expand_for_sp(schedule, degree: int, *, dp_size: int):
    """A single-level schedule balanced for ``dp_size / degree`` SP groups, dealt to ``dp_size`` ranks: group
    ``g``'s packs go to ranks ``g*degree .. g*degree+degree-1``. A balancer ``Schedule`` comes back as a
    one-level schedule (``levels``/``level_sp`` set); other schedules as the same kind with ranks repeated."""
    source = getattr(schedule, "source", "schedule")
    if schedule.dp_size * degree != dp_size:
        raise InputError(f"with SP degree {degree} the {dp_size} ranks form {dp_size // degree} SP groups, but the "
                         f"schedule is for dp_size {schedule.dp_size}: balance it for {dp_size // degree}",
                         source=source, field="dp_size")
    if getattr(schedule, "levels", None) is not None:
        raise InputError("a multi-level schedule sets its own SP degrees (level_sp): leave --sp-degree at 1",
                         source=source, field="sp_degree")
    if hasattr(schedule, "pack_ids"):
        return replace(schedule, dp_size=dp_size, pack_ids=np.repeat(schedule.pack_ids, degree, axis=1),
                       levels=(0,) * schedule.num_steps, level_sp=(degree,))
    from omnibal.train.feed import IndexSchedule

    steps = tuple(tuple(ranks[r // degree] for r in range(dp_size)) for ranks in schedule.steps)
    return IndexSchedule(dp_size, schedule.num_microbatches, steps, schedule.caps, schedule.source,
                         schedule.stats_fingerprint, schedule.dropped)


def step_degrees(schedule, default: int = 1) -> np.ndarray:
    """SP degree of every step: the schedule's levels, else ``default`` everywhere."""
    if getattr(schedule, "levels", None) is not None:
        return np.asarray(schedule.step_sp(), np.int64)
    return np.full(schedule.num_steps, default, np.int64)


def sp_schedule(schedule, *, sp_degree: int, curriculum_epochs: int, dp_size: int, num_heads: int,
                warmup_steps: int = 0):
    """``(schedule, step_sp)`` as a world of ``dp_size`` ranks runs it: a single-level schedule balanced for
    ``dp_size / sp_degree`` groups dealt to every rank of each group, a multi-level one's degrees checked;
    in the order :func:`level_order` gives it. ``step_sp`` is the SP degree of every step."""
    source = getattr(schedule, "source", "schedule")
    if sp_degree != 1:
        check_sp_degree(sp_degree, dp_size=dp_size, num_heads=num_heads)
        schedule = expand_for_sp(schedule, sp_degree, dp_size=dp_size)
    for d in getattr(schedule, "level_sp", None) or ():
        check_sp_degree(d, dp_size=dp_size, num_heads=num_heads, source=source, field="level_sp")
    schedule = level_order(schedule, curriculum_epochs=curriculum_epochs, warmup_steps=warmup_steps)
    return schedule, step_degrees(schedule, sp_degree)


def check_sp_run(layer_names, *, mode: str, dp_sync: str) -> None:
    """Refuse the combinations sequence parallelism does not run in (InputError naming the flag):
    ``layer_names`` are the whole model chain's."""
    source = "--sp-degree"
    if mode == "online" or dp_sync != "flat":
        raise InputError("sequence parallelism runs in baseline / offline mode with the flat gradient "
                         "all-reduce (dp_sync flat)", source=source, field="mode/dp_sync")
    if "llm.embed" not in tuple(layer_names):
        raise InputError("sequence parallelism needs the reference VLM's layer chain", source=source,
                         field="model")


def level_order(schedule, *, curriculum_epochs: int, warmup_steps: int):
    """The order a multi-level schedule trains in: :func:`curriculum_order` when its ``epoch`` (0 when it has
    none) is one of the first ``curriculum_epochs``, else :func:`warmup_order` in epoch 0 (every rank and a
    resumed run compute the same order from the same inputs)."""
    epoch = int(getattr(schedule, "epoch", 0))
    if epoch < curriculum_epochs:
        return curriculum_order(schedule)
    return warmup_order(schedule, warmup_steps) if epoch == 0 else schedule


def warmup_order(schedule, steps: int):
    """HBP's warm-up: up to ``steps`` steps of the shortest level first, the other steps after them in the
    schedule's own (alternating) order. A single-level schedule comes back unchanged."""
    if getattr(schedule, "levels", None) is None or steps <= 0:
        return schedule
    levels = np.asarray(schedule.levels)
    first = np.flatnonzero(levels == levels.min())[:steps]
    order = np.concatenate([first, np.setdiff1d(np.arange(len(levels)), first)])
    return replace(schedule, pack_ids=schedule.pack_ids[order], levels=tuple(int(levels[i]) for i in order))


def curriculum_order(schedule):
    """HBP's curriculum: the steps of the shorter levels (smaller SP degree) first, order kept within a
    degree. A single-level schedule comes back unchanged."""
    if getattr(schedule, "levels", None) is None:
        return schedule
    order = np.argsort(step_degrees(schedule), kind="stable")
    return replace(schedule, pack_ids=schedule.pack_ids[order],
                   levels=tuple(int(schedule.levels[i]) for i in order))
