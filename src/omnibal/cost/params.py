"""Parameter counts per layer of the chain (``ModelSpec.layers()``), from the dimensions alone.

The module shapes counted here are those of the reference trainer's model and of the published models:

- ``vision.embed``: Conv2d(3 -> H, patch x patch, with bias) + class token + learned position embedding
  (one row per token of a tile).
- ``vision.blocks.i``: pre-norm ViT block: 2 LayerNorms (weight + bias), qkv Linear(H -> 3H) and output
  Linear(H -> H) with biases, MLP Linear(H -> M) + GELU + Linear(M -> H) with biases. (InternViT-6B has no
  qkv bias and two layer-scale vectors; the difference is 0 H per block and below 0.01% of its size.)
- ``projector``: optional LayerNorm over the pixel-shuffled input, Linear(in -> D) + GELU + Linear(D -> D).
- ``llm.embed``: V x D embedding table.
- ``llm.blocks.i``: 2 RMSNorms, q/k/v/o projections without bias (grouped-query: k and v have
  ``num_kv_heads * head_dim`` outputs), SwiGLU MLP (gate, up: D -> M; down: M -> D) without bias.
- ``llm.head``: final RMSNorm + Linear(D -> V) without bias (no weight of its own when tied).
"""

from __future__ import annotations

import numpy as np

from omnibal.cost.spec import LLMSpec, ModelSpec, VisionSpec


def vision_embed_params(v: VisionSpec) -> int:
    conv = 3 * v.patch_size**2 * v.hidden + v.hidden
    return conv + int(v.class_token) * v.hidden + v.tokens_per_tile * v.hidden


def vision_block_params(v: VisionSpec) -> int:
    h, m = v.hidden, v.mlp_hidden
    return 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * m + m) + (m * h + h)


def projector_params(spec: ModelSpec) -> int:
    d_in, d = spec.projector_in, spec.llm.hidden
    return 2 * d_in * int(spec.projector_norm) + (d_in * d + d) + (d * d + d)


def llm_embed_params(llm: LLMSpec) -> int:
    return llm.vocab_size * llm.hidden


def llm_block_params(llm: LLMSpec) -> int:
    d, m = llm.hidden, llm.mlp_hidden
    kv = llm.num_kv_heads * llm.head_dim
    return 2 * d + d * d + 2 * d * kv + d * d + 3 * d * m


def lm_head_params(llm: LLMSpec) -> int:
    return llm.hidden + (0 if llm.tie_embeddings else llm.vocab_size * llm.hidden)


def layer_param_counts(spec: ModelSpec) -> np.ndarray:
    """``[L]`` parameters of each layer of the chain, in chain order."""
    per_kind = {
        "vision_embed": vision_embed_params(spec.vision),
        "vision_block": vision_block_params(spec.vision),
        "projector": projector_params(spec),
        "llm_embed": llm_embed_params(spec.llm),
        "llm_block": llm_block_params(spec.llm),
        "lm_head": lm_head_params(spec.llm),
    }
    return np.array([per_kind[layer.kind] for layer in spec.layers()], dtype=np.int64)


def param_counts(spec: ModelSpec) -> dict[str, int]:
    """Totals by part: ``vision`` (embed + blocks that run), ``projector``, ``llm`` (embed, blocks, head)
    and ``total``."""
    counts = layer_param_counts(spec)
    kinds = np.array([layer.kind for layer in spec.layers()])
    vision = int(counts[np.isin(kinds, ("vision_embed", "vision_block"))].sum())
    projector = int(counts[kinds == "projector"].sum())
    llm = int(counts[np.isin(kinds, ("llm_embed", "llm_block", "lm_head"))].sum())
    return {"vision": vision, "projector": projector, "llm": llm, "total": vision + projector + llm}
