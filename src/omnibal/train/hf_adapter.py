"""Hugging Face adapter: a transformers VLM exposed as omnibal's layer chain, so a plan splits it.

Users bring their own model; :func:`from_llava` wraps a ``LlavaForConditionalGeneration`` (transformers
5.x) without copying weights: each chain link is a thin module around the HF module(s) it names, taking and
returning the same carry as the reference model (:mod:`omnibal.train.stage`), so ``build_stage``,
``example_carry``, ``apply_checkpointing`` and the collator work unchanged.

==================  ====================================================================================
chain name          Llava modules (transformers 5.x)
==================  ====================================================================================
vision.embed        model.vision_tower.embeddings, model.vision_tower.pre_layrnorm
vision.blocks.{i}   model.vision_tower.encoder.layers.{i}, i < the layer ``vision_feature_layer`` selects
projector           model.multi_modal_projector (after dropping the class token: strategy ``default``)
llm.embed           model.language_model.embed_tokens (image features fill the image-token slots)
llm.blocks.{i}      model.language_model.layers.{i} (+ the shared model.language_model.rotary_emb)
llm.head            model.language_model.norm, lm_head (+ summed token loss)
==================  ====================================================================================

Llava reads the vision features at ``vision_feature_layer`` (default -2, before ``post_layernorm``), so the
encoder layers after it and ``post_layernorm`` never run: they are left out of the chain (they get no
gradient in HF either). Each tile slot is one Llava image. Positions restart in each sample, and packed
samples are kept apart by the language model's attention: where the model runs plain scaled dot-product
attention, the chain switches it to :data:`PACKED_ATTENTION` (varlen: a flash kernel on CUDA, one SDPA call
per sample elsewhere, cost sum len^2); otherwise (flash-attention-2 models, dropout, a custom scale) a
block-diagonal causal mask goes to the HF attention (cost quadratic in the active tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnibal.cost.hf_spec import spec_from_hf_config
from omnibal.cost.spec import LayerSpec, ModelSpec
from omnibal.data.collate import (
    IGNORE_INDEX,
    META_IMAGE_INDEX,
    META_INPUT_IDS,
    META_LABELS,
    META_POSITION_IDS,
    META_SEGMENT_IDS,
    SIZE_TILES,
    SIZE_TOKENS,
    CollateConfig,
)
from omnibal.errors import InputError
from omnibal.train.layers import Options, active_count, packed_causal_attention
from omnibal.train.model import carry_activation_shape
from omnibal.train.stage import attach_module


def _pad_tiles(y: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """Put the computed tiles ``y`` back in front of the untouched tail of the buffer ``x``."""
    if n == 0:
        y = y * 0  # keep gradients defined when a micro-batch has no image
    return torch.cat([y.unsqueeze(0), x[:, y.shape[0]:]], dim=1) if x is not None else y.unsqueeze(0)


class _VisionEmbed(nn.Module):
    def __init__(self, embeddings: nn.Module, pre_norm: nn.Module | None, opts: Options) -> None:
        super().__init__()
        self.embeddings, self.opts = embeddings, opts
        self.pre_norm = pre_norm if pre_norm is not None else nn.Identity()

    def forward(self, pixels, token_meta, sizes):
        q_v = pixels.shape[1]
        n = active_count(sizes, SIZE_TILES, q_v, self.opts)
        y = self.pre_norm(self.embeddings(pixels[0, :max(n, 1)]))
        if n == 0:
            y = y * 0
        out = torch.cat([y.unsqueeze(0), y.new_zeros(1, q_v - y.shape[0], *y.shape[1:])], dim=1)
        return out, token_meta, sizes


class _VisionBlock(nn.Module):
    def __init__(self, layer: nn.Module, opts: Options, *, takes_mask: bool) -> None:
        super().__init__()
        self.layer, self.opts, self.takes_mask = layer, opts, takes_mask

    def forward(self, x, token_meta, sizes):
        n = active_count(sizes, SIZE_TILES, x.shape[1], self.opts)
        h = x[0, :max(n, 1)]
        y = self.layer(h, attention_mask=None) if self.takes_mask else self.layer(h)
        y = y[0] if isinstance(y, tuple) else y
        return _pad_tiles(y, x, n), token_meta, sizes


class _Projector(nn.Module):
    def __init__(self, projector: nn.Module, opts: Options) -> None:
        super().__init__()
        self.projector, self.opts = projector, opts

    def forward(self, x, token_meta, sizes):
        q_v = x.shape[1]
        n = active_count(sizes, SIZE_TILES, q_v, self.opts)
        y = self.projector(x[0, :max(n, 1), 1:])  # strategy "default": drop the class token
        if n == 0:
            y = y * 0
        out = torch.cat([y.unsqueeze(0), y.new_zeros(1, q_v - y.shape[0], *y.shape[1:])], dim=1)
        return out, token_meta, sizes


class _InternVLProjector(nn.Module):
    """InternVL: (final vision norm when the last layer is read), drop the class token, pixel shuffle by
    ``downsample_ratio`` (InternVLModel.pixel_shuffle), multi_modal_projector."""

    def __init__(self, final_norm: nn.Module | None, projector: nn.Module, shuffle_owner: nn.Module,
                 ratio: float, opts: Options) -> None:
        super().__init__()
        self.final_norm = final_norm if final_norm is not None else nn.Identity()
        self.projector, self.ratio, self.opts = projector, ratio, opts
        self._owner = [shuffle_owner]  # the InternVLModel, for its pixel_shuffle method (no parameters)

    def forward(self, x, token_meta, sizes):
        q_v = x.shape[1]
        n = active_count(sizes, SIZE_TILES, q_v, self.opts)
        h = self.final_norm(x[0, :max(n, 1)])[:, 1:]
        side = int(round(h.shape[1] ** 0.5))
        h = self._owner[0].pixel_shuffle(h.reshape(h.shape[0], side, side, -1), scale_factor=self.ratio)
        y = self.projector(h.reshape(h.shape[0], -1, h.shape[-1]))
        if n == 0:
            y = y * 0
        out = torch.cat([y.unsqueeze(0), y.new_zeros(1, q_v - y.shape[0], *y.shape[1:])], dim=1)
        return out, token_meta, sizes


class _TextEmbed(nn.Module):
    def __init__(self, embed_tokens: nn.Module, opts: Options) -> None:
        super().__init__()
        self.embed_tokens, self.opts = embed_tokens, opts

    def forward(self, features, token_meta, sizes):
        h = self.embed_tokens(token_meta[0, META_INPUT_IDS])
        slot = token_meta[0, META_IMAGE_INDEX]
        img = features.reshape(-1, features.shape[-1]).to(h.dtype)[slot.clamp(min=0)]
        return torch.where((slot >= 0).unsqueeze(-1), img, h).unsqueeze(0), token_meta, sizes


def packed_causal_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, n, n] mask: 0 where a token may attend (same segment, not in the future), else the
    dtype's minimum (what HF's eager and SDPA attention both accept)."""
    n = segment_ids.shape[0]
    idx = torch.arange(n, device=segment_ids.device)
    allowed = (segment_ids[:, None] == segment_ids[None, :]) & (idx[None, :] <= idx[:, None])
    mask = torch.zeros(n, n, dtype=dtype, device=segment_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


PACKED_ATTENTION = "omnibal_packed"
"""The transformers attention interface the chain registers for its language model: causal attention inside
each packed sample (:func:`omnibal.train.layers.packed_causal_attention`: a flash-attention varlen kernel on
CUDA, one SDPA call per sample elsewhere), with the samples' segment ids passed by the chain."""


def _packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """``transformers.AttentionInterface`` function of :data:`PACKED_ATTENTION`: query [1, H, n, hd], key and
    value [1, Hkv, n, hd] -> ([1, n, H, hd], None) when the chain passes ``segment_ids`` [n]; any other call
    (the HF model's own forward, generation) is transformers' SDPA attention, as before the switch."""
    segment_ids = kwargs.pop("segment_ids", None)
    if segment_ids is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is not None or query.shape[0] != 1:
        raise RuntimeError(f"{PACKED_ATTENTION} attention with segment_ids takes one packed sequence, no mask")
    out = packed_causal_attention(query[0], key[0], value[0], segment_ids, "auto")
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


def use_packed_attention(text_model: nn.Module) -> bool:
    """Switch a transformers decoder to :data:`PACKED_ATTENTION` (registered once) when its attention is
    plain scaled dot-product attention (``eager`` or ``sdpa``, no dropout, the default 1/sqrt(head_dim)
    scale); returns whether it did. The setting lives on the config object only: ``save_pretrained`` does not
    write it, so a saved checkpoint loads as before."""
    from transformers import AttentionInterface  # the hf extra: only HF models reach this

    config = text_model.config
    if config._attn_implementation not in ("eager", "sdpa", PACKED_ATTENTION):
        return False
    attn = text_model.layers[0].self_attn
    head_dim = getattr(attn, "head_dim", None)
    if getattr(config, "attention_dropout", 0.0) or head_dim is None or \
            abs(float(getattr(attn, "scaling", head_dim**-0.5)) - head_dim**-0.5) > 1e-12:
        return False
    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
    config._attn_implementation = PACKED_ATTENTION
    return True


class _TextBlock(nn.Module):
    def __init__(self, layer: nn.Module, rotary: nn.Module, opts: Options, *, packed: bool = False) -> None:
        super().__init__()
        self.layer, self.opts, self.packed = layer, opts, packed
        self._rotary = [rotary]  # shared, parameter-free: kept out of the module tree (no duplicate buffers)

    def forward(self, x, token_meta, sizes):
        n = active_count(sizes, SIZE_TOKENS, x.shape[1], self.opts)
        h = x[:, :n]
        position_ids = token_meta[:, META_POSITION_IDS, :n]
        rotary = self._rotary[0]
        if rotary.inv_freq.device != h.device:
            rotary.to(h.device)
        cos_sin = rotary(h, position_ids)
        segments = token_meta[0, META_SEGMENT_IDS, :n]
        if self.packed:
            y = self.layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=cos_sin,
                           segment_ids=segments)
        else:
            y = self.layer(h, attention_mask=packed_causal_mask(segments, h.dtype), position_ids=position_ids,
                           position_embeddings=cos_sin)
        y = y[0] if isinstance(y, tuple) else y
        return torch.cat([y, x[:, n:]], dim=1), token_meta, sizes


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module, opts: Options) -> None:
        super().__init__()
        self.norm, self.lm_head, self.opts = norm, lm_head, opts

    def forward(self, x, token_meta, sizes):
        n = active_count(sizes, SIZE_TOKENS, x.shape[1], self.opts)
        logits = self.lm_head(self.norm(x[0, :n]))
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        labels = token_meta[0, META_LABELS, :n]
        loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss.reshape(1), (labels != IGNORE_INDEX).sum().reshape(1)


