import pytest

from omnibal.plan.joint import JointPlanner
from omnibal.plan.search import SearchConfig, model_step_time, neighbour_parts, search
from omnibal.plan.stages import StageModelConfig, layer_quantities
from plan_helpers import uniform_features, vlm_like_table


def test_neighbours_of_four_stages_are_the_paper_27_plus_radius_two():
    anchor = (0, 10, 20, 30, 40)
    assert len(neighbour_parts(anchor, 1, 10_000)) == 27
    two = neighbour_parts(anchor, 2, 10_000)
    assert len(two) == 125 and anchor in two
    assert all(all(abs(a - b) <= 2 for a, b in zip(c, anchor)) for c in two)


def test_neighbours_stay_valid_near_the_ends_and_cap_falls_back_to_pairs():
    tight = neighbour_parts((0, 1, 2, 3), 2, 10_000)
    assert tight == [(0, 1, 2, 3)]  # every other move would empty a stage
    anchor = tuple(range(0, 170, 10))  # 16 stages: 5**15 combinations is too many
    many = neighbour_parts(anchor, 2, 20_000)
    assert anchor in many and len(many) < 20_000
    moved = {sum(1 for a, b in zip(c, anchor) if a != b) for c in many}
    assert moved == {0, 1, 2}


def test_search_keeps_the_fastest_scored_candidate_and_skips_oom():
    table = vlm_like_table(num_vision=6, num_llm=10)
    cfg = StageModelConfig(num_stages=3, num_microbatches=6)
    q = layer_quantities(table, uniform_features(), cfg)
    planner = JointPlanner(q, cfg)
    anchor = planner.plan()
    calls = []

    def score(plan):  # a stand-in "simulator": prefers a later first cut, and says the best one OOMs
        calls.append(plan.parts)
        return 100.0 - plan.parts[1], plan.parts == max(calls, key=lambda p: p[1])

    winner, scored, num = search(planner, anchor, score, SearchConfig(radius=2, top_k=6))
    assert len(scored) == 6 and num > 6
    assert any(c.plan.parts == anchor.parts for c in scored)
    ok = [c for c in scored if not c.oom]
    assert winner.sim_step_time == min(c.sim_step_time for c in ok) and not winner.oom
    # the ranking is by the stage model: scored candidates are the best estimates (anchor forced in)
    assert scored[0].model_step_time == pytest.approx(min(c.model_step_time for c in scored))
    assert model_step_time(anchor, 6) >= min(c.model_step_time for c in scored) - 1e-12
