"""The engine rows of ``omnibal plan --engine NAME``: each constraint alone, then all of them (the plan).

Every row is the exact optimum under its constraints (:class:`~omnibal.plan.constrained.ConstrainedPlanner`)
followed by the same simulator-scored neighbour search as the unconstrained plan, so the ablation prices each
constraint against the unconstrained ``+ adaptive recompute`` row on the same data and cost model.
"""

from __future__ import annotations

from omnibal.errors import InputError
from omnibal.plan.constrained import ConstrainedPlanner
from omnibal.plan.engines import constraint_rows, engine_constraints, get_engine
from omnibal.plan.search import search


def engine_row_specs(engine: str, planner, score, search_config):
    """``([(row name, partition text, recompute text, StagePlanSet)], (anchor, winner, scored candidates,
    number enumerated, search info))``; the winner of the last row is the engine's plan."""
    spec = get_engine(engine)
    rows, final = [], None
    for label, keep in constraint_rows(engine):
        constraints = engine_constraints(engine, planner.q.kinds, which=keep)
        try:
            cp = ConstrainedPlanner(planner, constraints)
            anchor = cp.plan()
        except InputError as exc:  # name the engine: its constraint is what makes the job infeasible
            raise InputError(f"{exc.message} [{label}]", source=engine, field=exc.field) from None
        best, scored, enumerated = search(cp, anchor, score, search_config)
        part = ("vision encoder on stage 0, joint min-max + search" if constraints.first_stage_min_stop is not None
                else "joint min-max + search")
        rec = {"per-layer": "adaptive per layer", "count": "one (n_vision, n_llm) block count for all stages",
               "all-or-none": "none or every block"}[constraints.recompute]
        rows.append((label, part, rec, best.plan))
        final = (anchor, best, scored, enumerated,
                 {"engine_constraints": {"first_stage_min_stop": constraints.first_stage_min_stop,
                                         "recompute": constraints.recompute},
                  "engine_vision_on_first_stage": spec.vision_on_first_stage})
    assert final is not None, f"{engine} has no constraint rows"
    return rows, final
