"""Engine-aware planning (``omnibal plan --engine``): constraints are planner inputs, the constrained optimum is
exact, each engine's rows price its constraints, and user errors name the engine and the field. The real
libraries check the exports in test_engine_{deepspeed,megatron,torchtitan}.py; this file needs none of them."""

from __future__ import annotations

import functools
import itertools
import json
from dataclasses import replace

import numpy as np
import pytest

from omnibal.cli import main
from omnibal.errors import InputError
from omnibal.jobs.plan_config import PLAN_LAYOUT, PlanJobConfig
from omnibal.jobs.plan_job import run_plan_job
from omnibal.plan.constrained import ConstrainedPlanner
from omnibal.plan.engines import Constraints, constraint_rows, engine_constraints
from omnibal.plan.exports import block_counts, engine_fields, kind_of
from omnibal.plan.joint import JointPlanner
from omnibal.plan.stages import StageModelConfig, layer_quantities, stage_memory
from plan_helpers import uniform_features, vlm_like_table

_CACHE: dict = {}
MEGATRON_DEFAULT_BUDGET = 77.0
"""The default job does not fit 76 GiB under Megatron's constraints (stage 0 needs 76.08 GiB, see
docs/engines/megatron.md); its tests plan it with 77 GiB."""


@functools.cache
def engine_plan(preset: str, engine: str):
    """``run_plan_job`` of the default job (or ``--model``) for ``engine``, as ``omnibal plan`` runs it."""
    kw = {"layout": replace(PLAN_LAYOUT, zero_stage=2)} if engine == "torchtitan" else {}
    if engine == "megatron" and preset == "internvl-chat-1.5":
        kw["memory_budget_gib"] = MEGATRON_DEFAULT_BUDGET
    return run_plan_job(PlanJobConfig(preset=preset, engine=engine, **kw), cache=_CACHE)


def _small(budget_scale: float, stages: int = 3):
    table = vlm_like_table()
    cfg = StageModelConfig(num_stages=stages, num_microbatches=6, dp_size=2)
    q = layer_quantities(table, uniform_features(), cfg)
    lo = ConstrainedPlanner(JointPlanner(q, cfg), Constraints(first_stage_min_stop=9, recompute="count")) \
        .smallest_budget()
    cfg = StageModelConfig(num_stages=stages, num_microbatches=6, dp_size=2, memory_budget_bytes=lo * budget_scale)
    return q, cfg, JointPlanner(layer_quantities(table, uniform_features(), cfg), cfg)


def _brute_force(q, cfg, constraints: Constraints):
    """Every partition x every (n_vision, n_llm) policy: the constrained min-max by enumeration."""
    cp = ConstrainedPlanner(JointPlanner(q, cfg), constraints)
    best = np.inf
    for cuts in itertools.combinations(range(1, q.num_layers), cfg.num_stages - 1):
        parts = (0, *cuts, q.num_layers)
        if constraints.first_stage_min_stop and parts[1] < constraints.first_stage_min_stop:
            continue
        for policy in cp.policies():
            sp = cp.with_policy(parts, policy)
            if sp is not None:
                best = min(best, sp.bottleneck)
    return best


@pytest.mark.parametrize("recompute", ["count", "all-or-none"])
@pytest.mark.parametrize("scale", [1.0, 1.15, 1.6])
def test_constrained_optimum_equals_brute_force(recompute, scale):
    q, cfg, planner = _small(scale)
    constraints = Constraints(first_stage_min_stop=9, recompute=recompute)
    cp = ConstrainedPlanner(planner, constraints)
    try:
        got = cp.plan().bottleneck
    except InputError:
        got = np.inf
    assert got == pytest.approx(_brute_force(q, cfg, constraints), rel=1e-9)


def test_constrained_plans_respect_the_constraints_and_memory():
    q, cfg, planner = _small(1.15)
    for recompute in ("per-layer", "count", "all-or-none"):
        sp = ConstrainedPlanner(planner, Constraints(first_stage_min_stop=9, recompute=recompute)).plan()
        assert sp.parts[1] >= 9
        for st in sp.stages:
            mask = np.zeros(st.stop - st.start, dtype=bool)
            mask[[c - st.start for c in st.checkpointed]] = True
            assert stage_memory(q, st.start, st.stop, st.in_flight, mask) <= cfg.memory_budget_bytes * (1 + 1e-9)
        # per-layer may do better, never worse than the stricter policies
    free = JointPlanner(q, cfg).plan().bottleneck
    pinned = ConstrainedPlanner(planner, Constraints(first_stage_min_stop=9)).plan().bottleneck
    counted = ConstrainedPlanner(planner, Constraints(first_stage_min_stop=9, recompute="count")).plan().bottleneck
    assert free <= pinned + 1e-12 <= counted + 2e-12


