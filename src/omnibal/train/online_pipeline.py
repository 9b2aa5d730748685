"""``--mode online`` with a pipeline (pp > 1): the vision phase on stage 0's ranks, the LLM phase through each
DP replica's pipeline.

Stage 0 of every DP replica holds the whole vision phase (``vision.embed .. projector``; checked at the first
step, and the default layout of an online run puts it there: :func:`online_stage_layers`). Those ranks run
:mod:`omnibal.train.online`'s steps 1-5 among themselves (the all-gather, the dispatch and the all-to-alls
use the stage-0 DP group only). The LLM phase of each replica then runs through its pipeline:

* the replica's LLM samples form exactly ``num_microbatches`` packs (an empty pack is one placeholder
  sample that trains nothing: every rank of a pipeline runs the same count), each padded to one shape
  ``(tiles, tokens)``: the step's largest pack rounded up to a quarter-octave bucket (:func:`bucket`: at
  most 25% padding above 8, four shapes per doubling). torch's pipelining fixes its receive buffers at a
  stage's first step, so :class:`OnlinePipes` keeps one (PipelineStage, schedule) pair per shape, built the
  first time a step needs it, around the one stage module; the least recently used pair beyond
  :data:`MAX_PIPES` is dropped with its buffers (memory stays bounded by :data:`MAX_PIPES` shapes);
* stage 0 broadcasts ``(tiles, tokens, global target tokens)`` over its pipeline group before the step
  (later stages know neither the dispatch nor the count; the loss on the last stage is
  ``loss_sum / global_targets`` with ``scale_grads=False``, as in the other modes); token meta (labels)
  travels with the activations;
* the packed features enter stage 0's LLM layers as a leaf tensor; after the schedule, its accumulated
  gradient goes back once through the feature all-to-all into the encoder (one collective, the same order
  on every stage-0 rank);
* gradients are summed over DP per stage by the trainer's flat all-reduce.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from omnibal.cost.spec import even_cuts
from omnibal.data.collate import NUM_META_ROWS
from omnibal.errors import InputError
from omnibal.train.alltoall import AllToAllGroups
from omnibal.train.metrics_log import RankTimes, StepWork
from omnibal.train.model import carry_activation_shape
from omnibal.train.pipeline import ShapeGuard, _make_timed_stage_class

MAX_PIPES = 8
"""Pack shapes whose (PipelineStage, schedule) pair a rank keeps at once."""


def bucket(n: int) -> int:
    """``n`` rounded up to a quarter-octave step: exact below 8, then multiples of ``2**(bits - 3)`` (at most
    4 values per doubling, at most 25% above ``n``)."""
    n = max(1, int(n))
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


def online_stage_layers(num_layers: int, llm_start: int, pp_size: int) -> tuple[tuple[int, int], ...]:
    """Default stage ranges of an online run: the even split when stage 0 holds the whole vision phase
    (chain layers ``[0, llm_start)``), else the vision phase alone on stage 0 and the LLM layers split evenly
    over the other stages."""
    cuts = even_cuts(num_layers, pp_size)
    if cuts[1] < llm_start:
        rest = even_cuts(num_layers - llm_start, pp_size - 1)
        cuts = [0, *(llm_start + c for c in rest)]
    return tuple(zip(cuts[:-1], cuts[1:]))


def check_online_layout(trainer, llm_start: int) -> None:
    """Refuse a layout whose stage 0 does not hold the whole vision phase, or that runs several model chunks
    per stage (an interleaved plan's), alike on every rank."""
    if trainer.layout.num_chunks > 1:
        raise InputError(f"online mode runs one layer range per pipeline stage, not {trainer.layout.num_chunks} "
                         "interleaved chunks; plan with --chunks 1", source="stage_layers", field="num_chunks")
    end = trainer.layout.ranges[0][1]
    if end < llm_start:
        raise InputError(f"online mode with pp > 1 runs the vision phase (chain layers [0, {llm_start})) on stage 0, "
                         f"but stage 0 holds [0, {end}); give stage 0 at least [0, {llm_start})",
                         source="stage_layers", field="stage_layers")


@dataclass(frozen=True)
class PackShape:
    """The padded shape of every pack of one step."""

    tiles: int
    tokens: int


class _LlmPart(nn.Module):
    """The stage's layers from ``first`` on (stage 0: its LLM layers; none when it ends at the projector, and
    the features then cross the boundary as they came). ``send_dtype``: the dtype the activation crosses the
    next boundary in (the forward dtype under ``bf16-mixed``, where the LLM's residual stream is fp32 under
    autocast; None: as computed)."""

    def __init__(self, stage: nn.Module, first: int, send_dtype: torch.dtype | None):
        super().__init__()
        self.stage, self.first, self.send_dtype = stage, first, send_dtype

    def forward(self, *carry):
        out = self.stage.run_layers(self.first, len(self.stage.layer_names), *carry)
        if self.send_dtype is None:
            return out
        return (out[0].to(self.send_dtype), *out[1:])


class OnlinePipes:
    """One rank's pipeline stages for online mode: a (PipelineStage, schedule) pair per pack shape."""

    def __init__(self, trainer, llm_start: int):
        w = trainer.world
        self.trainer = trainer
        self.spec = trainer.spec
        stage = trainer.stage_module
        self.start, self.end = (llm_start if w.is_first_stage else stage.start), stage.end
        send = trainer.autocast if w.pp_rank < w.pp_size - 1 else None
        self.module = _LlmPart(stage, llm_start - stage.start if w.is_first_stage else 0, send)
        self.count = trainer.num_microbatches
        self._pipes: OrderedDict[PackShape, tuple] = OrderedDict()
        self._scale = 1.0

    def _example(self, start: int, shape: PackShape) -> tuple[torch.Tensor, ...]:
        """One micro-batch's carry entering chain layer ``start`` (the last stage's output at the end)."""
        w, dtype = self.trainer.world, self.trainer.autocast or torch.float32
        act, _ = carry_activation_shape(self.spec, start, num_tiles=shape.tiles, num_tokens=shape.tokens)
        if start == self.spec.num_layers:
            return (torch.zeros(act, device=w.device, requires_grad=True),
                    torch.zeros(1, dtype=torch.int64, device=w.device))
        return (torch.zeros(act, dtype=dtype, device=w.device, requires_grad=True),
                torch.zeros(1, NUM_META_ROWS, shape.tokens, dtype=torch.int64, device=w.device),
                torch.tensor([[shape.tiles, shape.tokens]], dtype=torch.int64, device=w.device))

    def pipe(self, shape: PackShape) -> tuple:
        """The (PipelineStage, schedule) of ``shape``, built on first use (every rank of the pipeline reaches
        it at the same step: stage 0 broadcast the shape)."""
        if shape in self._pipes:
            self._pipes.move_to_end(shape)
            return self._pipes[shape]
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        w = self.trainer.world
        inputs, outputs = self._example(self.start, shape), self._example(self.end, shape)
        last = w.pp_rank == w.pp_size - 1
        guarded = ShapeGuard(self.module, w.pp_rank, None if last else outputs)
        stage = _make_timed_stage_class()(guarded, w.pp_rank, w.pp_size, w.device, input_args=inputs,
                                          output_args=outputs, group=w.pp_group)
        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[self.trainer.pp_schedule]
        self._pipes[shape] = (stage, cls(stage, self.count, loss_fn=self._loss_fn, scale_grads=False))
        while len(self._pipes) > MAX_PIPES:
            self._pipes.popitem(last=False)
        return self._pipes[shape]

    def _loss_fn(self, output, target):
        return output[0] * self._scale

    def run(self, shape: PackShape, global_targets: float, args: tuple = ()) -> tuple[float, float]:
        """One pipeline step of this step's packs (``args``: stage 0's inputs, ``count`` micro-batches along
        dim 0); returns ``(loss on this rank, already divided by the global targets; compute seconds)``."""
        w = self.trainer.world
        stage, schedule = self.pipe(shape)
        stage.compute_s = 0.0
        self._scale = 1.0 / float(global_targets)
        losses: list[torch.Tensor] = []
        with self.trainer.runner.precision():
            if w.pp_rank == w.pp_size - 1:
                schedule.step(*args, target=torch.zeros(self.count, device=w.device), losses=losses,
                              return_outputs=False)
            else:
                schedule.step(*args, return_outputs=False)
        return float(sum(float(x.detach().float()) for x in losses)), stage.compute_s


@dataclass
class OnlineState:
    """What online mode makes once per run and keeps on the trainer (``Trainer.online_state``): made on the
    first online step, which every rank reaches together (``new_group`` needs every rank)."""

    groups: AllToAllGroups | None = None
    """The communicators of the all-to-alls (flat, or node-wise for ``node_size``)."""
    pipes: OnlinePipes | None = None
    """pp > 1: the LLM phase's cached pipelines."""


def pipes_of(trainer, llm_start: int) -> OnlinePipes:
    state = trainer.online_state
    if state.pipes is None:
        state.pipes = OnlinePipes(trainer, llm_start)
    return state.pipes


def share_step(trainer, shape: PackShape | None = None, global_targets: float = 0.0) -> tuple[PackShape, float]:
    """Stage 0's pack shape and global target count, broadcast to its pipeline's other stages."""
    w = trainer.world
    box = torch.tensor([0.0, 0.0, global_targets] if shape is None else
                       [shape.tiles, shape.tokens, global_targets], dtype=torch.float64, device=w.device)
    dist.broadcast(box, src=w.rank - w.pp_rank, group=w.pp_group)
    tiles, tokens, targets = box.tolist()
    if targets <= 0:
        raise InputError("the global batch has no target tokens (every label is ignored)", source="data",
                         field="labels")
    return PackShape(int(tiles), int(tokens)), float(targets)


def later_stage_step(trainer, llm_start: int) -> StepWork:
    """One online step on a stage after the first: the shape and count from stage 0, the pipeline step, the
    DP gradient sum."""
    times = RankTimes()
    t_start, cpu_start = time.perf_counter(), time.process_time()
    shape, targets = share_step(trainer)
    loss, compute_s = pipes_of(trainer, llm_start).run(shape, targets)
    t_sync = time.perf_counter()
    trainer.grad_sync()
    times.dp_sync_s = time.perf_counter() - t_sync
    times.compute_s = compute_s
    counts = {"targets": targets, "samples": 0.0, "tokens": 0.0, "tiles": 0.0, "buffer_tokens": 0.0,
              "buffer_tiles": 0.0}
    return StepWork(loss_sum=loss, times=times, counts=counts, fed=[], t_start=t_start, cpu_start=cpu_start)
