"""A plan in the fields each engine reads (pure data; ``omnibal.integrations.*`` writes the files and holds
the adapters that use the installed engines).

* ``deepspeed``: ``parts`` (stage ``s`` owns chain layers ``parts[s]:parts[s+1]``) and the chain layers to
  checkpoint per stage, which :func:`omnibal.integrations.deepspeed.pipeline_module` applies, plus a
  ``ds_config`` (gradient accumulation = micro-batches per step, ZeRO stage). Any plan is expressible as long
  as the schedule is 1F1B (no interleaving) and ZeRO <= 1.
* ``megatron``: ``TransformerConfig`` fields of the language model (``pipeline_model_parallel_layout`` in
  Megatron's letters ``E``/``t``/``L``, one segment per (virtual) stage, with
  ``virtual_pipeline_model_parallel_size`` for an interleaved plan; one ``recompute_num_layers`` for every
  stage) and of the vision encoder (its own ``recompute_num_layers``). Expressible only when stage 0 holds
  the whole vision encoder, projector and embedding, and every stage checkpoints its first N LLM blocks for
  one N (and the first N_vision vision blocks): what ``omnibal plan --engine megatron`` plans.
* ``torchtitan``: ``ParallelismConfig`` fields with ``module_fqns_per_model_part`` in torchtitan's module
  names (``vision_encoder``, ``tok_embeddings``, ``layers.N``, ``norm``, ``lm_head``) and one activation
  checkpointing mode (an interleaved plan: ``Interleaved1F1B`` over its virtual stages). Expressible only
  with the vision encoder on stage 0 and no block or every block checkpointed: what ``omnibal plan --engine
  torchtitan`` plans.

A plan an engine cannot express raises ``InputError`` naming the engine (``source``) and the field.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from omnibal.errors import InputError
from omnibal.layout import Engine


class Plan(Protocol):
    """What the exports read of a :class:`omnibal.plan.plan.Plan` (a protocol, so that ``plan.plan`` can embed
    the exports in its JSON without the two modules importing each other)."""

    stages: Sequence[Any]
    inputs: Any
    search: dict

    @property
    def parts(self) -> tuple[int, ...]: ...

    def recompute_modules(self) -> tuple[str, ...]: ...

EXPORT_ENGINES = (Engine.DEEPSPEED, Engine.MEGATRON, Engine.TORCHTITAN)
"""Engines with ready-to-use files (the ``reference`` engine's plan runs as it is, in ``omnibal train``)."""
_KINDS = (("vision.embed", "vision_embed"), ("vision.blocks.", "vision_block"), ("projector", "projector"),
          ("llm.embed", "llm_embed"), ("llm.blocks.", "llm_block"), ("llm.head", "lm_head"))


def kind_of(name: str) -> str:
    for prefix, kind in _KINDS:
        if name == prefix or (prefix.endswith(".") and name.startswith(prefix)):
            return kind
    return "other"


def _run_length(letters: list[str]) -> str:
    out, i = [], 0
    while i < len(letters):
        j = i
        while j < len(letters) and letters[j] == letters[i]:
            j += 1
        out.append(letters[i] if j - i == 1 else f"{letters[i]}*{j - i}")
        i = j
    return "".join(out)


def _check_vision_first(plan: Plan, engine: str, field: str) -> None:
    for st in plan.stages[1:]:
        bad = [m for m in st.modules if kind_of(m) in ("vision_embed", "vision_block", "projector", "llm_embed")]
        if bad:
            raise InputError(f"stage {st.stage} holds {bad[0]}{' ..' if len(bad) > 1 else ''}; {engine} keeps the "
                             "vision encoder, projector and LLM embedding whole on the first stage (re-plan with "
                             f"omnibal plan --engine {engine})", source=engine, field=field)


def block_counts(plan: Plan, kind: str, engine: str, field: str) -> int:
    """The one N such that every stage checkpoints exactly its first ``min(N, blocks)`` blocks of ``kind``;
    ``InputError`` when no such N exists."""
    per_stage = []
    for st in plan.stages:
        blocks = [m for m in st.modules if kind_of(m) == kind]
        chosen = [m for m in st.recompute if kind_of(m) == kind]
        if chosen != blocks[:len(chosen)]:
            raise InputError(f"stage {st.stage} checkpoints {kind} layers that are not its first ones "
                             f"({chosen[:3]}...); {engine} recomputes the first N blocks of each stage", source=engine,
                             field=field)
        per_stage.append((len(blocks), len(chosen)))
    n = max(c for _, c in per_stage)
    for s, (blocks, chosen) in enumerate(per_stage):
        if chosen != min(n, blocks):
            raise InputError(f"stage {s} checkpoints {chosen} of its {blocks} {kind} layers but another stage "
                             f"{n}; {engine} takes one count for every stage", source=engine, field=field)
    return n


def _check_no_selective(plan: Plan, engine: str, field: str) -> None:
    """Selective recompute per block is omnibal's own trainer's (``omnibal.train.recompute``)."""
    chosen = [m for st in plan.stages for m in getattr(st, "selective", ())]
    if chosen:
        raise InputError(f"the plan recomputes {chosen[0]}{' ..' if len(chosen) > 1 else ''} selectively, which "
                         f"{engine} cannot express per layer (re-plan with omnibal plan --engine {engine})",
                         source=engine, field=field)


def _check_blocks_only(plan: Plan, engine: str, field: str) -> None:
    other = [m for m in plan.recompute_modules() if kind_of(m) not in ("vision_block", "llm_block")]
    if other:
        raise InputError(f"the plan checkpoints {other[0]}; {engine} recomputes transformer blocks only",
                         source=engine, field=field)


def deepspeed_fields(plan: Plan) -> dict:
    i, lay = plan.inputs, plan.inputs.layout
    pp_schedule = plan.pp_schedule
    if pp_schedule != "1f1b":
        why = (" and has no interleaved schedule (one layer range per stage; re-plan with omnibal plan --chunks 1)"
               if pp_schedule == "interleaved" else "")
        raise InputError(f"DeepSpeed's PipelineEngine runs 1F1B only{why}", source="deepspeed", field="pp_schedule")
    if lay.zero_stage > 1:
        why = ("DeepSpeed refuses ZeRO-2/3 with pipeline parallelism" if lay.pp_size > 1 else
               "this export builds DeepSpeed's PipelineEngine, which refuses ZeRO-2/3; a ZeRO-3 job without "
               "pipeline stages takes the plan's sampler (omnibal.data.sampler) and its recompute layers "
               "(plan.json stages[0].recompute) in its own engine")
        raise InputError(why, source="deepspeed", field="zero_optimization.stage")
    _check_no_selective(plan, "deepspeed", "recompute_layers_per_stage")
    names = [m for st in plan.stages for m in st.modules]
    index = {m: k for k, m in enumerate(names)}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": lay.num_microbatches,
              "train_batch_size": lay.num_microbatches * lay.dp_size, "zero_optimization": {"stage": lay.zero_stage},
              "bf16": {"enabled": True}, "gradient_clipping": 1.0, "steps_per_print": 100}
    return {"model": i.model, "num_stages": lay.pp_size, "parts": list(plan.parts), "layer_names": names,
            "recompute_layers_per_stage": [[index[m] for m in st.recompute] for st in plan.stages],
            "ds_config": config}


