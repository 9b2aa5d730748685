"""Pipeline stages: slices of a layer chain with one fixed carry crossing every boundary.

Entry points for the distributed trainer (``omnibal.train`` dist side); nothing here imports
torch.distributed:

    stage = build_stage(model, start, end)                  # layers [start, end) of model.chain()
    apply_checkpointing(stage, plan_recompute_names)        # exactly these layers recompute in backward
    inputs = example_carry(model, start, num_tiles=Q_v, num_tokens=Q_t)
    outputs = example_carry(model, end, num_tiles=Q_v, num_tokens=Q_t)
    PipelineStage(stage, idx, n, device, input_args=inputs, output_args=outputs, group=pp_group)

The carry is ``(activation, token_meta, sizes)`` at every boundary (see :func:`carry_activation_shape` in
:mod:`omnibal.train.model` for the activation per boundary kind, and :mod:`omnibal.data.collate` for
``token_meta``/``sizes``); the last stage returns ``(loss_sum [1] float32, num_targets [1] int64)``. For the
global-token normalisation use a loss_fn like ``lambda out, _: out[0].sum() / global_num_targets`` with
``scale_grads=False`` (and divide by nothing else: DDP's averaging over DP ranks must be undone, or the count
taken per rank times dp_size). The schedule needs a ``target`` on the last stage even when the loss_fn
ignores it: pass e.g. ``torch.tensor([mb.num_targets for mb in micro_batches])``. Checked with
Schedule1F1B and ScheduleGPipe on 2 gloo ranks: gradients match the single-process model to ~1e-7. All shapes
depend only on (Q_v, Q_t), so they never change across steps.

``model`` is anything with ``chain() -> [(LayerSpec, module)]`` and ``boundary_activation(start, ...)``:
the reference :class:`~omnibal.train.model.VLM` or a Hugging Face model wrapped by
:mod:`omnibal.train.hf_adapter`. Stage parameter names equal the model's (``vision.blocks.3.qkv.weight``),
so per-stage checkpoints merge into a whole-model state dict by a plain dict union.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from omnibal.data.collate import NUM_META_ROWS
from omnibal.errors import InputError
from omnibal.train.recompute import run_layer


class _Group(nn.Module):
    """Intermediate container so dotted layer names survive (``llm.blocks.3``)."""


class Stage(nn.Module):
    """Layers ``[start, end)`` of a chain; ``forward(*carry)`` returns the next carry (or the loss)."""

    def __init__(self, layers: list[tuple[str, nn.Module]], *, start: int, end: int, num_layers: int) -> None:
        super().__init__()
        self.start, self.end, self.num_layers = start, end, num_layers
        self.layer_names: tuple[str, ...] = tuple(name for name, _ in layers)
        self.recompute: frozenset[str] = frozenset()
        """Layers recomputed whole in the backward (granularity ``full``)."""
        self.selective: frozenset[str] = frozenset()
        """Layers under selective recompute (:mod:`omnibal.train.recompute`)."""
        self._layers = [module for _, module in layers]  # plain list: registration happens below by name
        for name, module in layers:
            attach_module(self, name, module)

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.num_layers

    def forward(self, *carry: torch.Tensor):
        return self.run_layers(0, len(self._layers), *carry)

    def run_layers(self, first: int, last: int, *carry: torch.Tensor):
        """The stage's own layers ``[first, last)`` (indices into ``layer_names``) on ``carry``, recomputing
        the chosen ones: :mod:`omnibal.train.sp` runs the vision and LLM halves on differently split carries."""
        for name, module in zip(self.layer_names[first:last], self._layers[first:last]):
            carry = run_layer(module, carry, self.granularity(name))
        return carry

    def granularity(self, name: str) -> str:
        """How layer ``name`` recomputes: ``full``, ``selective`` or ``none``."""
        return "full" if name in self.recompute else "selective" if name in self.selective else "none"

    def extra_repr(self) -> str:
        return (f"layers [{self.start}, {self.end}) of {self.num_layers}, recompute {sorted(self.recompute)}, "
                f"selective {sorted(self.selective)}")


def attach_module(root: nn.Module, dotted: str, module: nn.Module) -> None:
    """Register ``module`` under the dotted name, creating plain containers on the way."""
    parts = dotted.split(".")
    parent = root
    for part in parts[:-1]:
        child = parent._modules.get(part)
        if child is None:
            child = _Group()
            parent.add_module(part, child)
        parent = child
    parent.add_module(parts[-1], module)


def build_stage(model, start: int, end: int) -> Stage:
    """The stage holding chain layers ``[start, end)`` of ``model`` (modules are shared, not copied:
    move the stage to its device, drop the rest of the model).

    Raises ``InputError`` for a range outside the chain or empty, or one that separates tied embeddings.
    """
    chain = model.chain()
    num_layers = len(chain)
    if not (0 <= start < end <= num_layers):
        raise InputError(f"stage range [{start}, {end}) is not a non-empty range of the {num_layers}-layer chain",
                         source="plan", field="layers")
    layers = [(spec.name, module) for spec, module in chain[start:end]]
    stage = Stage(layers, start=start, end=end, num_layers=num_layers)
    own = {id(p) for p in stage.parameters()}
    other = {id(p) for _, m in chain[:start] + chain[end:] for p in m.parameters()}
    if own & other:
        raise InputError(f"stage [{start}, {end}) shares parameters (tied embeddings?) with another stage; put "
                         "the embedding and the LM head in one stage or untie them", source="plan", field="layers")
    return stage


def split_model(model, bounds: Iterable[int]) -> list[Stage]:
    """All stages of a split: ``bounds`` are the stage starts plus the chain length, e.g. ``[0, 5, 12, 20]``."""
    b = list(bounds)
    return [build_stage(model, s, e) for s, e in zip(b[:-1], b[1:])]


def example_carry(model, start: int, *, num_tiles: int, num_tokens: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Example tensors of the carry entering chain layer ``start`` (for ``input_args``; pass the stage's
    ``end`` for its ``output_args``). ``start == num_layers`` gives the last stage's output
    ``(loss_sum, num_targets)``. Float activations that carry a gradient have ``requires_grad=True``."""
    shape, grad = model.boundary_activation(start, num_tiles=num_tiles, num_tokens=num_tokens)
    num_layers = len(model.chain())
    if start == num_layers:
        return (torch.zeros(shape, dtype=torch.float32, device=device, requires_grad=True),
                torch.zeros(1, dtype=torch.int64, device=device))
    act_dtype = torch.float32 if start == 0 else dtype
    activation = torch.zeros(shape, dtype=act_dtype, device=device, requires_grad=grad)
    token_meta = torch.zeros(1, NUM_META_ROWS, num_tokens, dtype=torch.int64, device=device)
    sizes = torch.tensor([[num_tiles, num_tokens]], dtype=torch.int64, device=device)
    return activation, token_meta, sizes