def test_too_small_a_budget_names_the_smallest_that_fits():
    q, cfg, planner = _small(0.999)
    with pytest.raises(InputError, match=r"field 'memory_budget_bytes'.*smallest budget that fits is"):
        ConstrainedPlanner(planner, Constraints(first_stage_min_stop=9, recompute="count")).plan()


@pytest.mark.parametrize("preset", ["internvl-chat-1.5", "llava-1.5-7b"])
@pytest.mark.parametrize("engine", ["megatron", "torchtitan"])
def test_engine_plans_obey_their_engine(preset, engine):
    result = engine_plan(preset, engine)
    plan = result.plan
    assert plan.engine == engine
    stop = engine_constraints(engine, [kind_of(m) for st in plan.stages for m in st.modules]).first_stage_min_stop
    assert plan.stages[0].layers[1] >= stop  # the whole vision encoder, projector and embedding on stage 0
    fields = engine_fields(plan, engine)  # expressible: no InputError
    if engine == "megatron":
        assert isinstance(fields["language"]["recompute_num_layers"], (int, type(None)))
        block_counts(plan, "llm_block", "megatron", "recompute_num_layers")
    else:
        assert fields["activation_checkpoint"]["mode"] in ("none", "full")
    names = [r.name for r in result.ablation]
    assert names[:4] == ["baseline", "+ data balance", "+ balanced partition", "+ adaptive recompute"]
    assert names[4:] == [label for label, _ in constraint_rows(engine)]
    free, constrained = result.ablation[3].gpu_days, result.ablation[-1].gpu_days
    assert constrained == pytest.approx(plan.prediction.gpu_days)
    assert constrained >= free * 0.98  # constraints cost time (up to the simulator's noise around the model)


def test_megatron_default_job_at_50_gib_is_a_one_line_engine_error():
    # the default job (data fitted to the published statistics) fits Megatron's vision-on-stage-0 layout at
    # 76 GiB; at 50 GiB it does not (stage 0 holds all of InternViT-6B: 33 GB of weights and fp32 gradients)
    with pytest.raises(InputError) as info:
        run_plan_job(PlanJobConfig(engine="megatron", memory_budget_gib=50), cache=_CACHE)
    msg = str(info.value)
    assert msg.startswith("megatron: field 'memory_budget_bytes'") and "\n" not in msg
    assert "smallest budget that fits is 51.88 GiB" in msg


def test_unconstrained_plan_is_not_expressible_in_megatron_or_torchtitan():
    plan = engine_plan("internvl-chat-1.5", "deepspeed").plan  # no constraint: the ViT spans stages 0-2
    assert plan.stages[1].modules[0].startswith("vision.blocks.")
    for engine, field in (("megatron", "pipeline_model_parallel_layout"), ("torchtitan", "module_fqns_per_model_part")):
        with pytest.raises(InputError, match=rf"^{engine}: field '{field}': stage 1 holds vision\.blocks\."):
            engine_fields(plan, engine)


@pytest.mark.parametrize("argv,match", [
    (["--engine", "megatron", "--pp-schedule", "gpipe"], "megatron: field 'pp_schedule'"),
    (["--engine", "torchtitan", "--zero-stage", "1"], "torchtitan: field 'zero_stage'"),
    (["--engine", "deepspeed", "--zero-stage", "2"], "deepspeed: field 'zero_stage'"),
])
def test_cli_refuses_what_the_engine_cannot_run(argv, match, capsys, tmp_path):
    assert main(["plan", "--quiet", "--out", str(tmp_path), *argv]) == 2
    assert match in capsys.readouterr().err


TINY = ["--model", "tiny", "--gpus", "4", "--pp", "2", "--microbatches", "4", "--samples", "3000",
        "--search-steps", "16", "--top-k", "3", "--quiet", "--no-timelines"]


@pytest.mark.parametrize("engine,files", [
    ("deepspeed", ["deepspeed.json", "ds_config.json"]),
    ("megatron", ["megatron.json", "megatron_args.txt"]),
    ("torchtitan", ["torchtitan.toml"]),
])
def test_cli_writes_the_engine_files(engine, files, tmp_path, capsys):
    assert main(["plan", *TINY, "--engine", engine, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{engine} export:" in out
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == sorted(files)
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["engine"] == engine and "not_expressible" not in doc["exports"][engine]
    if engine != "deepspeed":
        assert any(r["name"].startswith(f"{engine}:") for r in json.loads((tmp_path / "ablation.json").read_text())
                   ["rows"]), "the ablation prices the engine's constraints"
