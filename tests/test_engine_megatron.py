"""megatron-core (installed by .ci/run, 0.16.1) accepts ``omnibal plan --engine megatron``'s export: its own
``TransformerConfig`` and layout parser take the language and vision configs, the layout builds exactly the
planned decoder layers per stage, and ``recompute_num_layers`` is the one int Megatron uses on every stage."""

from __future__ import annotations

import json
import warnings

import pytest

from omnibal.errors import InputError
from omnibal.plan.exports import kind_of

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (CI installs it: .ci/run; "
                                            "docs/engines/megatron.md)")

from test_engine_plans import engine_plan  # noqa: E402  (one cached plan per preset and engine)


@pytest.mark.parametrize("preset", ["internvl-chat-1.5", "llava-1.5-7b"])
def test_megatron_core_accepts_the_export_and_builds_the_planned_stages(preset, tmp_path):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from omnibal.integrations.megatron import load_export, stage_layer_counts, transformer_configs, write_exports

    plan = engine_plan(preset, "megatron").plan
    files = write_exports(plan, tmp_path)
    export = load_export(files[0])
    language, vision = transformer_configs(export)
    planned = [sum(kind_of(m) == "llm_block" for m in st.modules) for st in plan.stages]
    assert stage_layer_counts(language) == planned
    # the string itself through Megatron's own parser, as Megatron-LM's --pipeline-model-parallel-layout
    layout = PipelineParallelLayerLayout.from_str(export["language"]["pipeline_model_parallel_layout"], len(planned))
    assert [layout.get_num_layers_to_build(pp_rank=r) for r in range(len(planned))] == planned
    assert [layout.get_layer_offset(pp_rank=r) for r in range(len(planned))] == [sum(planned[:r])
                                                                                 for r in range(len(planned))]
    # one int for every stage, and block recompute of the first N decoder layers reproduces the plan
    n = language.recompute_num_layers
    assert n is None or isinstance(n, int)
    for st, count in zip(plan.stages, planned):
        llm_ckpt = [m for m in st.recompute if kind_of(m) == "llm_block"]
        assert len(llm_ckpt) == (min(n, count) if n else 0)
    vision_ckpt = [m for m in plan.stages[0].recompute if kind_of(m) == "vision_block"]
    assert vision.num_layers == sum(kind_of(m) == "vision_block" for m in plan.stages[0].modules)
    assert len(vision_ckpt) == (vision.recompute_num_layers or 0)
    assert language.num_layers == sum(planned)
    args = files[1].read_text().split()
    assert f"--pipeline-model-parallel-layout={export['language']['pipeline_model_parallel_layout']}" in args
    assert json.loads(files[0].read_text())["engine"] == "megatron"


def test_a_plan_megatron_cannot_express_is_refused_with_engine_and_field(tmp_path):
    import dataclasses

    from omnibal.integrations.megatron import write_exports

    with pytest.raises(InputError, match=r"^megatron: field 'pipeline_model_parallel_layout': stage 1 holds vision"):
        write_exports(engine_plan("internvl-chat-1.5", "deepspeed").plan, tmp_path)  # ViT split over stages
    plan = engine_plan("llava-1.5-7b", "megatron").plan
    last = plan.stages[-1]
    uneven = dataclasses.replace(last, recompute=tuple(m for m in last.modules[:2] if kind_of(m) == "llm_block"))
    odd = dataclasses.replace(plan, stages=(*plan.stages[:-1], uneven))
    with pytest.raises(InputError, match=r"^megatron: field 'recompute_num_layers': stage \d+ checkpoints"):
        write_exports(odd, tmp_path)


def test_an_export_for_another_model_is_refused(tmp_path):
    from omnibal.integrations.megatron import check_model, load_export, transformer_configs, write_exports

    export = load_export(write_exports(engine_plan("llava-1.5-7b", "megatron").plan, tmp_path)[0])
    check_model(export, num_layers=32, num_vision_layers=23)
    with pytest.raises(InputError, match=r"^megatron: field 'num_layers': the plan \(llava-1\.5-7b\) has 32"):
        check_model(export, num_layers=48)
    broken = {**export, "language": {**export["language"], "pipeline_model_parallel_layout": "Et*32|VL"}}
    with pytest.raises(InputError, match=r"^megatron: field 'language': megatron-core refused"):
        transformer_configs(broken)


def _snippet_rank(folder: str) -> dict:
    """docs/engines/megatron.md's snippet, as written, on this rank; what its stage holds."""
    from pathlib import Path

    import torch

    from doc_snippets import TINY, run_snippet

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    ns = run_snippet("megatron", Path(folder), num_layers=TINY["decoder_layers"],
                     num_vision_layers=TINY["vision_layers"], vocab_size=256, max_length=128)
    stage = ns["stage"]
    out = {"rank": torch.distributed.get_rank(), "layers": [layer.layer_number for layer in stage.decoder.layers],
           "embedding": hasattr(stage, "embedding"), "head": hasattr(stage, "output_layer"),
           "counts": ns["stage_layer_counts"](ns["language"])}
    ns["parallel_state"].destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return out


@pytest.mark.multiprocess
def test_the_docs_snippet_builds_the_planned_stages_as_written(tmp_path):
    from doc_snippets import write_tiny_exports
    from omnibal.integrations.megatron import check_model, load_export
    from omnibal.train.distributed import spawn_local

    export = load_export(write_tiny_exports("megatron", tmp_path)[0])
    assert export["language"]["pipeline_model_parallel_layout"] == "Et|t*5L"
    results = spawn_local(_snippet_rank, 2, args=(str(tmp_path),), deadline_s=180, env={"OMP_NUM_THREADS": "1"},
                          start_method="fork")
    for r in results:
        assert r.error is None, r.error
    first, last = sorted((r.value for r in results), key=lambda v: v["rank"])
    assert first["counts"] == last["counts"] == [1, 5]
    assert (first["layers"], first["embedding"], first["head"]) == ([1], True, False)
    assert (last["layers"], last["embedding"], last["head"]) == ([2, 3, 4, 5, 6], False, True)
    with pytest.raises(InputError, match=r"^megatron: field 'vision.num_layers': the plan has 5 vision layers, the "
                                         r"model 4"):
        check_model(export, num_layers=6, num_vision_layers=4)
