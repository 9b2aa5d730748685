"""A Hugging Face VLM config (Llava or InternVL, transformers 5.x) as omnibal's :class:`ModelSpec`.

One owner for "which layers does this checkpoint have": the planner (``omnibal plan --hf-model DIR``, which
needs only ``config.json``) and the trainer's adapter (:mod:`omnibal.train.hf_adapter`, which wraps the
loaded model) both call :func:`spec_from_hf_config`, so a plan made from a checkpoint's config names exactly
the chain the trainer builds from its weights.

The config is read duck-typed (attributes of a ``PretrainedConfig``), so this module imports neither torch
nor transformers; :func:`load_hf_spec` imports ``transformers.AutoConfig`` only to read a folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from omnibal.cost.spec import LLMSpec, ModelSpec, VisionSpec
from omnibal.errors import InputError
from omnibal.validate import is_int

SUPPORTED = ("llava", "internvl")
"""``config.model_type`` values with an adapter (LlavaForConditionalGeneration, InternVLForConditionalGeneration)."""


def used_vision_layers(layer, num_vision: int, where: str) -> int:
    """Encoder layers that run when the features are read at ``vision_feature_layer`` (HF's
    ``hidden_states[k]`` is the output of k layers; -1 the last one)."""
    if not is_int(layer):
        raise InputError(f"only a single vision_feature_layer is supported, got {layer!r}", source=where,
                         field="vision_feature_layer")
    used = layer if layer >= 0 else num_vision + 1 + layer
    if not 1 <= used <= num_vision:
        raise InputError(f"vision_feature_layer {layer} selects no encoder layer of {num_vision}", source=where,
                         field="vision_feature_layer")
    return used


def _side(value) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def spec_from_hf_config(cfg, *, name: str | None = None, where: str | None = None) -> ModelSpec:
    """The layer chain of a Llava / InternVL config (see :mod:`omnibal.train.hf_adapter` for the modules each
    chain link runs). ``name`` defaults to ``hf-<model_type>``."""
    kind = getattr(cfg, "model_type", None)
    where = where or f"{kind} config"
    if kind not in SUPPORTED:
        raise InputError(f"model_type {kind!r} has no adapter; supported: {', '.join(SUPPORTED)} "
                         "(LlavaForConditionalGeneration, InternVLForConditionalGeneration)", source=where,
                         field="model_type")
    strategy = getattr(cfg, "vision_feature_select_strategy", "default")
    if strategy != "default":
        raise InputError(f"only vision_feature_select_strategy 'default' is supported, got {strategy!r}",
                         source=where, field="vision_feature_select_strategy")
    vc, tc = cfg.vision_config, cfg.text_config
    used = used_vision_layers(cfg.vision_feature_layer, vc.num_hidden_layers, where)
    tie = bool(getattr(cfg, "tie_word_embeddings", False) or getattr(tc, "tie_word_embeddings", False))
    return ModelSpec(
        name=name or f"hf-{kind}",
        vision=VisionSpec(num_layers=used, hidden=vc.hidden_size, num_heads=vc.num_attention_heads,
                          mlp_hidden=vc.intermediate_size, image_size=_side(vc.image_size),
                          patch_size=_side(vc.patch_size), class_token=True,
                          # InternVL's vision layers always scale both branches (lambda_1, lambda_2)
                          qk_norm=bool(getattr(vc, "use_qk_norm", False)), layer_scale=kind == "internvl",
                          mlp_act="quick_gelu" if getattr(vc, "hidden_act", "gelu") == "quick_gelu" else "gelu"),
        # Llama / Qwen2 decoders normalise with transformers' eager RMSNorm, which keeps an fp32 input copy
        llm=LLMSpec(num_layers=tc.num_hidden_layers, hidden=tc.hidden_size, num_heads=tc.num_attention_heads,
                    num_kv_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
                    mlp_hidden=tc.intermediate_size, vocab_size=tc.vocab_size, tie_embeddings=tie,
                    norm_fp32_copy=True, vocab_multiple=1),
        downsample_ratio=1.0 if kind == "llava" else float(cfg.downsample_ratio),
        projector_norm=kind == "internvl",
    )


def load_hf_config(path: str | os.PathLike):
    """``AutoConfig`` of a local checkpoint folder (no hub access), or an ``InputError`` naming the folder."""
    p = Path(path)
    if not p.is_dir():
        raise InputError("not a folder: --hf-model takes a local Hugging Face checkpoint folder", source=str(p),
                         field="hf_model")
    if not (p / "config.json").is_file():
        raise InputError("not a Hugging Face model folder: no config.json", source=str(p), field="hf_model")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise InputError("a Hugging Face checkpoint needs transformers: pip install 'omnibal[hf]'", source=str(p),
                         field="hf_model") from None
    try:
        return AutoConfig.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"config.json does not load: {first}", source=str(p / "config.json"),
                         field="hf_model") from None


def load_hf_spec(path: str | os.PathLike) -> ModelSpec:
    """The :class:`ModelSpec` of a local Llava / InternVL checkpoint folder, from its ``config.json`` alone."""
    return spec_from_hf_config(load_hf_config(path), where=str(Path(path) / "config.json"))
