"""The per-step forward/backward of one rank's pipeline stage (its layer ranges laid out by
:mod:`omnibal.train.stage_layout`).

``StageRunner.run_step`` executes one step's micro-batches on this rank and returns the summed loss
(last stage only) plus compute time. With ``pp_size > 1`` it drives a torch.distributed.pipelining
``PipelineStage`` under ``Schedule1F1B`` / ``ScheduleGPipe``; with ``pp_size == 1`` it runs a plain
gradient-accumulation loop (no fixed shapes needed, so the baseline there pads each micro-batch only to
its own longest sample, as InternVL does without a pipeline).

Steps may run different micro-batch counts (HBP levels with their own counts). A torch pipeline schedule
has one ``n_microbatches``, and one ``PipelineStage`` cannot serve schedules of several counts: a schedule
sizes the stage's receive buffers and chunk count (``_prepare_forward_infra`` / ``_setup_backward_recv_info``)
once, at its first step, so after a 2-micro-batch schedule has run, a 4-micro-batch one on the same stage
fails with "Chunk id 2 is out of range [0, 2)" (torch 2.13, gloo, checked). The runner therefore keeps one
(stage, schedule) pair per distinct count (and variant: a sequence-parallel degree has boundary shapes of
its own, :mod:`omnibal.train.sp_pipe`), built at the first step of that count -- every rank of the
pipeline reaches it at the same step, as the count is a function of the step -- all around the one stage
module (and its one DDP wrapper). Each pair holds its own receive buffers (count x the fixed buffer).

Loss scaling: every micro-batch's stage output ends in ``(loss_sum, num_targets)``; the loss fed to
backward is ``loss_sum / global_targets`` where ``global_targets`` counts target tokens over all DP ranks
and micro-batches of the step, and the schedule runs with ``scale_grads=False``. Gradients are then
*summed* over DP (see :class:`GradSync`), so the update equals the single-process gradient of the
global-token-normalised loss, whatever the packing.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from omnibal.errors import InputError
from omnibal.layout import DpSync
from omnibal.validate import is_int

DP_SYNCS = tuple(DpSync)
"""How gradients are summed over DP: ``flat`` (one all-reduce after the step, so the time a rank waits for
the slowest is measured on its own) or ``ddp`` (DistributedDataParallel: bucketed all-reduces overlapping
the last micro-batch's backward; the wait then hides inside that backward)."""


# ---------------------------------------------------------------------------------------------------------
# One rank's step


def _make_timed_stage_class():
    # torch's pipelining (tracer, export machinery): only pipeline stages need it
    from torch.distributed.pipelining import PipelineStage

    class TimedPipelineStage(PipelineStage):
        """PipelineStage that accumulates the seconds spent computing (everything else is waiting)."""

        compute_s: float = 0.0

        def _sync(self) -> None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def _timed(self, run, *args, **kwargs):
            """``run(*args, **kwargs)``, its seconds (device-synchronised) added to ``compute_s``."""
            self._sync()
            t0 = time.perf_counter()
            out = run(*args, **kwargs)
            self._sync()
            self.compute_s += time.perf_counter() - t0
            return out

        def forward_one_chunk(self, *args, **kwargs):
            return self._timed(super().forward_one_chunk, *args, **kwargs)

        def backward_one_chunk(self, *args, **kwargs):
            return self._timed(super().backward_one_chunk, *args, **kwargs)

    return TimedPipelineStage


class ShapeGuard(nn.Module):
    """Wraps a stage module and refuses outputs whose shapes differ from the fixed pipeline buffers.

    torch.distributed.pipelining sizes its receive buffers once; a different shape later corrupts or
    aborts far away. This check is a few tuple comparisons per micro-batch.
    """

    def __init__(self, inner: nn.Module, stage_index: int, expected: Sequence[torch.Tensor] | None):
        super().__init__()
        self.inner = inner
        self.stage_index = stage_index
        self.expected = None if expected is None else [(tuple(t.shape), t.dtype) for t in expected]

    def forward(self, *carry):
        out = self.inner(*carry)
        if self.expected is not None:
            got = [(tuple(t.shape), t.dtype) for t in out]
            if got != self.expected:
                raise InputError(f"stage {self.stage_index} produced {got}, but the pipeline buffers are fixed "
                                 f"at {self.expected}: every micro-batch must have the shapes of the first",
                                 source=f"stage {self.stage_index}", field="carry shapes")
        return out


@dataclass
class StepResult:
    """What one rank did in one step."""

    loss_sum: float
    """Sum of the per-micro-batch losses this rank computed (last stage only; 0 elsewhere), already
    divided by the global target count."""
    compute_s: float
    """Seconds of forward + backward compute on this rank."""


class StageRunner:
    """Runs one rank's stage for a step: the pipeline schedule (pp > 1) or gradient accumulation."""

    def __init__(self, stage_module: nn.Module, *, stage_index: int, num_stages: int, device: torch.device,
                 num_microbatches: int, pp_schedule: str = "1f1b", pp_group=None,
                 example_inputs: Sequence[torch.Tensor] | None = None,
                 example_outputs: Sequence[torch.Tensor] | None = None,
                 dp_group=None, dp_size: int = 1, dp_sync: str = "flat", autocast: torch.dtype | None = None,
                 num_chunks: int = 1):
        if dp_sync not in DP_SYNCS:
            raise InputError(f"dp_sync must be one of {', '.join(DP_SYNCS)}, got {dp_sync!r}", source="dp_sync",
                             field="dp_sync")
        self.num_chunks = _check_chunks(stage_module, num_chunks, pp_schedule, num_stages, dp_sync, dp_size)
        """Model chunks of this rank (``interleaved``: ``stage_module`` is an ``nn.ModuleList`` of them, chunk
        ``c`` being virtual stage ``c * num_stages + stage_index``, and the examples are per chunk)."""
        # DDP averages gradients over the DP group; the loss is normalised by the *global* target count, so
        # its gradients must be summed: the loss is multiplied by dp_size to cancel DDP's division
        self.ddp = dp_sync == "ddp" and dp_size > 1
        self._grad_multiplier = float(dp_size) if self.ddp else 1.0
        self.module = stage_module
        self.autocast = autocast
        """Forward dtype under ``torch.autocast`` (None: the module's own dtype)."""
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = device
        self.num_microbatches = num_microbatches
        """Micro-batches of a step that does not say (a multi-level schedule's steps pass their own count)."""
        self._scale = 1.0
        first_inputs = example_inputs if self.num_chunks == 1 or example_inputs is None else example_inputs[0]
        self._input_shapes = None if first_inputs is None else [(tuple(t.shape), t.dtype) for t in first_inputs]
        self._pipes: dict[tuple[int, int], tuple] = {}
        """(micro-batch count, variant) -> (PipelineStages of this rank, pipeline schedule), built at the first
        step of that count and variant."""
        self._variants: dict[int, tuple] = {}
        """Variant -> (modules the pipeline stages run, one per chunk; their (example inputs, example
        outputs)): 1 is the stage itself, others e.g. its sequence-parallel wrapper of that degree
        (:meth:`add_variant`)."""
        if num_stages == 1:
            if self.ddp:
                self.module = _wrap_ddp(stage_module, dp_group, device)
            return
        if example_inputs is None or example_outputs is None:
            raise ValueError("a pipeline stage needs example inputs and outputs (fixed shapes)")
        if self.num_chunks > 1:
            last = self.num_chunks * num_stages - 1
            submods = [ShapeGuard(chunk, c * num_stages + stage_index,
                                  None if c * num_stages + stage_index == last else example_outputs[c])
                       for c, chunk in enumerate(stage_module)]
            examples = [(tuple(example_inputs[c]), tuple(example_outputs[c])) for c in range(self.num_chunks)]
        else:
            guarded = ShapeGuard(stage_module, stage_index,
                                 None if stage_index == num_stages - 1 else example_outputs)
            # a DDP-wrapped stage: torch.distributed.pipelining skips the gradient all-reduce (no_sync) on every
            # backward but the last micro-batch's, where DDP's buckets reduce while the backward still runs
            submods = [_wrap_ddp(guarded, dp_group, device) if self.ddp else guarded]
            examples = [(tuple(example_inputs), tuple(example_outputs))]
        self._pipe_args = dict(group=pp_group, kind=pp_schedule)
        self._variants[1] = (submods, examples)
        self._pipe(num_microbatches)  # the common count now: its construction errors surface at start

    def add_variant(self, key: int, module: nn.Module, example_inputs: Sequence[torch.Tensor],
                    example_outputs: Sequence[torch.Tensor]) -> None:
        """Let steps of ``variant=key`` run ``module`` (wrapping the same parameters, e.g. a sequence-parallel
        wrapper of the stage) with its own boundary shapes: its own pipeline stages and receive buffers."""
        assert self.num_stages > 1 and not self.ddp and self.num_chunks == 1, \
            "variants are one-chunk pipeline stages with the flat gradient sum"
        last = self.stage_index == self.num_stages - 1
        self._variants[key] = ([ShapeGuard(module, self.stage_index, None if last else example_outputs)],
                               [(tuple(example_inputs), tuple(example_outputs))])

    def _pipe(self, count: int, variant: int = 1) -> tuple:
        """The (PipelineStages of this rank, schedule) of ``count`` micro-batches of ``variant``, built on
        first use (see the module docstring: one stage cannot serve two counts)."""
        if (count, variant) not in self._pipes:
            # torch's pipelining (tracer, export machinery): only pipeline stages need it
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

            timed, p, v = _make_timed_stage_class(), self.num_stages, self.num_chunks
            submods, examples = self._variants[variant]
            stages = [timed(submod, c * p + self.stage_index, p * v, self.device, input_args=inputs,
                            output_args=outputs, group=self._pipe_args["group"])
                      for c, (submod, (inputs, outputs)) in enumerate(zip(submods, examples))]
            cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
                   "interleaved": ScheduleInterleaved1F1B}[self._pipe_args["kind"]]
            try:
                schedule = cls(stages if v > 1 else stages[0], count, loss_fn=self._loss_fn, scale_grads=False)
            except ValueError as exc:  # 1F1B: fewer micro-batches than stages
                raise InputError(f"{count} micro-batches in a step: {exc}", source="schedule",
                                 field="num_microbatches") from None
            self._pipes[count, variant] = (stages, schedule)
        return self._pipes[count, variant]

    def _loss_fn(self, output, target):
        return output[0] * self._scale

    def check_inputs(self, microbatches: Sequence[Sequence[torch.Tensor]], count: int | None = None) -> None:
        """First-stage input check: the step's ``count`` micro-batches (default: the common count), each of
        exactly the fixed shapes (pipelines only)."""
        count = self.num_microbatches if count is None else count
        if len(microbatches) != count:
            raise InputError(f"{len(microbatches)} micro-batches for a {count}-micro-batch step", source="schedule",
                             field="num_microbatches")
        if self.num_stages == 1 or self._input_shapes is None:
            return
        for k, mb in enumerate(microbatches):
            got = [(tuple(t.shape), t.dtype) for t in mb]
            if got != self._input_shapes:
                raise InputError(f"micro-batch shapes {got} differ from the fixed pipeline buffer "
                                 f"{self._input_shapes}", source="collate", record=f"micro-batch {k}")

    def run_step(self, microbatches: Sequence[Sequence[torch.Tensor]] | None, *, global_targets: float,
                 module: nn.Module | None = None, num_microbatches: int | None = None,
                 variant: int = 1) -> StepResult:
        """Forward + backward of this step's micro-batches; gradients accumulate in the module's params.

        ``microbatches`` is needed on the first stage only (stage inputs); other stages pass None.
        ``module`` (pp = 1; a pipeline runs its ``variant``'s): run this instead of the stage, e.g. its
        sequence-parallel wrapper (:mod:`omnibal.train.sp`) for this step's SP degree. ``num_microbatches``:
        this step's count (every stage of the pipeline passes the same; default: the runner's common count).
        ``variant`` (pipelines): the :meth:`add_variant` this step runs, the same on every stage (the step's
        SP degree; one without a variant runs the stage itself).
        """
        if global_targets <= 0:
            raise InputError("the global batch has no target tokens (every label is ignored)", source="data",
                             field="labels")
        count = self.num_microbatches if num_microbatches is None else int(num_microbatches)
        self._scale = self._grad_multiplier / float(global_targets)
        if self.num_stages == 1:
            return self._accumulate(microbatches, self.module if module is None else module, count)
        stages, schedule = self._pipe(count, variant if variant in self._variants else 1)
        for stage in stages:
            stage.compute_s = 0.0
        args = ()
        if self.stage_index == 0:
            assert microbatches is not None
            self.check_inputs(microbatches, count)
            args = tuple(torch.cat([mb[j] for mb in microbatches], dim=0).to(self.device)
                         for j in range(len(microbatches[0])))
        losses: list[torch.Tensor] = []
        with self.precision():
            if self.stage_index == self.num_stages - 1:
                dummy_target = torch.zeros(count, device=self.device)
                schedule.step(*args, target=dummy_target, losses=losses, return_outputs=False)
            else:
                schedule.step(*args, return_outputs=False)
        loss_sum = float(sum(loss.detach().float().item() for loss in losses)) if losses else 0.0
        return StepResult(loss_sum=loss_sum / self._grad_multiplier, compute_s=sum(s.compute_s for s in stages))

    def precision(self):
        """The context every forward of this stage runs in: ``torch.autocast`` to :attr:`autocast`, or none."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _accumulate(self, microbatches, module: nn.Module, count: int) -> StepResult:
        assert microbatches is not None
        self.check_inputs(microbatches, count)
        compute = 0.0
        loss_sum = 0.0
        for k, mb in enumerate(microbatches):
            _sync(self.device)
            t0 = time.perf_counter()
            # DDP reduces gradients in the last micro-batch's backward only (gradient accumulation)
            quiet = module.no_sync() if self.ddp and k < len(microbatches) - 1 else contextlib.nullcontext()
            with quiet, self.precision():
                out = module(*[t.to(self.device) for t in mb])
                loss = out[0] * self._scale
                loss.backward()
            _sync(self.device)
            compute += time.perf_counter() - t0
            loss_sum += float(loss.detach().item())
        return StepResult(loss_sum=loss_sum / self._grad_multiplier, compute_s=compute)


def _check_chunks(stage_module: nn.Module, num_chunks: int, pp_schedule: str, num_stages: int, dp_sync: str,
                  dp_size: int) -> int:
    """``num_chunks`` checked against the schedule and the module (an ``nn.ModuleList`` of that many chunks
    when > 1, interleaved only, across pipeline stages, with the flat gradient sync)."""
    if not is_int(num_chunks) or num_chunks < 1:
        raise InputError(f"must be a positive integer, got {num_chunks!r}", source="num_chunks", field="num_chunks")
    if (pp_schedule == "interleaved") != (num_chunks > 1):
        raise InputError(f"pp_schedule {pp_schedule!r} with {num_chunks} model chunks per stage: only "
                         "'interleaved' runs (and needs) more than one", source="num_chunks", field="num_chunks")
    if num_chunks > 1:
        if num_stages < 2 or not isinstance(stage_module, nn.ModuleList) or len(stage_module) != num_chunks:
            raise InputError(f"interleaved 1F1B needs pipeline stages and one module per chunk ({num_chunks})",
                             source="num_chunks", field="num_chunks")
        if dp_sync == "ddp" and dp_size > 1:
            raise InputError("interleaved 1F1B runs several stages per rank; sum their gradients with the flat "
                             "all-reduce (--dp-sync flat)", source="dp_sync", field="dp_sync")
    return int(num_chunks)


def _wrap_ddp(module: nn.Module, dp_group, device: torch.device) -> nn.Module:
    return DistributedDataParallel(module, process_group=dp_group,
                                   device_ids=[device.index] if device.type == "cuda" else None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GradSync:
    """Sums gradients over the DP group in one flat all-reduce per step (DDP's reduction, made explicit
    so the time blocked in it is measured: a rank that finished early waits here for the slowest)."""

    def __init__(self, params: Sequence[nn.Parameter], dp_group, dp_size: int):
        self.params = [p for p in params if p.requires_grad]
        self.group = dp_group
        self.dp_size = dp_size

    def __call__(self) -> None:
        if self.dp_size == 1 or not self.params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for p, g in zip(self.params, grads):
            n = g.numel()
            chunk = flat[offset:offset + n].view_as(g)
            if p.grad is None:
                p.grad = chunk.clone()
            else:
                p.grad.copy_(chunk)
            offset += n
