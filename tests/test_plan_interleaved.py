"""Interleaved 1F1B in the planner: in-flight counts read off the schedule, budget shares per virtual stage,
the interleaved candidates the simulator checks, and the plan's JSON form."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import numpy as np
import pytest

from dist_helpers import interleaved_tiny_plan
from omnibal.errors import InputError
from omnibal.plan.interleaved import best_interleaved, budget_shares, interleaved_candidates, interleaved_config
from omnibal.plan.joint import JointPlanner
from omnibal.plan.plan import Plan
from omnibal.plan.stages import StageModelConfig, chunk_in_flight, layer_quantities
from omnibal.sim.costs import SimConfig
from omnibal.sim.epoch import score_plan
from omnibal.sim.pipeline_order import inflight_masks, peak_inflight
from plan_helpers import uniform_features, vlm_like_table


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 16, 2), (4, 8, 3), (3, 9, 4)])
def test_chunk_in_flight_is_what_the_schedule_holds(p, m, v):
    counts = chunk_in_flight(p, m, v)
    assert len(counts) == p * v
    for d, mask in enumerate(inflight_masks("interleaved", p, m, v)):
        per_chunk = mask.reshape(len(mask), m, v).sum(axis=1)  # [ops, chunk]: held per chunk at every op
        assert [counts[c * p + d] for c in range(v)] == per_chunk.max(axis=0).astype(int).tolist()
    # the chunks' peaks bound the device's from above, and device 0 holds more than plain 1F1B's P
    device = [sum(counts[c * p + d] for c in range(v)) for d in range(p)]
    assert all(a >= b for a, b in zip(device, peak_inflight("interleaved", p, m, v)))
    assert device[0] > p


def _small(budget: float | None):
    table = vlm_like_table(num_vision=6, num_llm=8)
    feats = uniform_features(num=8)
    cfg = StageModelConfig(num_stages=2, num_microbatches=8, memory_budget_bytes=budget, dp_size=1)
    return table, feats, cfg


def test_shares_bound_every_virtual_stage():
    table, feats, cfg = _small(None)
    vcfg = interleaved_config(cfg, 2)
    roomy = JointPlanner(layer_quantities(table, feats, vcfg), vcfg).plan()
    budget = 0.8 * max(st.memory_bytes for st in roomy.stages) * 2  # the device's, shared by two chunks
    vcfg = replace(vcfg, memory_budget_bytes=budget)
    vcfg = replace(vcfg, budget_shares=budget_shares(vcfg, [1.0, 1.2]))
    assert vcfg.budget_shares == (0.5, 0.6, 0.5, 0.6)
    plan = JointPlanner(layer_quantities(table, feats, vcfg), vcfg).plan()
    assert plan.num_stages == 4
    for st in plan.stages:
        assert st.memory_bytes <= vcfg.stage_budget(st.stage) * (1 + 1e-9)
        assert st.in_flight == chunk_in_flight(2, 8, 2)[st.stage]
    with pytest.raises(InputError, match="one share in"):
        replace(vcfg, budget_shares=(0.5,)).validate(table.num_layers)


def test_candidates_are_scored_and_the_winner_fits_the_simulated_memory():
    table, feats, cfg = _small(None)
    sim = SimConfig(dp_size=1)
    steps = np.broadcast_to(feats, (3, 1) + feats.shape)
    plain = score_plan(table, (0, 9, table.num_layers), None, steps, sim)
    budget = 0.9 * max(plain.peak_memory)  # tight: interleaving holds more in flight, so it must recompute
    cfg = replace(cfg, memory_budget_bytes=budget)
    sim = replace(sim, memory_budget_bytes=budget)

    def score(sp, v):
        s = score_plan(table, sp.parts, sp.recompute_mask(table.num_layers), steps,
                       replace(sim, pp_schedule="interleaved", num_chunks=v))
        return s.step_time_mean, s.oom, s.peak_memory

    cands = interleaved_candidates(table, feats, cfg, score, (1, 2))
    assert cands and all(c.num_chunks == 2 and len(c.candidate.plan.parts) == 5 for c in cands)
    assert cands[0].slack == (1.0, 1.0)
    best = best_interleaved(cands)
    assert best is not None and not best.candidate.oom
    assert all(best.candidate.sim_step_time <= c.candidate.sim_step_time for c in cands if not c.candidate.oom)


def test_an_interleaved_plan_round_trips_and_is_checked(tmp_path):
    path = interleaved_tiny_plan(tmp_path / "plan.json")
    plan = Plan.load(path)
    assert plan.inputs.num_chunks == 2 and len(plan.stages) == 4 and plan.pp_schedule == "interleaved"
    assert [plan.device_of(s) for s in range(4)] == [0, 1, 0, 1]
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    short = dataclasses.replace(plan, stages=plan.stages[:2])
    with pytest.raises(InputError, match=r"2 stages but pp_size is 2 x 2 chunks"):
        Plan.from_json(short.to_json())
    raw = json.loads(plan.to_json())
    raw["inputs"]["num_chunks"] = 0
    with pytest.raises(InputError, match="inputs.num_chunks"):
        Plan.from_json(json.dumps(raw))
