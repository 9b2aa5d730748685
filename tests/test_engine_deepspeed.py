"""DeepSpeed (installed by .ci/run, deepspeed 0.19.8 built without ops) runs omnibal's plan: the stages hold
exactly the planned layers, the planned layers are recomputed, and ``train_batch`` on 2 gloo ranks gives the
unsplit model's loss, before and after an optimizer step."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

from omnibal.errors import InputError
from omnibal.jobs.plan_config import PLAN_LAYOUT, PlanJobConfig
from omnibal.jobs.plan_job import run_plan_job
from omnibal.layout import Layout
from omnibal.plan.search import SearchConfig

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (CI installs it: .ci/run; "
                                        "docs/engines/deepspeed.md)")

NUM_MB, NUM_TILES, NUM_TOKENS, STEPS, LR = 4, 8, 256, 2, 0.05
DS_OP_BUILD_TIMEOUT_S = 1800

_BUILD_COMM_OP = """
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None:
    builder.load()
"""


@pytest.fixture(scope="module", autouse=True)
def _deepspeed_comm_op_built():
    """DeepSpeed JIT-compiles its CPU shared-memory comm op when the first rank initialises, under a file lock
    in the torch extensions folder. Compiled inside a rank, it spends the rank's deadline (minutes on a cold
    cache and two slow cores), and a rank killed mid-build leaves the lock behind, so every later rank waits on
    it forever. Build it once here, in its own process and without a rank deadline; ranks then only load it."""
    import subprocess
    import sys

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, "-c", _BUILD_COMM_OP], env=env, capture_output=True, text=True,
                              timeout=DS_OP_BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        from torch.utils.cpp_extension import get_default_build_root

        pytest.fail(f"building DeepSpeed's CPU comm op took over {DS_OP_BUILD_TIMEOUT_S} s; a 'lock' file left "
                    f"by a killed build under {get_default_build_root()}/*/deepspeed_shm_comm/ makes it wait "
                    "forever: remove it and rerun")
    assert done.returncode == 0, f"building DeepSpeed's CPU comm op failed:\n{done.stderr[-4000:]}"


def _tiny_plan(**kw):
    base = dict(preset="tiny", num_gpus=2, layout=Layout(dp_size=1, pp_size=2, num_microbatches=NUM_MB),
                num_samples=3000, search=SearchConfig(radius=1, top_k=3, sample_steps=16), engine="deepspeed")
    base.update(kw)
    free = run_plan_job(PlanJobConfig(**base)).plan
    # a budget below the unconstrained peak, so the plan checkpoints some layers of stage 0 (at 0.8 the
    # planner now fits it by moving a layer instead: the balancer's token buffer no longer grows to its tail)
    budget = 0.7 * max(st.memory_bytes for st in free.stages) / 2**30
    return run_plan_job(PlanJobConfig(**base, memory_budget_gib=budget)).plan


def _micro_batches(spec):
    from train_helpers import pack, tiny_dataset

    ds = tiny_dataset(spec, tiles=[1, 2, 1, 3, 2, 1, 1, 2, 3, 1, 2, 1], tokens=[40, 50, 30, 60, 45, 20, 35, 44, 70, 25,
                                                                           38, 41], seed=3)
    samples = [ds[i] for i in range(len(ds))]
    return [pack(spec, samples[3 * m:3 * m + 3], num_tiles=NUM_TILES, num_tokens=NUM_TOKENS) for m in range(NUM_MB)]


def _unsplit_losses(spec) -> list[float]:
    from omnibal.train.model import VLM

    torch.manual_seed(0)
    model = VLM(spec, seed=0, attn_impl="varlen")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    mbs, out = _micro_batches(spec), []
    for _ in range(STEPS):
        opt.zero_grad()
        losses = [torch.div(*model(*mb.carry())) for mb in mbs]
        loss = torch.stack([x.reshape(()) for x in losses]).mean()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _rank(export_path: str) -> dict:
    import deepspeed

    from omnibal.cost.presets import get_model_preset
    from omnibal.integrations.deepspeed import load_export, pipeline_module
    from omnibal.train.model import VLM

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    export = load_export(export_path)
    spec = get_model_preset("tiny")
    model = VLM(spec, seed=0, attn_impl="varlen")
    names = [layer.name for layer, _ in model.chain()]
    calls = {n: 0 for n in names}
    for layer, module in model.chain():
        module.register_forward_pre_hook(lambda *_, n=layer.name: calls.__setitem__(n, calls[n] + 1))
    module = pipeline_module([m for _, m in model.chain()], export, star_args=True,
                             loss_fn=lambda out, labels: (out[0] / out[1]).reshape(()))
    # fp32 on CPU and no clipping (DeepSpeed clips to 1.0 by default) for an exact comparison; plain SGD (a
    # client optimizer) under ZeRO-1 needs the opt-in
    config = {**export["ds_config"], "bf16": {"enabled": False}, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True}
    params = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=params,
                                      optimizer=torch.optim.SGD(params, lr=LR))
    mbs = _micro_batches(spec)
    losses = []
    for _ in range(STEPS):
        data = iter([(mb.carry(), torch.zeros(1)) for mb in mbs])
        losses.append(float(engine.train_batch(data_iter=data)))
    stage = engine.stage_id
    owned = [n for n in names if any(p is q for p in module.parameters() for q in model.get_submodule(n).parameters())]
    return {"stage": stage, "losses": losses, "owned": owned, "calls": {n: calls[n] for n in owned}}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_train_batch_matches_the_unsplit_model_with_the_plans_parts_and_recompute(tmp_path):
    from omnibal.cost.presets import get_model_preset
    from omnibal.integrations.deepspeed import write_exports
    from omnibal.train.distributed import spawn_local

    plan = _tiny_plan()
    files = write_exports(plan, tmp_path / "exports")
    export = json.loads(files[0].read_text())
    config = json.loads(files[1].read_text())
    assert config["gradient_accumulation_steps"] == NUM_MB and config["zero_optimization"]["stage"] == 1
    assert any(export["recompute_layers_per_stage"]), "the budget must force some recompute"
    results = spawn_local(_rank, 2, args=(str(files[0]),), deadline_s=300,
                          env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    for r in results:
        assert r.error is None, r.error
    by_stage = {r.value["stage"]: r.value for r in results}
    expected = _unsplit_losses(get_model_preset("tiny"))
    for st in plan.stages:
        got = by_stage[st.stage]
        assert got["owned"] == list(st.modules), "each DeepSpeed stage holds exactly the planned layers"
        for name in st.modules:  # planned layers run twice per micro-batch (forward + recompute)
            assert got["calls"][name] == STEPS * NUM_MB * (2 if name in st.recompute else 1), name
    last = by_stage[len(plan.stages) - 1]["losses"]
    assert last == pytest.approx(expected, abs=1e-5, rel=1e-5)


def _build_rank(export_path: str) -> dict:
    """Build the plan's PipelineModule (one small Linear per chain layer) and report this rank's stage."""
    import deepspeed
    from deepspeed.pipe import LayerSpec

    from omnibal.integrations.deepspeed import StageBlock, load_export, pipeline_module

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    export = load_export(export_path)
    module = pipeline_module([LayerSpec(torch.nn.Linear, 2, 2) for _ in export["layer_names"]], export)
    blocks = [m for m in module.modules() if isinstance(m, StageBlock)]
    return {"stage": module.stage_id, "parts": list(module.parts), "layers": [len(b.layers) for b in blocks],
            "checkpointed": [sorted(b.checkpointed) for b in blocks]}


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset", ["internvl-chat-1.5", "llava-1.5-7b"])
def test_deepspeed_builds_the_planned_stages_of_the_default_job_and_llava(preset, tmp_path):
    from omnibal.integrations.deepspeed import write_exports
    from omnibal.train.distributed import spawn_local
    from test_engine_plans import engine_plan

    plan = engine_plan(preset, "deepspeed").plan
    path = write_exports(plan, tmp_path)[0]
    results = spawn_local(_build_rank, len(plan.stages), args=(str(path),), deadline_s=300,
                          env={"OMP_NUM_THREADS": "1"})
    for r in results:
        assert r.error is None, r.error
    for r in sorted((r.value for r in results), key=lambda v: v["stage"]):
        st = plan.stages[r["stage"]]
        assert r["parts"] == list(range(len(plan.stages) + 1))  # one stage block per rank: the plan's parts
        assert r["layers"] == [st.layers[1] - st.layers[0]]
        assert r["checkpointed"] == [sorted(st.modules.index(m) for m in st.recompute)]


def test_a_chain_of_another_model_is_refused(tmp_path):
    from omnibal.integrations.deepspeed import load_export, stage_specs, write_exports

    plan = run_plan_job(PlanJobConfig(preset="tiny", num_gpus=2,
                                      layout=Layout(dp_size=1, pp_size=2, num_microbatches=NUM_MB),
                                      num_samples=2000, search=SearchConfig(radius=1, top_k=2, sample_steps=8),
                                      engine="deepspeed")).plan
    export = load_export(write_exports(plan, tmp_path)[0])
    with pytest.raises(InputError, match=r"deepspeed: field 'parts': 3 layers given but the plan's chain has 15"):
        stage_specs([torch.nn.Identity()] * 3, export)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**export, "parts": [0, 9, 4, 15]}))
    with pytest.raises(InputError, match="deepspeed: field 'parts'"):
        load_export(bad)


def _snippet_rank(folder: str) -> dict:
    """docs/engines/deepspeed.md's snippet, as written, on this rank: a chain of small linear layers as long as
    the plan's, the exported ds_config (bf16, ZeRO-1)."""
    from pathlib import Path

    from doc_snippets import TINY, run_snippet

    torch.set_num_threads(1)
    names = json.loads((Path(folder) / "omnibal-out" / "exports" / "deepspeed.json").read_text())["layer_names"]
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in names]
    batches = [(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 8)) for _ in range(NUM_MB)]  # bf16 job
    ns = run_snippet("deepspeed", Path(folder), layers=layers, data_iter=iter(batches),
                     loss_fn=lambda out, target: (out.float() - target).pow(2).mean(),
                     num_layers=TINY["decoder_layers"], num_vision_layers=TINY["vision_layers"])
    engine = ns["engine"]
    return {"stage": engine.stage_id, "loss": float(ns["loss"]), "steps": engine.global_steps,
            "optimizer": type(ns["optimizer"]).__name__, "bf16": engine.bfloat16_enabled(),
            "zero": engine.zero_optimization_stage()}