def megatron_layout(plan: Plan) -> str:
    """``pipeline_model_parallel_layout`` in Megatron's letters (the vision layers live outside the
    decoder's layout, on the first stage)."""
    letters = {"llm_embed": "E", "llm_block": "t", "lm_head": "L"}
    return "|".join(_run_length([letters[k] for k in map(kind_of, st.modules) if k in letters])
                    for st in plan.stages)


def megatron_fields(plan: Plan) -> dict:
    _check_vision_first(plan, "megatron", "pipeline_model_parallel_layout")
    _check_blocks_only(plan, "megatron", "recompute_granularity")
    _check_no_selective(plan, "megatron", "recompute_granularity")
    i, lay = plan.inputs, plan.inputs.layout
    if lay.zero_stage > 1:
        raise InputError("Megatron's distributed optimizer is ZeRO-1", source="megatron",
                         field="use_distributed_optimizer")
    if plan.pp_schedule not in ("1f1b", "interleaved"):
        raise InputError("Megatron-core pipelines with 1F1B or interleaved 1F1B", source="megatron",
                         field="pp_schedule")
    n_llm = block_counts(plan, "llm_block", "megatron", "recompute_num_layers")
    n_vision = block_counts(plan, "vision_block", "megatron", "vision.recompute_num_layers")
    spec = i.model_spec
    llm, vision = spec.get("llm") or {}, spec.get("vision") or {}
    language = {"num_layers": sum(kind_of(m) == "llm_block" for st in plan.stages for m in st.modules)}
    if llm:
        language.update(hidden_size=llm["hidden"], num_attention_heads=llm["num_heads"],
                        num_query_groups=llm["num_kv_heads"], ffn_hidden_size=llm["mlp_hidden"])
    language.update(tensor_model_parallel_size=lay.tp_size, pipeline_model_parallel_size=lay.pp_size,
                    pipeline_dtype="bfloat16", pipeline_model_parallel_layout=megatron_layout(plan),
                    **_recompute(n_llm))
    chunks = getattr(i, "num_chunks", 1)
    if chunks > 1:  # the layout has P * chunks segments, chunk c of rank d at c * P + d (Megatron's order too)
        language["virtual_pipeline_model_parallel_size"] = chunks
    vis = {"num_layers": sum(kind_of(m) == "vision_block" for m in plan.stages[0].modules)}
    if vision:
        vis.update(hidden_size=vision["hidden"], num_attention_heads=vision["num_heads"],
                   ffn_hidden_size=vision["mlp_hidden"])
    vis.update(**_recompute(n_vision))
    return {"model": i.model, "language": language, "vision": vis, "use_distributed_optimizer": lay.zero_stage == 1,
            "micro_batches_per_step": lay.num_microbatches, "data_parallel_size": lay.dp_size}


