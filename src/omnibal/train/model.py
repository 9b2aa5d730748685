"""The reference VLM, single-device code built from a :class:`~omnibal.cost.spec.ModelSpec`.

Module names are exactly the chain of ``ModelSpec.layers()`` (``vision.embed``, ``vision.blocks.{i}``,
``projector``, ``llm.embed``, ``llm.blocks.{i}``, ``llm.head``), so a plan's stage ranges and recompute sets
name real modules. Every chain layer maps the carry ``(activation, token_meta, sizes)`` to the next one
(:mod:`omnibal.train.layers`), so the model is the chain run in order and a pipeline stage is a slice of it
(:func:`omnibal.train.stage.build_stage`).

    model = VLM(spec, seed=0)
    loss_sum, num_targets = model(*micro_batch.carry())     # micro_batch from omnibal.data.collate
    (loss_sum / global_num_targets).backward()

The loss is a *sum* over target tokens plus their count, so the trainer can divide by the number of target
tokens of the whole global batch (all ranks, all micro-batches) and packing does not change the gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from omnibal.cost.spec import LayerSpec, ModelSpec
from omnibal.data.collate import CollateConfig, MicroBatch
from omnibal.train.layers import (
    LLMBlock,
    LLMEmbed,
    LMHead,
    Options,
    Projector,
    VisionBlock,
    VisionEmbed,
    init_parameters,
)


class _Group(nn.Module):
    """A plain container so that parameter names read ``vision.blocks.0.qkv.weight``."""


class VLM(nn.Module):
    """ViT -> pixel-shuffle projector -> decoder-only LLM -> summed token loss.

    ``seed``: weights are a pure function of (spec, seed) and each parameter's name.
    ``attn_impl``: LLM attention inside packed samples: ``auto`` (flash-attn varlen on CUDA when installed,
    else ``varlen``), ``varlen`` (one SDPA call per sample), ``mask`` (one SDPA call, block-diagonal mask).
    ``compute_tail``: also process the unused tail of the fixed buffer (default: passed through).
    ``init``: False leaves parameters uninitialised (build on the meta device, then ``to_empty`` +
    :func:`~omnibal.train.layers.init_parameters` on just a stage).
    """

    def __init__(self, spec: ModelSpec, *, seed: int = 0, attn_impl: str = "auto", compute_tail: bool = False,
                 init: bool = True) -> None:
        super().__init__()
        self.spec = spec
        self.seed = seed
        self.options = Options(attn_impl=attn_impl, compute_tail=compute_tail)
        opts = self.options
        self.vision = _Group()
        self.vision.embed = VisionEmbed(spec, opts)
        self.vision.blocks = nn.ModuleList(VisionBlock(spec, opts) for _ in range(spec.vision.num_layers))
        self.projector = Projector(spec, opts)
        self.llm = _Group()
        self.llm.embed = LLMEmbed(spec, opts)
        self.llm.blocks = nn.ModuleList(LLMBlock(spec, opts) for _ in range(spec.llm.num_layers))
        self.llm.head = LMHead(spec, opts)
        if init:
            init_parameters(self, seed)
        if spec.llm.tie_embeddings:
            self.llm.head.out.weight = self.llm.embed.tokens.weight
        if spec.freeze_vision:
            for p in self.vision.parameters():
                p.requires_grad_(False)

    def chain(self) -> list[tuple[LayerSpec, nn.Module]]:
        """The layer chain in execution order, each link with its module."""
        return [(layer, self.get_submodule(layer.name)) for layer in self.spec.layers()]

    def forward(self, pixel_values: torch.Tensor, token_meta: torch.Tensor, sizes: torch.Tensor):
        """Run the chain on one micro-batch's carry; returns ``(loss_sum [1], num_targets [1])``."""
        carry = (pixel_values, token_meta, sizes)
        for _, module in self.chain():
            carry = module(*carry)
        return carry

    def collate_config(self, *, num_tiles: int, num_tokens: int, image_token_id: int | None = None,
                       mode: str = "pack", pad_token_id: int = 0) -> CollateConfig:
        """The collator config that matches this model (image size, image tokens per tile); the image token
        id defaults to the last vocabulary entry."""
        return CollateConfig(num_tiles=num_tiles, num_tokens=num_tokens, image_size=self.spec.vision.image_size,
                             tokens_per_tile=self.spec.llm_tokens_per_tile,
                             image_token_id=self.spec.llm.vocab_size - 1 if image_token_id is None else image_token_id,
                             pad_token_id=pad_token_id, mode=mode)  # type: ignore[arg-type]

    def loss(self, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self(*batch.carry())

    def boundary_activation(self, start: int, *, num_tiles: int, num_tokens: int) -> tuple[tuple[int, ...], bool]:
        """Shape of the float activation entering chain layer ``start`` (``start == num_layers``: the loss)
        for a (num_tiles, num_tokens) buffer, and whether it carries a gradient."""
        return carry_activation_shape(self.spec, start, num_tiles=num_tiles, num_tokens=num_tokens)


def carry_activation_shape(spec: ModelSpec, start: int, *, num_tiles: int, num_tokens: int
                           ) -> tuple[tuple[int, ...], bool]:
    """See :meth:`VLM.boundary_activation`. Boundary kinds, by the layer that comes next:

    ==========================  =========================================  =====================
    next layer                  activation                                 gradient
    ==========================  =========================================  =====================
    vision.embed (input)        pixel_values [1, Q_v, 3, S, S]             no
    vision.blocks.i, projector  vision hidden [1, Q_v, T_v, Dv]            unless vision frozen
    llm.embed                   image features [1, Q_v, tpt, D]            yes
    llm.blocks.i, llm.head      LLM hidden [1, Q_t, D]                     yes
    (end)                       loss_sum [1] (float32)                     yes
    ==========================  =========================================  =====================
    """
    v, n_vision = spec.vision, spec.vision.num_layers
    if start == 0:
        return (1, num_tiles, 3, v.image_size, v.image_size), False
    if start <= n_vision + 1:
        return (1, num_tiles, v.tokens_per_tile, v.hidden), not spec.freeze_vision
    if start == n_vision + 2:
        return (1, num_tiles, spec.llm_tokens_per_tile, spec.llm.hidden), True
    if start < spec.num_layers:
        return (1, num_tokens, spec.llm.hidden), True
    assert start == spec.num_layers, start
    return (1,), True
