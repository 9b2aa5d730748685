"""torchtitan (installed by .ci/run, 0.3.0) accepts ``omnibal plan --engine torchtitan``'s TOML fragment: its
own ``ParallelismConfig`` and activation-checkpointing config take the fields, and its pipeline splitter
(``_split_module``, what ``pipeline_vlm`` runs) keeps every parameter of a real torchtitan VLM (Kimi, built on
the meta device with the plan's number of decoder layers) on the planned stage."""

from __future__ import annotations

import dataclasses

import pytest

from omnibal.errors import InputError
from omnibal.plan.exports import kind_of

pytest.importorskip("torchtitan", reason="torchtitan is not installed (CI installs it: .ci/run; "
                                         "docs/engines/torchtitan.md)")

from test_engine_plans import engine_plan  # noqa: E402  (one cached plan per preset and engine)


def _kimi(num_layers: int, num_vision_layers: int | None = None):
    """torchtitan's Kimi VLM (vision_encoder + tok_embeddings + layers + norm + lm_head) with ``num_layers``
    decoder layers and ``num_vision_layers`` in its vision encoder (None: the debug model's 4), on the meta
    device (no memory, no weights)."""
    pytest.importorskip("triton", reason="torchtitan's models import triton (CI installs it: .ci/run)")
    import torch
    from torchtitan.models import kimi_k2_7

    cfg = kimi_k2_7._debugmodel("flex", "standard")
    layers = [cfg.layers[min(i, len(cfg.layers) - 1)] for i in range(num_layers)]
    cfg = dataclasses.replace(cfg, layers=layers)
    if num_vision_layers is not None:
        cfg = dataclasses.replace(cfg, vision_encoder=dataclasses.replace(cfg.vision_encoder,
                                                                          num_layers=num_vision_layers))
    with torch.device("meta"):
        return cfg.build()


@pytest.mark.parametrize("preset", ["internvl-chat-1.5", "llava-1.5-7b"])
def test_torchtitan_accepts_the_fragment_and_splits_every_parameter_onto_its_stage(preset, tmp_path):
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.distributed.pipeline_parallel import _split_module

    from omnibal.integrations.torchtitan import (
        activation_checkpoint_config,
        check_model,
        load_fragment,
        parallelism_config,
        write_exports,
    )

    plan = engine_plan(preset, "torchtitan").plan
    fragment = load_fragment(write_exports(plan, tmp_path)[0])
    par = parallelism_config(fragment)
    assert isinstance(par, ParallelismConfig) and par.pipeline_parallel_degree == len(plan.stages)
    assert TrainingConfig(**fragment["training"]).local_batch_size == plan.inputs.layout.num_microbatches
    ac = activation_checkpoint_config(fragment)
    assert (ac is None) == (not plan.recompute_modules()) and (ac is None or isinstance(ac, FullAC.Config))
    num_layers = sum(kind_of(m) == "llm_block" for st in plan.stages for m in st.modules)
    model = _kimi(num_layers, sum(kind_of(m) == "vision_block" for st in plan.stages for m in st.modules))
    check_model(model, fragment)
    everything = {n for n, _ in model.named_parameters()}
    owner: dict[str, int] = {}
    for s, (st, fqns) in enumerate(zip(plan.stages, par.module_fqns_per_model_part)):
        chunk = _split_module(model, fqns)
        names = {n for n, _ in chunk.named_parameters()}
        llm = [int(m.rsplit(".", 1)[1]) for m in st.modules if kind_of(m) == "llm_block"]
        for name in names:
            assert name not in owner, f"{name} on stages {owner[name]} and {s}"
            owner[name] = s
            top = name.split(".")[0]
            if top == "layers":  # torchtitan keeps layer keys, so layers.N is decoder layer N
                assert int(name.split(".")[1]) in llm, (name, s)
            elif top in ("vision_encoder", "tok_embeddings"):
                assert s == 0, (name, s)
            else:
                assert top in ("norm", "lm_head") and s == len(plan.stages) - 1, (name, s)
    assert set(owner) == everything, "every parameter lands on exactly one stage"


