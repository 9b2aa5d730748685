"""Model specs: a VLM as a chain of layers with kinds and dimensions.

The chain is what the planner cuts into pipeline stages, so its module names are the reference trainer's
module names (``omnibal.train.model``): a plan's stage ranges map onto real modules one to one.

Chain order and module names::

    vision.embed            patch embedding (+ class token, + position embedding) of every tile
    vision.blocks.{i}       ViT transformer blocks, i = 0 .. vision.num_layers - 1
    projector               pixel shuffle (downsample_ratio) + LayerNorm + MLP into the LLM width
    llm.embed               token embedding; image features are scattered into the image-token slots
    llm.blocks.{i}          decoder blocks, i = 0 .. llm.num_layers - 1
    llm.head                final norm + LM head (+ loss)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from omnibal.errors import InputError
from omnibal.stats.table import tokens_for_model
from omnibal.validate import check_positive_int, is_int

LayerKind = Literal["vision_embed", "vision_block", "projector", "llm_embed", "llm_block", "lm_head"]
LAYER_KINDS: tuple[str, ...] = ("vision_embed", "vision_block", "projector", "llm_embed", "llm_block", "lm_head")
MLP_ACTIVATIONS = ("gelu", "quick_gelu")
"""Vision MLP activations the memory model tells apart (:attr:`VisionSpec.mlp_act`)."""
_LATER_FIELDS = (("vision", "qk_norm", False), ("vision", "layer_scale", False), ("vision", "mlp_act", "gelu"),
                 ("llm", "norm_fp32_copy", False), ("llm", "vocab_multiple", 128))
"""Spec fields added after the first fingerprints, with the value that leaves them out of the hash."""


@dataclass(frozen=True, kw_only=True)
class VisionSpec:
    """A ViT encoder (InternViT, CLIP)."""

    num_layers: int
    """Transformer blocks that run (InternVL drops none; LLaVA stops at the second to last)."""
    hidden: int
    """Model width."""
    num_heads: int
    """Attention heads."""
    mlp_hidden: int
    """MLP inner width."""
    image_size: int = 448
    """Tile side in pixels."""
    patch_size: int = 14
    """Patch side in pixels."""
    class_token: bool = True
    """Whether a class token is prepended (1025 = 32*32 + 1 tokens per 448px tile)."""
    qk_norm: bool = False
    """RMSNorm on q and k over the full width before attention (InternViT-6B's ``qk_normalization``):
    keeps q and k before the norm and two fp32 statistics per token for the backward."""
    layer_scale: bool = False
    """Learned per-channel scales on the attention and MLP outputs (InternViT's ``ls1``/``ls2``): their
    gradient keeps both branch outputs."""
    mlp_act: str = "gelu"
    """MLP activation: ``gelu`` (keeps its input for the backward) or ``quick_gelu`` (CLIP's
    ``x * sigmoid(1.702 x)``, which also keeps the sigmoid)."""

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        return self.patches_per_side**2 + int(self.class_token)

    def validate(self, where: str) -> None:
        _positive(where, num_layers=self.num_layers, hidden=self.hidden, num_heads=self.num_heads,
                  mlp_hidden=self.mlp_hidden, image_size=self.image_size, patch_size=self.patch_size)
        if self.hidden % self.num_heads:
            raise InputError(f"hidden {self.hidden} not divisible by num_heads {self.num_heads}",
                             source=where, field="vision.num_heads")
        if self.image_size % self.patch_size:
            raise InputError(f"image_size {self.image_size} not divisible by patch_size {self.patch_size}",
                             source=where, field="vision.patch_size")
        if self.mlp_act not in MLP_ACTIVATIONS:
            raise InputError(f"mlp_act must be one of {', '.join(MLP_ACTIVATIONS)}, got {self.mlp_act!r}",
                             source=where, field="vision.mlp_act")


@dataclass(frozen=True, kw_only=True)
class LLMSpec:
    """A decoder-only LLM (InternLM2, Llama/Vicuna, Yi)."""

    num_layers: int
    """Decoder blocks."""
    hidden: int
    """Model width."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than num_heads)."""
    mlp_hidden: int
    """SwiGLU inner width."""
    vocab_size: int
    """Vocabulary size (embedding rows and LM-head columns)."""
    tie_embeddings: bool = False
    """Whether the LM head shares the embedding matrix."""
    vocab_multiple: int = 128
    """The embedding and LM head rows are padded up to a multiple of this (times the tensor-parallel size), as
    Megatron's ``make_vocab_size_divisible_by`` does: an LM-head matrix product over an odd vocabulary misses
    the tensor-core fast path. 1: unpadded, as a Hugging Face checkpoint stores it."""
    norm_fp32_copy: bool = False
    """Whether each RMSNorm keeps an fp32 copy of its input for the backward besides the input itself
    (transformers' eager ``LlamaRMSNorm`` / ``Qwen2RMSNorm`` upcast inside autograd; a fused norm keeps the
    input and one statistic per token)."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def padded_vocab(self, tp_size: int = 1) -> int:
        """Rows of the embedding and the LM head as they run: ``vocab_size`` rounded up to a multiple of
        ``vocab_multiple x tp_size`` (each tensor-parallel rank holds an equal shard)."""
        step = self.vocab_multiple * tp_size
        return -(-self.vocab_size // step) * step

    def validate(self, where: str) -> None:
        _positive(where, num_layers=self.num_layers, hidden=self.hidden, num_heads=self.num_heads,
                  num_kv_heads=self.num_kv_heads, mlp_hidden=self.mlp_hidden, vocab_size=self.vocab_size,
                  vocab_multiple=self.vocab_multiple)
        if self.hidden % self.num_heads:
            raise InputError(f"hidden {self.hidden} not divisible by num_heads {self.num_heads}",
                             source=where, field="llm.num_heads")
        if self.num_heads % self.num_kv_heads:
            raise InputError(f"num_heads {self.num_heads} not divisible by num_kv_heads {self.num_kv_heads}",
                             source=where, field="llm.num_kv_heads")


@dataclass(frozen=True)
class LayerSpec:
    """One link of the layer chain."""

    index: int
    """Position in the chain (0-based)."""
    kind: str
    """One of LAYER_KINDS."""
    name: str
    """Module name in the reference trainer's model."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A VLM: vision encoder -> projector -> LLM."""

    name: str
    """Preset or user name; profiles and plans record it to refuse being applied to another model."""
    vision: VisionSpec
    """The vision encoder."""
    llm: LLMSpec
    """The language model."""
    downsample_ratio: float = 0.5
    """Pixel-shuffle ratio of the projector (0.5: 1024 patches -> 256 LLM tokens per tile)."""
    freeze_vision: bool = False
    """Whether the vision encoder is frozen (no weight gradients, no optimizer state)."""
    projector_norm: bool = True
    """Whether the projector starts with a LayerNorm over its input (InternVL: yes; LLaVA's mlp2x_gelu: no)."""

    def __post_init__(self) -> None:
        self.vision.validate(self.name)
        self.llm.validate(self.name)
        side = self.vision.patches_per_side * self.downsample_ratio
        if not (0 < self.downsample_ratio <= 1) or side != int(side):
            raise InputError(f"downsample_ratio {self.downsample_ratio} must be in (0, 1] and divide the "
                             f"{self.vision.patches_per_side}-patch grid evenly", source=self.name,
                             field="downsample_ratio")

    @property
    def llm_tokens_per_tile(self) -> int:
        """Image tokens the LLM sees per tile (256 for InternVL-1.5)."""
        return int(self.vision.patches_per_side * self.downsample_ratio) ** 2

    @property
    def projector_in(self) -> int:
        """Projector input width after pixel shuffle."""
        return int(round(self.vision.hidden / self.downsample_ratio**2))

    def layers(self) -> tuple[LayerSpec, ...]:
        """The layer chain in execution order (see the module docstring)."""
        names: list[tuple[str, str]] = [("vision_embed", "vision.embed")]
        names += [("vision_block", f"vision.blocks.{i}") for i in range(self.vision.num_layers)]
        names += [("projector", "projector"), ("llm_embed", "llm.embed")]
        names += [("llm_block", f"llm.blocks.{i}") for i in range(self.llm.num_layers)]
        names += [("lm_head", "llm.head")]
        return tuple(LayerSpec(i, kind, name) for i, (kind, name) in enumerate(names))

    @property
    def num_layers(self) -> int:
        return self.vision.num_layers + self.llm.num_layers + 4

    def sample_tokens(self, tiles, tokens, *, images, source_tokens_per_tile: int = 256) -> np.ndarray:
        """LLM sequence lengths of samples under this model, from statistics that counted
        ``source_tokens_per_tile`` image tokens per tile (InternVL-1.5 statistics count 256).

        The text part is kept; each tile of a row with ``images > 0`` contributes :attr:`llm_tokens_per_tile`
        instead, and text-only rows (a dummy tile, no image tokens) keep their tokens. Presets with 256
        tokens per tile return ``tokens`` unchanged; the ``tiny`` preset (16 per tile) shortens image rows.
        (:func:`omnibal.stats.table.tokens_for_model`, which also serves ``stats_for_model``.)
        """
        return tokens_for_model(tiles, tokens, images, tokens_per_tile=self.llm_tokens_per_tile,
                                source_tokens_per_tile=source_tokens_per_tile)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (JSON-able); :meth:`from_dict` inverts it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "model spec") -> ModelSpec:
        try:
            fields = dict(data)
            fields["vision"] = VisionSpec(**fields["vision"])
            fields["llm"] = LLMSpec(**fields["llm"])
            return cls(**fields)
        except (KeyError, TypeError) as exc:
            raise InputError(f"not a model spec: {exc}", source=source, field="model") from exc

    def fingerprint(self) -> str:
        """Stable hash of every dimension except the name: a profile or plan records it so that it is
        never applied to a model of another shape."""
        data = self.to_dict()
        data.pop("name")
        for part, flag, off in _LATER_FIELDS:  # added later: absent when off, so older fingerprints hold
            if data[part][flag] == off:
                data[part].pop(flag)
        blob = json.dumps(data, sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()


def _positive(where: str, **values: int) -> None:
    for key, value in values.items():
        check_positive_int(value, key, source=where)


def even_cuts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Cut points ``(0, ..., num_layers)`` of the even layer-count split: counts differ by at most one and the
    first ``num_layers % num_stages`` stages take the extra layer (DeepSpeed's ``partition_uniform``). The one
    definition of "even split": the planner's baseline, the simulator and the trainer all call it."""
    if (not is_int(num_stages)
            or not 1 <= num_stages <= num_layers):
        raise InputError(f"cannot split {num_layers} layers into {num_stages!r} non-empty stages", source="pp_size",
                         field="pp_size")
    base, extra = divmod(int(num_layers), int(num_stages))
    return tuple(int(x) for x in np.cumsum([0] + [base + (s < extra) for s in range(int(num_stages))]))

