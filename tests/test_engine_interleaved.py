"""An interleaved plan (several model chunks per pipeline rank) in the installed engines: megatron-core's own
layout parser and ``TransformerConfig`` take the ``P x chunks`` layout and build the planned decoder layers on
each virtual stage; torchtitan's ``Interleaved1F1B`` puts part ``c * P + d`` on rank ``d`` (omnibal's virtual
stage order) and its splitter keeps every parameter on its planned part; DeepSpeed, which has no interleaved
schedule, refuses the plan in one line naming itself."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from omnibal.cost.spec import even_cuts
from omnibal.errors import InputError
from omnibal.plan.exports import kind_of
from omnibal.plan.plan import PlanStage

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

from test_engine_plans import engine_plan  # noqa: E402  (one cached plan per preset and engine)

CHUNKS = 2


def interleaved(plan, chunks: int = CHUNKS):
    """``plan`` (vision encoder on stage 0) re-cut into ``pp x chunks`` virtual stages: the vision encoder,
    projector and embedding with the first LLM blocks, the blocks split evenly, the head on the last; no
    recompute (what the engines take from an interleaved plan is the layout)."""
    names = [m for st in plan.stages for m in st.modules]
    blocks = [k for k, m in enumerate(names) if kind_of(m) == "llm_block"]
    num_virtual = plan.inputs.layout.pp_size * chunks
    inner = list(even_cuts(len(blocks), num_virtual)[1:-1])
    inner[0] += 1  # uneven, so that a stage read in the wrong order shows
    cuts = [0] + [blocks[c] for c in inner] + [len(names)]
    stages = tuple(PlanStage(stage=s, layers=(a, b), modules=tuple(names[a:b]), recompute=(), in_flight=1,
                             compute_time_s=0.0, boundary_time_s=0.0, recompute_time_s=0.0, memory_bytes=0.0)
                   for s, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])))
    return dataclasses.replace(plan, stages=stages, inputs=dataclasses.replace(plan.inputs, num_chunks=chunks),
                               search={**plan.search, "pp_schedule": "interleaved", "num_chunks": chunks})


def test_megatron_builds_every_virtual_stage_of_an_interleaved_plan(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (CI installs it: .ci/run)")
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from omnibal.integrations.megatron import load_export, stage_layer_counts, transformer_configs, write_exports

    plan = interleaved(engine_plan("llava-1.5-7b", "megatron").plan)
    export = load_export(write_exports(plan, tmp_path)[0])
    layout_text = export["language"]["pipeline_model_parallel_layout"]
    assert layout_text.count("|") == len(plan.stages) - 1 == plan.inputs.layout.pp_size * CHUNKS - 1
    language, _ = transformer_configs(export)
    assert language.virtual_pipeline_model_parallel_size == CHUNKS
    planned = [sum(kind_of(m) == "llm_block" for m in st.modules) for st in plan.stages]
    assert stage_layer_counts(language) == planned
    layout = PipelineParallelLayerLayout.from_str(layout_text, plan.inputs.layout.pp_size)
    assert layout.virtual_pipeline_model_parallel_size == CHUNKS
    assert len(set(planned)) > 1
    for s in range(len(plan.stages)):  # Megatron's chunk c of rank d is the plan's virtual stage c*P+d
        c, d = divmod(s, plan.inputs.layout.pp_size)
        assert sum(kind == LayerType.decoder for kind in layout.layout[d][c]) == planned[s]


def test_torchtitan_runs_an_interleaved_plan_part_by_part(tmp_path):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (CI installs it: .ci/run)")
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping, _split_module

    from omnibal.integrations.torchtitan import check_model, load_fragment, parallelism_config, write_exports
    from test_engine_torchtitan import _kimi

    plan = interleaved(engine_plan("llava-1.5-7b", "torchtitan").plan)
    fragment = load_fragment(write_exports(plan, tmp_path)[0])
    par = parallelism_config(fragment)
    pp, parts = par.pipeline_parallel_degree, par.module_fqns_per_model_part
    assert pp == plan.inputs.layout.pp_size and len(parts) == pp * CHUNKS
    assert issubclass(get_schedule_class(par.pipeline_parallel_schedule), PipelineScheduleMulti)
    for d in range(pp):
        assert _get_pp_rank_to_stage_indices_mapping(d, pp, par.pipeline_parallel_schedule, len(parts)) == \
            tuple(c * pp + d for c in range(CHUNKS))
    model = _kimi(sum(kind_of(m) == "llm_block" for st in plan.stages for m in st.modules),
                  sum(kind_of(m) == "vision_block" for st in plan.stages for m in st.modules))
    check_model(model, fragment)
    owner: dict[str, int] = {}
    for s, (st, fqns) in enumerate(zip(plan.stages, parts)):
        llm = [int(m.rsplit(".", 1)[1]) for m in st.modules if kind_of(m) == "llm_block"]
        for name, _ in _split_module(model, fqns).named_parameters():
            assert name not in owner, f"{name} on parts {owner[name]} and {s}"
            owner[name] = s
            if name.startswith("layers."):
                assert int(name.split(".")[1]) in llm, (name, s)
    assert set(owner) == {n for n, _ in model.named_parameters()}


def test_deepspeed_refuses_an_interleaved_plan_by_name(tmp_path):
    from omnibal.integrations.deepspeed import write_exports

    plan = interleaved(engine_plan("llava-1.5-7b", "megatron").plan)
    with pytest.raises(InputError, match=r"^deepspeed: field 'pp_schedule': DeepSpeed's PipelineEngine runs 1F1B only "
                                         r"and has no interleaved schedule") as err:
        write_exports(plan, tmp_path)
    assert "\n" not in str(err.value)
