"""What each training engine can run: its constraints, as inputs to the planner.

A plan is only useful if the engine that trains the model can express it. The engines differ in two ways
that matter to the planner:

* **where the vision encoder goes.** DeepSpeed's ``PipelineModule`` takes any list of layers and explicit
  stage boundaries, so the ViT may be split across stages like any other chain. Megatron-core's LLaVA and
  torchtitan's VLM pipelining (``pipeline_vlm``) keep the whole vision encoder, the projector and the LLM
  embedding on the first stage (the image features are scattered into the token embeddings there).
* **how recompute is chosen.** omnibal picks checkpointed layers per stage; DeepSpeed runs that choice
  through :mod:`omnibal.integrations.deepspeed`'s per-layer wrapper. Megatron takes one
  ``recompute_num_layers`` for every pipeline stage (``recompute_method="block"``: the first N decoder
  layers of each stage) and one for the vision encoder's own ``TransformerConfig``. torchtitan takes one
  activation-checkpointing mode for every block of every stage (``none`` or ``full``; its per-op
  ``selective`` and compiler ``memory-budget`` modes are outside the per-layer cost model).

Each engine also runs one pipeline schedule family and certain ZeRO stages; a job asking for something else
is refused with an ``InputError`` naming the engine and the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnibal.errors import InputError
from omnibal.layout import Engine, PipelineSchedule

"""``reference``: no engine constraint (omnibal's reference trainer, or any engine that can express any plan)."""

RECOMPUTE_POLICIES = ("per-layer", "count", "all-or-none")
"""per-layer: any layer of any stage; count: the first ``n_vision`` vision blocks and the first ``n_llm`` LLM
blocks of every stage (one pair of counts for the whole job); all-or-none: every block or none."""

CHECKPOINTABLE_BLOCKS = ("vision_block", "llm_block")
"""Layer kinds Megatron and torchtitan recompute (transformer blocks; never embeddings, projector, head)."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine's limits."""

    name: str
    vision_on_first_stage: bool
    """Stage 0 must hold the vision encoder, the projector and the LLM embedding whole."""
    recompute: str
    """One of RECOMPUTE_POLICIES."""
    pp_schedules: tuple[str, ...]
    """Pipeline schedules the engine runs (omnibal names: ``1f1b``, ``gpipe``)."""
    zero_stages: tuple[int, ...]
    """ZeRO stages over DP the engine offers with pipeline parallelism."""
    default_zero_stage: int
    """What ``omnibal plan --engine NAME`` uses without ``--zero-stage``."""
    selective: bool
    """Whether the planner may choose selective recompute per block (``omnibal.train.recompute``)."""
    notes: dict
    """Field -> why the engine refuses other values (for error messages)."""


ENGINE_SPECS: dict[str, EngineSpec] = {
    "reference": EngineSpec("reference", False, "per-layer", tuple(PipelineSchedule), (0, 1, 2, 3), 1, True, {}),
    "deepspeed": EngineSpec(
        "deepspeed", False, "per-layer", ("1f1b",), (0, 1), 1, False,
        {"pp_schedule": "DeepSpeed's PipelineEngine runs its own 1F1B TrainSchedule only",
         "selective": "DeepSpeed's activation checkpointing recomputes whole layers only",
         "zero_stage": "DeepSpeed refuses ZeRO-2/3 with pipeline parallelism"}),
    "megatron": EngineSpec(
        "megatron", True, "count", ("1f1b",), (0, 1), 1, False,
        {"selective": "Megatron-core's selective recompute applies one module list (core_attn, layernorm, "
                      "mlp) to every layer and cannot keep the matrix-product outputs while recomputing the "
                      "MLP activation",
         "pp_schedule": "Megatron-core's pipeline schedule is 1F1B (forward_backward_pipelining_without_interleaving)",
         "zero_stage": "Megatron's distributed optimizer shards optimizer state only (ZeRO-1)"}),
    "torchtitan": EngineSpec(
        "torchtitan", True, "all-or-none", ("1f1b", "gpipe"), (0, 2, 3), 2, False,
        {"selective": "torchtitan's op-level selective AC applies to every block; omnibal plans it per block "
                      "only for its own trainer",
         "zero_stage": "torchtitan shards with FSDP2: ZeRO-2-like with fsdp_reshard_after_forward='never' "
                       "(use 2), ZeRO-3-like with 'always' (use 3), or plain replication (use 0); "
                       "optimizer-only sharding (ZeRO-1) does not exist there"}),
}


def get_engine(name: str) -> EngineSpec:
    try:
        return ENGINE_SPECS[name]
    except (KeyError, TypeError):
        raise InputError(f"unknown engine {name!r}; choose one of {', '.join(Engine)}", source="--engine",
                         field="engine") from None


def check_job(engine: str, *, pp_schedule: str, zero_stage: int, selective: bool | None = None) -> None:
    """Refuse job settings the engine cannot run (one line naming the engine and the field)."""
    spec = get_engine(engine)
    if selective and not spec.selective:
        raise InputError(f"selective recompute cannot be expressed ({spec.notes.get('selective', '')}); plan "
                         "without --selective-recompute", source=engine, field="selective")
    if pp_schedule not in spec.pp_schedules:
        raise InputError(f"pp schedule {pp_schedule!r} cannot be expressed ({spec.notes.get('pp_schedule', '')}); "
                         f"use --pp-schedule {' or '.join(spec.pp_schedules)}", source=engine, field="pp_schedule")
    if zero_stage not in spec.zero_stages:
        raise InputError(f"ZeRO stage {zero_stage} cannot be expressed ({spec.notes.get('zero_stage', '')}); use "
                         f"--zero-stage {' or '.join(map(str, spec.zero_stages))}", source=engine,
                         field="zero_stage")


@dataclass(frozen=True)
class Constraints:
    """What the planner must respect: built from an engine, or from one of its constraints alone (the
    ablation prices each constraint separately)."""

    first_stage_min_stop: int | None = None
    """Stage 0 holds at least layers ``[0, this)`` (None: no constraint)."""
    recompute: str = "per-layer"
    """One of RECOMPUTE_POLICIES."""

    @property
    def unconstrained(self) -> bool:
        return self.first_stage_min_stop is None and self.recompute == "per-layer"


def first_llm_block(kinds) -> int:
    """Index of the first LLM block: the vision encoder, projector and LLM embedding come before it."""
    for i, kind in enumerate(kinds):
        if kind in ("llm_block", "lm_head"):
            return i
    return len(kinds)


def engine_constraints(engine: str, kinds, *, which: tuple[str, ...] = ("first-stage", "recompute")) -> Constraints:
    """The engine's constraints on the chain with layer ``kinds``; ``which`` keeps only some of them."""
    spec = get_engine(engine)
    stop = first_llm_block(kinds) if spec.vision_on_first_stage and "first-stage" in which else None
    policy = spec.recompute if "recompute" in which else "per-layer"
    return Constraints(first_stage_min_stop=stop, recompute=policy)


def constraint_rows(engine: str) -> list[tuple[str, tuple[str, ...]]]:
    """(row label, constraints kept) for the ablation: each constraint alone, then all together."""
    spec = get_engine(engine)
    parts = []
    if spec.vision_on_first_stage:
        parts.append(("vision encoder on stage 0", ("first-stage",)))
    if spec.recompute == "count":
        parts.append(("one recompute count for all stages", ("recompute",)))
    elif spec.recompute == "all-or-none":
        parts.append(("one AC mode (none / full) for all blocks", ("recompute",)))
    if len(parts) < 2:
        return [(f"{engine}: {label}", keep) for label, keep in parts]
    rows = [(f"{engine}: {label} only", keep) for label, keep in parts]
    rows.append((f"{engine}: all constraints (the plan)", ("first-stage", "recompute")))
    return rows
