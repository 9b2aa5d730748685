"""Packed batches for Hugging Face VLMs: one balanced pack -> one batch a HF ``forward`` takes (the collator of
:class:`omnibal.integrations.hf.OmnibalTrainer`; usable with any loop).

:class:`HFPackCollator` turns a pack (a list of samples in omnibal's sample format, see
:mod:`omnibal.data.collate`) into one packed batch a HF VLM's ``forward`` accepts (LLaVA, InternVL and other
models that put image features into ``image_token_id`` slots of a Llama / Qwen2-style decoder):

``input_ids``     int64 [1, sum T]: the samples one after another, no padding.
``position_ids``  int64 [1, sum T]: restart at 0 in every sample, so RoPE sees each sample as if it ran alone.
``labels``        int64 [1, sum T]: the samples' unshifted labels with the FIRST token of every sample (and every
                  image token) set to -100. HF shifts labels inside its loss (position t predicts ``labels[t+1]``);
                  without this the last token of sample k would be trained to predict the first token of
                  sample k+1.
``pixel_values``  float [tiles, 3, S, S]: the tiles of the samples that have image tokens, in sample order. A
                  text-only sample's dummy tile is dropped (the key is absent when no sample has image tokens).
attention         ``attention="mask"`` (default): ``attention_mask`` [1, 1, T, T], block-diagonal causal (a token
                  sees the earlier tokens of its own sample only), bool (True = attend; sdpa only) or additive
                  float (0 / dtype min; eager and sdpa). transformers passes a 4-D mask through unchanged
                  (``masking_utils._preprocess_mask_arguments``). ``attention="flash"``: no mask, but
                  ``cu_seq_lens_q/k`` (int32 [n + 1]) and ``max_length_q/k`` (int): the varlen kwargs transformers'
                  flash-attention path reads (``modeling_flash_attention_utils.FlashAttentionKwargs``).
``omnibal_sample_index``  int64 [n], only with ``sample_index=True``: the samples' dataset indices.
                  ``OmnibalTrainer`` removes it before the forward (a plain ``Trainer`` would not).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Sequence

import torch

from omnibal.data.collate import IGNORE_INDEX
from omnibal.errors import InputError
from omnibal.validate import check_positive_int

__all__ = ["AttentionMode", "FLASH_KWARGS", "SAMPLE_INDEX_KEY", "HFPackCollator", "block_causal_mask"]

SAMPLE_INDEX_KEY = "omnibal_sample_index"
"""Batch key holding the dataset indices of a pack (``HFPackCollator(sample_index=True)``)."""


class AttentionMode(StrEnum):
    """How a pack's sequences are kept apart in attention."""

    MASK = "mask"
    """A block-causal mask (:func:`block_causal_mask`)."""
    FLASH = "flash"
    """FlashAttention's variable-length kwargs (``FLASH_KWARGS``)."""


FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def block_causal_mask(lengths: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[1, 1, T, T] mask of a pack of sequences of ``lengths``: causal inside each sequence, nothing across.
    ``dtype=torch.bool``: True where attention is allowed; a float dtype: additive (0 allowed, dtype min not)."""
    lengths_t = torch.as_tensor(list(lengths), dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(len(lengths_t)), lengths_t)
    pos = torch.arange(len(seg))
    allowed = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
    if dtype == torch.bool:
        return allowed[None, None]
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _attn_implementation(model) -> str | None:
    """The language model's attention implementation (what the packed sequence goes through)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)


class HFPackCollator:
    """Callable ``collate(samples) -> dict`` for a HF VLM (see the module docstring for the keys).

    ``image_token_id``  the model's image slot id (``config.image_token_id``); None: a text-only model.
    ``attention``       ``"mask"`` (4-D block-diagonal causal mask) or ``"flash"`` (flash-attention varlen kwargs).
    ``mask_dtype``      ``torch.bool`` (sdpa only: eager would *add* it) or a float dtype (additive; use the
                        model's dtype for eager). Default float32, right for both eager and sdpa.
    ``tokens_per_tile`` when given, every sample with image tokens must have ``tiles x tokens_per_tile`` of them.
    ``sample_index``    add ``omnibal_sample_index`` (the samples' ``index``) to the batch.
    """

    def __init__(self, *, image_token_id: int | None, attention: str = "mask",
                 mask_dtype: torch.dtype = torch.float32, tokens_per_tile: int | None = None,
                 sample_index: bool = False, source: str = "HFPackCollator") -> None:
        if attention not in tuple(AttentionMode):
            raise InputError(f"unknown attention {attention!r}; choose one of {', '.join(AttentionMode)}",
                             source=source, field="attention")
        if mask_dtype != torch.bool and not mask_dtype.is_floating_point:
            raise InputError(f"mask_dtype must be torch.bool or a float dtype, got {mask_dtype}", source=source,
                             field="mask_dtype")
        if tokens_per_tile is not None:
            check_positive_int(tokens_per_tile, "tokens_per_tile", source=source)
        self.image_token_id = None if image_token_id is None else int(image_token_id)
        self.attention = attention
        self.mask_dtype = mask_dtype
        self.tokens_per_tile = tokens_per_tile
        self.sample_index = bool(sample_index)
        self.source = source

    @classmethod
    def for_model(cls, model, **overrides) -> HFPackCollator:
        """The collator a HF model needs: its ``image_token_id``; a bool mask for sdpa, an additive mask in the
        model's dtype for eager, varlen kwargs for ``flash_attention_*``."""
        config = getattr(model, "config", None)
        if config is None:
            raise InputError("not a Hugging Face model (no .config)", source="model")
        image_token_id = getattr(config, "image_token_id", None)
        if image_token_id is None:
            image_token_id = getattr(config, "image_token_index", None)
        impl = _attn_implementation(model)
        if impl is not None and impl.startswith("flash_attention"):
            kwargs = dict(attention="flash")
        elif impl == "sdpa":
            kwargs = dict(attention="mask", mask_dtype=torch.bool)
        elif impl in (None, "eager"):
            kwargs = dict(attention="mask", mask_dtype=getattr(model, "dtype", torch.float32))
        else:
            raise InputError(f"attention implementation {impl!r} is not supported (eager, sdpa, flash_attention_*); "
                             "build HFPackCollator yourself if it reads a 4-D mask or the varlen kwargs",
                             source="model.config", field="attn_implementation")
        kwargs.update(overrides)
        return cls(image_token_id=image_token_id, **kwargs)

    def check_model(self, model) -> None:
        """Refuse a model whose attention would ignore (or misread) what this collator produces."""
        impl = _attn_implementation(model)
        if impl is None:
            return
        flash = impl.startswith("flash_attention")
        if flash and self.attention == "mask":
            raise InputError(f"the model uses {impl}, which takes no 4-D mask; use attention='flash'",
                             source=self.source, field="attention")
        if impl in ("eager", "sdpa") and self.attention == "flash":
            raise InputError(f"the model uses {impl}, which ignores the varlen kwargs; use attention='mask'",
                             source=self.source, field="attention")
        if impl == "eager" and self.mask_dtype == torch.bool:
            raise InputError("eager attention adds the mask to the scores: a bool mask would be read as 0/1; "
                             "use a float mask_dtype", source=self.source, field="mask_dtype")

    def _check(self, pos: int, sample: dict) -> tuple[int, int, bool]:
        """(index, tokens, has image tokens) of one sample; InputError naming it when malformed."""
        idx = int(sample.get("index", pos))
        where = dict(source=self.source, record=f"sample {idx}")
        for key in ("input_ids", "labels", "pixel_values"):
            if not isinstance(sample.get(key), torch.Tensor):
                raise InputError("missing or not a tensor", field=key, **where)
        ids, labels, pix = sample["input_ids"], sample["labels"], sample["pixel_values"]
        if ids.ndim != 1 or len(ids) == 0 or labels.shape != ids.shape:
            raise InputError(f"input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)} must be equal, "
                             "non-empty and 1-D", field="labels", **where)
        if pix.ndim != 4 or pix.shape[1] != 3:
            raise InputError(f"pixel_values shape {tuple(pix.shape)} is not [tiles, 3, S, S]", field="pixel_values",
                             **where)
        num_img = 0 if self.image_token_id is None else int((ids == self.image_token_id).sum())
        if num_img and (pix.shape[0] == 0 or (self.tokens_per_tile is not None
                                              and num_img != pix.shape[0] * self.tokens_per_tile)):
            raise InputError(f"{num_img} image tokens but {pix.shape[0]} tiles x {self.tokens_per_tile} tokens",
                             field="input_ids", **where)
        return idx, int(ids.shape[0]), num_img > 0

    def __call__(self, samples: Sequence[dict]) -> dict:
        if len(samples) == 0:
            raise InputError("empty pack", source=self.source)
        ids, labels, positions, pixels, lengths, indices = [], [], [], [], [], []
        for pos, s in enumerate(samples):
            idx, n, has_image = self._check(pos, s)
            x = s["input_ids"].to(torch.int64)
            y = s["labels"].to(torch.int64).clone()
            if self.image_token_id is not None:
                y[x == self.image_token_id] = IGNORE_INDEX  # image slots are never targets
            y[0] = IGNORE_INDEX  # HF shifts: the previous sample's last token must not predict this one
            ids.append(x)
            labels.append(y)
            positions.append(torch.arange(n, dtype=torch.int64))
            if has_image:
                pixels.append(s["pixel_values"])
            lengths.append(n)
            indices.append(idx)
        sizes = {tuple(p.shape[1:]) for p in pixels}
        if len(sizes) > 1:
            raise InputError(f"tiles of different sizes in one pack: {sorted(sizes)}", source=self.source,
                             record=f"samples {indices}", field="pixel_values")
        batch = {"input_ids": torch.cat(ids)[None], "position_ids": torch.cat(positions)[None],
                 "labels": torch.cat(labels)[None]}
        if pixels:
            batch["pixel_values"] = torch.cat(pixels)
        if self.attention == "mask":
            batch["attention_mask"] = block_causal_mask(lengths, self.mask_dtype)
        else:
            cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=max(lengths),
                         max_length_k=max(lengths))
        if self.sample_index:
            batch[SAMPLE_INDEX_KEY] = torch.tensor(indices, dtype=torch.int64)
        return batch