@pytest.mark.multiprocess
def test_the_docs_snippet_runs_as_written_on_two_ranks(tmp_path):
    from doc_snippets import write_tiny_exports
    from omnibal.integrations.deepspeed import check_model, load_export
    from omnibal.train.distributed import spawn_local

    path = write_tiny_exports("deepspeed", tmp_path)[0]
    results = spawn_local(_snippet_rank, 2, args=(str(tmp_path),), deadline_s=240,
                          env={"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}, start_method="fork")
    for r in results:
        assert r.error is None, r.error
    values = sorted((r.value for r in results), key=lambda v: v["stage"])
    assert [v["stage"] for v in values] == [0, 1]
    for v in values:
        assert v["steps"] == 1 and v["optimizer"] == "AdamW" and v["bf16"] and v["zero"] == 1
        assert v["loss"] == values[-1]["loss"] and v["loss"] == v["loss"] and v["loss"] > 0  # one finite loss
    export = load_export(path)
    with pytest.raises(InputError, match=r"^deepspeed: field 'layer_names': the plan \(tiny\) has 6 decoder layers, "
                                         r"the model 4"):
        check_model(export, num_layers=4)
    with pytest.raises(InputError, match=r"^deepspeed: field 'layer_names': the plan \(tiny\) has 5 vision layers, "
                                         r"the model 4"):
        check_model(export, num_layers=6, num_vision_layers=4)


def test_engine_refuses_what_deepspeed_cannot_run():
    for kw, field in (({"pp_schedule": "gpipe"}, "pp_schedule"),
                      ({"layout": replace(PLAN_LAYOUT, zero_stage=2)}, "zero_stage")):
        with pytest.raises(InputError, match=rf"^deepspeed: field '{field}'"):
            PlanJobConfig(engine="deepspeed", **kw).validate()
    assert os.environ.get("DS_BUILD_OPS") in (None, "0", "")
