"""HBP on short-only data: the SP degree of a level is chosen by the simulator, the plain ``omnibal plan``
packing competes as a single level, and the bound on HBP's gain is consistent with the result."""

from __future__ import annotations

import pytest

from omnibal.hbp.bound import long_share
from omnibal.hbp.planning import HBPPlanConfig
from omnibal.jobs.hbp import PLAIN, run_hbp_job
from omnibal.jobs.plan_config import PlanJobConfig
from omnibal.jobs.plan_job import run_plan_job
from omnibal.layout import Layout
from omnibal.stats.synthetic import synthetic_internvl_mixture
from omnibal.stats.table import SampleStats

# the case in small: on short InternVL-like data the estimate gives the single level SP 2, slower in the
# simulator than SP 1 (twice the steps, each with its gradient reduction and optimizer step)
JOB = PlanJobConfig(preset="internvl2-8b", layout=Layout(dp_size=16, pp_size=1, num_microbatches=4),
                    balance_samples=None)


@pytest.fixture(scope="module")
def short():
    stats = synthetic_internvl_mixture(3000, 4)
    by_estimate = run_hbp_job(JOB, HBPPlanConfig(sp_by_simulator=False), stats, plain=False, bound=False)
    by_simulator = run_hbp_job(JOB, HBPPlanConfig(), stats, plain=False, bound=False)
    full = run_hbp_job(JOB, HBPPlanConfig(), stats)
    return stats, by_estimate, by_simulator, full


def test_sp_chosen_by_the_simulator_is_never_slower_than_the_estimates(short):
    _, by_estimate, by_simulator, _ = short
    for name in ("single level", "hbp"):
        assert by_simulator.row(name).gpu_days <= by_estimate.row(name).gpu_days * (1 + 1e-12)
    est, sim = by_estimate.tried[0], by_simulator.tried[0]  # the single level, before and after the search
    assert est["lengths"] == sim["lengths"] and est["sp"] == [2] and sim["sp"] == [1]
    assert sim["gpu_days"] < 0.9 * est["gpu_days"]
    model = by_simulator.model
    for t in by_simulator.tried:
        for length, kept, trials in zip(t["lengths"], t["sp"], t["sp_trials"]):
            degrees = [d for d, _ in trials]
            assert kept in degrees and degrees == sorted(set(degrees))
            assert all(JOB.layout.dp_size % d == 0 and -(-length // d) <= model.max_tokens_per_rank for d in degrees)
    assert 2 in dict(by_simulator.tried[0]["sp_trials"][0])  # the estimate's degree was simulated too


def test_plain_plan_is_a_single_level_candidate_so_hbp_is_never_slower_than_it(short):
    stats, _, by_simulator, full = short
    plain = full.row(PLAIN)
    # without the candidate, the best single level of the levels is slower than the plain plan here
    assert by_simulator.row("single level").gpu_days > plain.gpu_days
    assert full.row("single level").gpu_days <= plain.gpu_days and full.row("hbp").gpu_days <= plain.gpu_days
    assert full.row("single level").origin == PLAIN and plain.levels[0].sp == 1
    # the candidate is the plan job's own plan, re-simulated: the same prediction
    job = run_plan_job(JOB, stats=stats)
    assert plain.gpu_days == pytest.approx(job.ablation[-1].gpu_days, rel=1e-9)
    assert plain.levels[0].length == job.balanced_schedule.caps.tokens
    assert any(t["origin"] == PLAIN for t in full.tried) and not full.notes


def test_bound_lies_between_the_hbp_result_and_the_single_level(short):
    _, _, _, full = short
    b = full.bound
    assert b.free_gpu_days <= b.single_gpu_days == full.row("single level").gpu_days
    assert b.gain_floor >= b.gain_free and b.gain_limit >= b.gain_amdahl >= b.hbp_gain >= 1.0
    assert b.free_gpu_days == min(v for _, v in b.free_trials) and len(b.free_trials) >= 2
    assert "gain <=" in b.lines()[0]


def test_long_share_is_the_cost_of_samples_over_the_second_longest_candidate():
    from omnibal.data.balance.cost import BalanceCost

    stats = SampleStats.from_arrays(tiles=[1, 1, 1, 1], tokens=[100, 200, 900, 1000], source="t")
    cost = BalanceCost(vision_coef=(0.0, 0.0, 0.0, 0.0), llm_coef=(0.0, 0.0, 1.0, 0.0))
    assert long_share(stats, cost, (256, 1024)) == (256, pytest.approx(1900 / 2200))
    assert long_share(stats, cost, (1024,)) == (0, 1.0)