class HFChain(nn.Module):
    """A Hugging Face VLM as omnibal's layer chain (``chain()``, ``boundary_activation()``, ``spec``).

    The HF model stays the owner of the weights (``hf_model``; save and load it the HF way); ``spec`` is the
    :class:`ModelSpec` the planner and cost model use for it, and ``hf_module_names`` maps every chain name
    to the HF modules it runs.
    """

    def __init__(self, hf_model: nn.Module, spec: ModelSpec, links: list[tuple[str, nn.Module]],
                 hf_module_names: dict[str, tuple[str, ...]], *, image_token_id: int, opts: Options) -> None:
        super().__init__()
        self.spec = spec
        self.options = opts
        self.image_token_id = image_token_id
        self.hf_module_names = hf_module_names
        self._hf = [hf_model]  # not a submodule: parameters are reached through the chain links only
        for link_name, module in links:
            attach_module(self, link_name, module)
        assert [n for n, _ in links] == [layer.name for layer in spec.layers()]

    @property
    def hf_model(self) -> nn.Module:
        return self._hf[0]

    def chain(self) -> list[tuple[LayerSpec, nn.Module]]:
        return [(layer, self.get_submodule(layer.name)) for layer in self.spec.layers()]

    def forward(self, pixel_values, token_meta, sizes):
        carry = (pixel_values, token_meta, sizes)
        for _, module in self.chain():
            carry = module(*carry)
        return carry

    def boundary_activation(self, start: int, *, num_tiles: int, num_tokens: int):
        return carry_activation_shape(self.spec, start, num_tiles=num_tiles, num_tokens=num_tokens)

    def collate_config(self, *, num_tiles: int, num_tokens: int, mode: str = "pack", pad_token_id: int = 0,
                       image_token_id: int | None = None) -> CollateConfig:
        if image_token_id is not None and image_token_id != self.image_token_id:
            raise InputError(f"the samples mark image slots with token {image_token_id}, the model's config with "
                             f"{self.image_token_id}", source="image_token_id", field="image_token_id")
        return CollateConfig(num_tiles=num_tiles, num_tokens=num_tokens, image_size=self.spec.vision.image_size,
                             tokens_per_tile=self.spec.llm_tokens_per_tile, image_token_id=self.image_token_id,
                             pad_token_id=pad_token_id, mode=mode)  # type: ignore[arg-type]