def apply_checkpointing(stage: Stage, layer_names: Iterable[str], selective: Iterable[str] = ()) -> Stage:
    """Recompute exactly ``layer_names`` (chain names inside this stage) whole in backward, with non-reentrant
    ``torch.utils.checkpoint`` (reentrant checkpointing breaks inside pipeline stages), and the ``selective``
    ones selectively (:mod:`omnibal.train.recompute`). Replaces any earlier choice; empty lists turn
    recomputation off. Raises ``InputError`` for a name not in the stage or in both sets."""
    names, sel = frozenset(layer_names), frozenset(selective)
    for field, chosen in (("recompute", names), ("selective", sel)):
        unknown = sorted(chosen - set(stage.layer_names))
        if unknown:
            raise InputError(f"{field} names {unknown} are not layers of stage [{stage.start}, {stage.end}) "
                             f"({stage.layer_names[0]} .. {stage.layer_names[-1]})", source="plan", field=field)
    both = sorted(names & sel)
    if both:
        raise InputError(f"layers {both} are both recomputed whole and selectively", source="plan",
                         field="selective")
    stage.recompute, stage.selective = names, sel
    return stage


def build_rank_stages(model, layout, pp_rank: int, pp_size: int) -> tuple[nn.Module, list[tuple[int, int]]]:
    """Pipeline rank ``pp_rank``'s stage module (checkpointed as ``layout`` says) and its layer ranges: one
    :class:`Stage`, or, for an interleaved layout (``layout.num_chunks`` > 1, ``layout.ranges`` per virtual
    stage), an ``nn.ModuleList`` of its chunks, chunk ``c`` being virtual stage ``c * pp_size + pp_rank``."""
    chunks = getattr(layout, "num_chunks", 1)
    owned = [c * pp_size + pp_rank for c in range(chunks)]
    stages = []
    for s in owned:
        start, end = layout.ranges[s]
        stage = build_stage(model, start, end)
        apply_checkpointing(stage, layout.recompute[s], layout.selective[s])
        stages.append(stage)
    return (stages[0] if chunks == 1 else nn.ModuleList(stages)), [layout.ranges[s] for s in owned]
