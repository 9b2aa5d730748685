"""A plan in the shapes other trainers take.

* ``torchtitan``: module names per pipeline stage (torchtitan's ``module_names_per_model_chunk`` shape: one
  list of fully qualified module names per stage), plus the modules to checkpoint per stage.
* ``megatron``: a ``pipeline_model_parallel_layout``-style string. Megatron's grammar covers the language
  model only (``E`` embedding, ``t`` decoder layer, ``L`` final norm + loss; stages separated by ``|``,
  ``t*3`` = three layers). A VLM stage also holds vision layers, which that grammar has no letter for; we
  write them as ``V`` (patch embedding), ``v`` (ViT block) and ``P`` (projector), so the string shows the
  whole split. Megatron itself accepts the string only with the vision letters removed (a VLM wrapper must
  place the encoder), so ``megatron_llm_layout`` gives that form too, and per-stage
  ``recompute_num_layers`` (block granularity: the first N layers of each stage, as omnibal chooses them).
* ``deepspeed``: ``parts``, the stage boundary list of ``PipelineModule`` (stage ``s`` owns layer specs
  ``parts[s]:parts[s+1]`` of the same chain).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnibal.plan.plan import Plan

_LETTER = {"vision_embed": "V", "vision_block": "v", "projector": "P", "llm_embed": "E", "llm_block": "t",
           "lm_head": "L"}


def _kind_of(name: str) -> str:
    if name == "vision.embed":
        return "vision_embed"
    if name.startswith("vision.blocks."):
        return "vision_block"
    if name == "projector":
        return "projector"
    if name == "llm.embed":
        return "llm_embed"
    if name.startswith("llm.blocks."):
        return "llm_block"
    if name == "llm.head":
        return "lm_head"
    return "other"


def _run_length(letters: list[str]) -> str:
    out = []
    i = 0
    while i < len(letters):
        j = i
        while j < len(letters) and letters[j] == letters[i]:
            j += 1
        n = j - i
        out.append(letters[i] if n == 1 else f"{letters[i]}*{n}")
        i = j
    return "".join(out)


def megatron_layout(plan: Plan, *, vision_letters: bool = True) -> str:
    stages = []
    for st in plan.stages:
        letters = [_LETTER.get(_kind_of(m), "?") for m in st.modules]
        if not vision_letters:
            letters = [c for c in letters if c in "EtL"]
        stages.append(_run_length(letters))
    return "|".join(stages)


def torchtitan_module_names(plan: Plan) -> list[list[str]]:
    return [list(st.modules) for st in plan.stages]


def deepspeed_parts(plan: Plan) -> list[int]:
    return list(plan.parts)


def export_all(plan: Plan) -> dict:
    return {
        "torchtitan": {"module_names_per_stage": torchtitan_module_names(plan),
                       "checkpoint_modules_per_stage": [list(st.recompute) for st in plan.stages]},
        "megatron": {"pipeline_model_parallel_layout": megatron_layout(plan),
                     "megatron_llm_layout": megatron_layout(plan, vision_letters=False),
                     "recompute_granularity": "full", "recompute_method": "block",
                     "recompute_num_layers_per_stage": [len(st.recompute) for st in plan.stages],
                     # block recompute checkpoints the first N layers of a stage: exact only where the
                     # planned set is such a prefix (the per-module lists above are always exact)
                     "recompute_is_prefix_per_stage": [list(st.recompute) == list(st.modules[:len(st.recompute)])
                                                       for st in plan.stages]},
        "deepspeed": {"parts": deepspeed_parts(plan), "partition_method": "parts (set PipelineModule.parts)"},
    }
