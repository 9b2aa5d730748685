"""Megatron-core from an omnibal plan (tested with megatron-core 0.16.1).

``omnibal plan --engine megatron`` writes ``exports/megatron.json`` (``TransformerConfig`` fields of the
language model and of the vision encoder) and ``exports/megatron_args.txt`` (the same as Megatron-LM
training flags, one per line: ``pretrain_vlm.py $(cat megatron_args.txt) ...``). With megatron-core::

    from omnibal.integrations.megatron import load_export, transformer_configs
    language, vision = transformer_configs(load_export("omnibal-out/exports/megatron.json"))
    # LLaVAModel(language_transformer_config=language, vision_transformer_config=vision, ...)

What Megatron expresses and omnibal plans for (``omnibal plan --engine megatron``): the decoder split by
``pipeline_model_parallel_layout`` (``E`` embedding, ``t`` decoder layer, ``L`` loss; the vision encoder
and projector live with ``E`` on the first stage, outside the layout's letters), and block recompute with one
``recompute_num_layers`` for every stage (the first N decoder layers of each stage) plus one for the vision
encoder's own config. The projector, embeddings and head are never recomputed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnibal.errors import InputError
from omnibal.outputs import write_text
from omnibal.plan.exports import megatron_fields

TESTED_VERSIONS = ">=0.14,<0.17"
"""megatron-core versions whose ``TransformerConfig`` / layout grammar this export follows (CI: 0.16.1)."""
_ARG_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
               "tensor_model_parallel_size", "pipeline_model_parallel_size", "pipeline_model_parallel_layout",
               "recompute_granularity", "recompute_method", "recompute_num_layers")


def write_exports(plan, out_dir: str | Path) -> list[Path]:
    """``megatron.json`` and ``megatron_args.txt`` into ``out_dir`` (``InputError`` when the plan is not
    expressible in Megatron: re-plan with ``--engine megatron``)."""
    fields = megatron_fields(plan)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path, args = out / "megatron.json", out / "megatron_args.txt"
    write_text(path, json.dumps({"engine": "megatron", "tested_versions": TESTED_VERSIONS, **fields}, indent=2) + "\n")
    write_text(args, "\n".join(cli_args(fields)) + "\n")
    return [path, args]


def cli_args(fields: dict) -> list[str]:
    """Megatron-LM flags of the language model (``--use-distributed-optimizer`` for ZeRO-1); the vision
    encoder's recompute has no flag of its own there and stays in ``megatron.json``."""
    language = fields["language"]
    out = []
    for key in _ARG_FIELDS:
        value = language.get(key)
        if value is not None:
            out.append(f"--{key.replace('_', '-')}={value}")
    if language.get("num_query_groups") not in (None, language.get("num_attention_heads")):
        out.append("--group-query-attention")
    if fields.get("use_distributed_optimizer"):
        out.append("--use-distributed-optimizer")
    batch = fields["micro_batches_per_step"] * fields["data_parallel_size"]
    out += ["--micro-batch-size=1", f"--global-batch-size={batch}", "--variable-seq-lengths"]
    return out


def load_export(path: str | Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the Megatron export: {exc}", source=str(path)) from None
    for key in ("language", "vision"):
        if not isinstance(doc, dict) or not isinstance(doc.get(key), dict):
            raise InputError("missing", source="megatron", field=key)
    return doc


def transformer_configs(export: dict, **overrides):
    """``(language, vision)`` megatron-core ``TransformerConfig`` objects built from the export (megatron-core
    checks them; ``overrides`` apply to both, e.g. ``bf16=True``)."""
    # optional engine: imported only when its adapter is used
    from megatron.core.transformer.transformer_config import TransformerConfig

    def build(fields: dict, where: str):
        kw = dict(fields)
        if isinstance(kw.get("pipeline_dtype"), str):
            kw["pipeline_dtype"] = getattr(torch, kw["pipeline_dtype"])
        kw.update(overrides)
        try:
            return TransformerConfig(**kw)
        except (TypeError, ValueError, AssertionError) as exc:
            raise InputError(f"megatron-core refused the config: {exc}", source="megatron", field=where) from None

    return build(export["language"], "language"), build(export["vision"], "vision")


def stage_layer_counts(language_config) -> list[int]:
    """Decoder layers megatron-core builds on each (virtual) pipeline stage under the config's layout, in
    virtual stage order (chunk ``c`` of rank ``r`` at ``c * pp + r``; one chunk per rank without interleaving)."""
    layout = language_config.pipeline_model_parallel_layout
    pp = language_config.pipeline_model_parallel_size
    if layout is None:
        raise InputError("no pipeline_model_parallel_layout", source="megatron", field="pipeline_model_parallel_layout")
    if layout.virtual_pipeline_model_parallel_size == 1:
        return [layout.get_num_layers_to_build(pp_rank=r) for r in range(pp)]
    # its getters read the virtual stage only under an initialised virtual pipeline (parallel_state): read the
    # parsed layout itself, ``layout[rank][chunk]``
    from megatron.core.transformer.enums import LayerType

    return [layout.layout[r][c].count(LayerType.decoder)
            for c in range(layout.virtual_pipeline_model_parallel_size) for r in range(pp)]


def check_model(export: dict, *, num_layers: int, num_vision_layers: int | None = None) -> None:
    """Refuse an export made for another model (its layer counts differ from the model's)."""
    planned = export["language"]["num_layers"]
    if planned != num_layers:
        raise InputError(f"the plan ({export.get('model', '?')}) has {planned} decoder layers, the model {num_layers}",
                         source="megatron", field="num_layers")
    if num_vision_layers is not None and export["vision"]["num_layers"] != num_vision_layers:
        raise InputError(f"the plan has {export['vision']['num_layers']} vision layers, the model "
                         f"{num_vision_layers}", source="megatron", field="vision.num_layers")