def from_llava(model: nn.Module, *, name: str = "hf-llava", compute_tail: bool = False) -> HFChain:
    """Wrap a transformers ``LlavaForConditionalGeneration`` (5.x module names) as a layer chain."""
    spec = spec_from_hf_config(model.config, name=name, where=f"{type(model).__name__} config")
    _, tower, projector, text, vision_layers = _hf_parts(model, "Llava", "layers")
    opts = Options(attn_impl="mask", compute_tail=compute_tail)
    tower_name = "model.vision_tower"
    links: list[tuple[str, nn.Module]] = [("vision.embed", _VisionEmbed(tower.embeddings, tower.pre_layrnorm, opts))]
    names: dict[str, tuple[str, ...]] = {"vision.embed": (f"{tower_name}.embeddings", f"{tower_name}.pre_layrnorm")}
    _add_vision_blocks(links, names, vision_layers, "layers", spec.vision.num_layers, opts, takes_mask=True)
    links.append(("projector", _Projector(projector, opts)))
    names["projector"] = ("model.multi_modal_projector",)
    _add_text_links(links, names, model, text, spec.llm.num_layers, opts)
    return HFChain(model, spec, links, names, image_token_id=int(model.config.image_token_id), opts=opts)


def _hf_parts(model: nn.Module, family: str, layers_attr: str):
    """``(model.model, its vision tower, projector, language model, the tower's encoder.<layers_attr>)``, or
    an InputError naming the model class."""
    try:
        inner = model.model
        tower = inner.vision_tower
        return (inner, tower, inner.multi_modal_projector, inner.language_model,
                getattr(tower.encoder, layers_attr))
    except AttributeError as e:
        raise InputError(f"not a transformers 5.x {family} model ({e})", source=type(model).__name__) from e


