"""How a layer recomputes in the backward: the granularities the planner chooses from, executed.

``none``       the layer keeps what autograd saves;
``selective``  the layer keeps its input and the outputs of its matrix products and attention; every other op
               (norms, activation, rotary embedding, scales, residual adds) runs again in the backward;
``full``       the layer keeps its input; its whole forward runs again in the backward.

``selective`` is PyTorch's selective activation checkpointing (the policy torchtitan's op-level AC uses): a
non-reentrant checkpoint whose policy caches the outputs of :data:`SAVED_OPS` and recomputes the rest. The
policy works on any module (the reference layers and Hugging Face layers wrapped by
:mod:`omnibal.train.hf_adapter` alike), so one implementation serves both. The memory model's figures for each
granularity are :func:`omnibal.cost.analytic.layer_work`'s ``act_bytes`` / ``sel_act_bytes`` / ``ckpt_bytes``.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

GRANULARITIES = ("none", "selective", "full")
"""Recompute granularities a layer can run at (the planner's choices)."""

SAVED_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.convolution.",
             "aten._scaled_dot_product", "aten._flash_attention_forward.", "aten._efficient_attention_forward.",
             "torch_attn._varlen_attn.", "flash_attn.")
"""Operator name prefixes whose outputs selective recompute keeps: matrix products and attention kernels (the
expensive ops); everything else is recomputed."""


def is_saved_op(op) -> bool:
    """Whether selective recompute keeps the outputs of ``op`` (an ``OpOverload``)."""
    name = str(op)
    return any(name.startswith(prefix) for prefix in SAVED_OPS)


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_saved_op(op) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The ``context_fn`` of a selective checkpoint (fresh contexts per call, as checkpoint requires)."""
    return create_selective_checkpoint_contexts(_policy)


def _check(granularity: str) -> str:
    if granularity not in GRANULARITIES:
        raise ValueError(f"recompute granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    return granularity


def run_layer(module, carry, granularity: str):
    """``module(*carry)`` recomputed in the backward at ``granularity`` (no recompute without autograd)."""
    if _check(granularity) == "none" or not torch.is_grad_enabled():
        return module(*carry)
    if granularity == "full":
        return checkpoint(module, *carry, use_reentrant=False)
    return checkpoint(module, *carry, use_reentrant=False, context_fn=selective_context)