def test_a_fragment_for_another_model_or_layout_is_refused(tmp_path):
    from doc_snippets import write_tiny_exports
    from omnibal.integrations.torchtitan import check_model, load_fragment, parallelism_config, write_exports

    with pytest.raises(InputError, match=r"^torchtitan: field 'module_fqns_per_model_part': stage 1 holds vision"):
        write_exports(engine_plan("internvl-chat-1.5", "deepspeed").plan, tmp_path)  # ViT split over stages
    fragment = load_fragment(write_exports(engine_plan("llava-1.5-7b", "torchtitan").plan, tmp_path)[0])
    with pytest.raises(InputError, match=r"^torchtitan: field 'module_fqns_per_model_part': the fragment names 32"):
        check_model(_kimi(6), fragment)
    tiny = load_fragment(write_tiny_exports("torchtitan", tmp_path)[0])
    check_model(_kimi(6, 5), tiny)
    with pytest.raises(InputError, match=r"^torchtitan: field 'vision_encoder.layers': the fragment was planned for "
                                         r"5 vision layers, the model's vision_encoder has 4$"):
        check_model(_kimi(6), tiny)  # the debug model's 4 vision layers
    with pytest.raises(InputError, match=r"^torchtitan: field 'omnibal-chain': no '# omnibal-chain:"):
        check_model(_kimi(6, 5), {k: v for k, v in tiny.items() if k != "omnibal"})
    bad = {**fragment, "parallelism": {**fragment["parallelism"], "module_names_per_stage": [["x"]]}}
    with pytest.raises(InputError, match=r"^torchtitan: field 'parallelism': torchtitan refused"):
        parallelism_config(bad)


def test_the_docs_snippet_runs_as_written(tmp_path):
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.pipeline_parallel import _split_module

    from doc_snippets import TINY, run_snippet, write_tiny_exports
    from omnibal.integrations.torchtitan import load_fragment

    @dataclasses.dataclass
    class JobConfig:  # the Trainer.Config fields the fragment sets (torchtitan.trainer imports torchdata, tensorboard)
        parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
        activation_checkpoint: object = None
        training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)

    fragment = load_fragment(write_tiny_exports("torchtitan", tmp_path)[0])
    model = _kimi(TINY["decoder_layers"], TINY["vision_layers"])
    config = run_snippet("torchtitan", tmp_path, model=model, my_config_fn=JobConfig)["config"]
    assert isinstance(config, JobConfig) and isinstance(config.parallelism, ParallelismConfig)
    assert config.parallelism.pipeline_parallel_degree == 2
    assert config.training.local_batch_size == fragment["training"]["local_batch_size"] == 4
    assert config.activation_checkpoint is None or type(config.activation_checkpoint).__name__ == "Config"
    owner: dict[str, int] = {}
    for s, fqns in enumerate(config.parallelism.module_fqns_per_model_part):
        for name, _ in _split_module(model, fqns).named_parameters():
            assert owner.setdefault(name, s) == s, name
    assert set(owner) == {n for n, _ in model.named_parameters()}


def test_a_zero3_plan_becomes_fsdp_resharding_after_every_forward(tmp_path):
    from torchtitan.config import ParallelismConfig

    from omnibal.integrations.torchtitan import load_fragment, parallelism_config, write_exports
    from omnibal.jobs.plan_config import PlanJobConfig
    from omnibal.jobs.plan_job import run_plan_job
    from omnibal.layout import Layout
    from omnibal.plan.search import SearchConfig

    plan = run_plan_job(PlanJobConfig(engine="torchtitan", num_gpus=64,
                                      layout=Layout(dp_size=64, pp_size=1, zero_stage=3, num_microbatches=1),
                                      num_samples=20_000, balance_samples=None,
                                      search=SearchConfig(radius=1, top_k=2, sample_steps=16))).plan
    par = parallelism_config(load_fragment(write_exports(plan, tmp_path)[0]))
    assert isinstance(par, ParallelismConfig)
    assert (par.data_parallel_shard_degree, par.data_parallel_replicate_degree) == (64, 1)
    assert par.fsdp_reshard_after_forward == "always" and par.pipeline_parallel_degree == 1