def _add_vision_blocks(links, names, layers, layers_attr: str, used: int, opts: Options, *, takes_mask: bool) -> None:
    """``vision.blocks.{i}`` for the first ``used`` of the tower's ``layers`` (``encoder.<layers_attr>``)."""
    for i in range(used):
        links.append((f"vision.blocks.{i}", _VisionBlock(layers[i], opts, takes_mask=takes_mask)))
        names[f"vision.blocks.{i}"] = (f"model.vision_tower.encoder.{layers_attr}.{i}",)


def _add_text_links(links, names, model, text, num_layers: int, opts: Options) -> None:
    text_name = "model.language_model"
    links.append(("llm.embed", _TextEmbed(text.embed_tokens, opts)))
    names["llm.embed"] = (f"{text_name}.embed_tokens",)
    packed = use_packed_attention(text)
    for i in range(num_layers):
        links.append((f"llm.blocks.{i}", _TextBlock(text.layers[i], text.rotary_emb, opts, packed=packed)))
        names[f"llm.blocks.{i}"] = (f"{text_name}.layers.{i}",)
    links.append(("llm.head", _Head(text.norm, model.lm_head, opts)))
    names["llm.head"] = (f"{text_name}.norm", "lm_head")


def from_internvl(model: nn.Module, *, name: str = "hf-internvl", compute_tail: bool = False) -> HFChain:
    """Wrap a transformers ``InternVLForConditionalGeneration`` (5.x) as a layer chain.

    Chain -> modules: ``vision.embed`` model.vision_tower.embeddings; ``vision.blocks.{i}``
    model.vision_tower.encoder.layer.{i}; ``projector`` (model.vision_tower.layernorm when the last layer is
    read,) pixel shuffle, model.multi_modal_projector; the text links as for Llava. InternVL ties
    ``lm_head`` to ``embed_tokens`` by default: such a model splits only with both in one stage."""
    cfg = model.config
    spec = spec_from_hf_config(cfg, name=name, where=f"{type(model).__name__} config")
    used, num_vision = spec.vision.num_layers, cfg.vision_config.num_hidden_layers
    inner, tower, projector, text, vision_layers = _hf_parts(model, "InternVL", "layer")
    opts = Options(attn_impl="mask", compute_tail=compute_tail)
    tower_name = "model.vision_tower"
    links: list[tuple[str, nn.Module]] = [("vision.embed", _VisionEmbed(tower.embeddings, None, opts))]
    names: dict[str, tuple[str, ...]] = {"vision.embed": (f"{tower_name}.embeddings",)}
    _add_vision_blocks(links, names, vision_layers, "layer", used, opts, takes_mask=False)
    reads_last = used == num_vision and cfg.vision_feature_layer == -1
    links.append(("projector", _InternVLProjector(tower.layernorm if reads_last else None, projector, inner,
                                                  float(cfg.downsample_ratio), opts)))
    names["projector"] = ((f"{tower_name}.layernorm",) if reads_last else ()) + ("model.multi_modal_projector",)
    _add_text_links(links, names, model, text, spec.llm.num_layers, opts)
    return HFChain(model, spec, links, names, image_token_id=int(cfg.image_token_id), opts=opts)


def from_hf(model: nn.Module, **kwargs) -> HFChain:
    """The adapter for ``model``'s class: Llava or InternVL (transformers 5.x)."""
    kind = type(model).__name__
    if kind.startswith("Llava"):
        return from_llava(model, **kwargs)
    if kind.startswith("InternVL"):
        return from_internvl(model, **kwargs)
    raise InputError(f"no adapter for {kind} (supported: LlavaForConditionalGeneration, "
                     "InternVLForConditionalGeneration)", source=kind)