def _recompute(n: int) -> dict:
    if n == 0:
        return {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
    return {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": n}


def torchtitan_fqns(plan: Plan) -> list[list[str]]:
    """``module_fqns_per_model_part`` in torchtitan's module names (its VLMs: ``vision_encoder`` holds the
    ViT and the projector; the decoder is ``tok_embeddings``, ``layers.N``, ``norm``, ``lm_head``)."""
    out, llm_index = [], 0
    for st in plan.stages:
        fqns: list[str] = []
        for m in st.modules:
            kind = kind_of(m)
            if kind in ("vision_embed", "vision_block", "projector"):
                if "vision_encoder" not in fqns:
                    fqns.append("vision_encoder")
            elif kind == "llm_embed":
                fqns.append("tok_embeddings")
            elif kind == "llm_block":
                fqns.append(f"layers.{llm_index}")
                llm_index += 1
            elif kind == "lm_head":
                fqns += ["norm", "lm_head"]
        out.append(fqns)
    return out


def torchtitan_fields(plan: Plan) -> dict:
    _check_vision_first(plan, "torchtitan", "module_fqns_per_model_part")
    _check_blocks_only(plan, "torchtitan", "activation_checkpoint")
    _check_no_selective(plan, "torchtitan", "activation_checkpoint")
    blocks = [m for st in plan.stages for m in st.modules if kind_of(m) in ("vision_block", "llm_block")]
    chosen = plan.recompute_modules()
    if chosen and len(chosen) != len(blocks):
        raise InputError(f"the plan checkpoints {len(chosen)} of {len(blocks)} blocks; torchtitan's AC mode applies "
                         "to every block (full) or none", source="torchtitan", field="activation_checkpoint")
    i, lay = plan.inputs, plan.inputs.layout
    if lay.zero_stage == 1:
        raise InputError("optimizer-only sharding (ZeRO-1) does not exist in torchtitan; plan with ZeRO 0 "
                         "(replicate), 2 (FSDP, reshard_after_forward never) or 3 (FSDP, reshard_after_forward "
                         "always)", source="torchtitan", field="data_parallel_shard_degree")
    # interleaved: module_fqns_per_model_part has P x chunks parts, torchtitan's "loop" style puts part
    # c * P + d on rank d, as omnibal's virtual stages
    pp_schedule = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}[plan.pp_schedule]
    parallelism = {"pipeline_parallel_degree": lay.pp_size, "pipeline_parallel_schedule": pp_schedule,
                   "pipeline_parallel_microbatch_size": 1, "module_fqns_per_model_part": torchtitan_fqns(plan),
                   "tensor_parallel_degree": lay.tp_size}
    if lay.zero_stage >= 2:  # FSDP2 keeps the gathered weights after the forward (ZeRO-2) or frees them (ZeRO-3)
        parallelism.update(data_parallel_shard_degree=lay.dp_size, data_parallel_replicate_degree=1,
                           fsdp_reshard_after_forward="never" if lay.zero_stage == 2 else "always")
    else:
        parallelism.update(data_parallel_shard_degree=1, data_parallel_replicate_degree=lay.dp_size)
    return {"model": i.model, "parallelism": parallelism,
            "activation_checkpoint": {"mode": "full" if chosen else "none"},
            "training": {"local_batch_size": lay.num_microbatches}}


FIELDS = {"deepspeed": deepspeed_fields, "megatron": megatron_fields, "torchtitan": torchtitan_fields}


def engine_fields(plan: Plan, engine: str) -> dict:
    """The fields for ``engine``; ``InputError`` (naming the engine and field) when it cannot express the plan."""
    if engine not in FIELDS:
        raise InputError(f"no export for {engine!r}; one of {', '.join(EXPORT_ENGINES)}", source="--engine",
                         field="engine")
    return FIELDS[engine](plan)


def export_all(plan: Plan) -> dict:
    """Every engine's fields, or ``{"not_expressible": reason}`` (what ``plan.json`` carries under ``exports``)."""
    out = {}
    for engine in EXPORT_ENGINES:
        try:
            out[engine] = engine_fields(plan, engine)
        except InputError as exc:
            out[engine] = {"not_expressible": str(exc)}
    return out
