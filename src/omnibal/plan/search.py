"""The paper's search step: candidates around the exact optimum, scored by the simulator on real data.

The joint optimum (``joint.py``) is exact under the *stage model*: the mean micro-batch, a per-micro-batch
bottleneck objective. The real step time also depends on how micro-batch costs vary from step to step and
rank to rank, on the pipeline fill/drain (the sum of stage times, not just the largest), and on the gradient
sync per stage. So, as OmniBal does, we enumerate neighbours of the optimum (every boundary moved by up to
``radius`` layers), give each its own least-recompute checkpoints, rank them with the stage model's 1F1B
estimate, and score the best ``top_k`` (always including the optimum itself) with the simulator on the
balanced schedule's micro-batch features. The fastest candidate that does not run out of memory wins.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from omnibal.plan.joint import JointPlanner, StagePlanSet


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """How widely to search around the exact optimum."""

    radius: int = 2
    """Each stage boundary moves by up to this many layers."""
    top_k: int = 8
    """Candidates scored with the simulator (ranked first by the stage model)."""
    max_candidates: int = 20_000
    """Above this many neighbours (many stages), only moves of one or two boundaries are enumerated."""
    sample_steps: int | None = field(default=192, metadata={"flag": "--search-steps"})
    """Steps of the epoch the simulator scores candidates on (the same steps for every candidate);
    None: all steps."""
    seed: int = 0
    """Seed of the step sample."""


@dataclass(frozen=True)
class Candidate:
    plan: StagePlanSet
    model_step_time: float
    """Stage-model estimate of one step: (M - 1) * bottleneck + sum of stage times (1F1B)."""
    sim_step_time: float | None = None
    """Simulator's mean step time on the sampled steps (None: not scored)."""
    oom: bool = False
    """Simulator saw a device above the memory budget."""


def neighbour_parts(anchor: tuple[int, ...], radius: int, max_candidates: int) -> list[tuple[int, ...]]:
    """Cut points with every inner boundary of ``anchor`` moved by ``-radius..radius`` (valid ones only);
    when that is more than ``max_candidates``, moves of at most two boundaries at a time."""
    num_layers, inner = anchor[-1], list(anchor[1:-1])
    if not inner or radius < 1:
        return [tuple(anchor)]
    shifts = range(-radius, radius + 1)
    if (2 * radius + 1) ** len(inner) <= max_candidates:
        moves = itertools.product(shifts, repeat=len(inner))
    else:
        moves = []
        for a, b in itertools.combinations_with_replacement(range(len(inner)), 2):
            for da in shifts:
                for db in shifts if a != b else (0,):
                    delta = [0] * len(inner)
                    delta[a] += da
                    delta[b] += db
                    moves.append(tuple(delta))
    out, seen = [], set()
    for delta in moves:
        cuts = (0, *(c + d for c, d in zip(inner, delta)), num_layers)
        if cuts in seen or any(cuts[i + 1] <= cuts[i] for i in range(len(cuts) - 1)):
            continue
        seen.add(cuts)
        out.append(cuts)
    return out


def model_step_time(plan: StagePlanSet, num_microbatches: int) -> float:
    times = [st.time for st in plan.stages]
    return (num_microbatches - 1) * max(times) + sum(times)


def rank_candidates(planner: JointPlanner, anchor: StagePlanSet, config: SearchConfig,
                    recompute: str = "adaptive") -> list[Candidate]:
    """All feasible neighbours with checkpoints chosen by ``recompute`` (``adaptive``: the least that fits
    each stage), best stage-model estimate first (the anchor first among ties)."""
    num_mb = planner.config.num_microbatches
    cands = [Candidate(anchor, model_step_time(anchor, num_mb))]
    for parts in neighbour_parts(anchor.parts, config.radius, config.max_candidates):
        if parts == anchor.parts:
            continue
        sp = planner.evaluate(parts, recompute)
        if sp is not None:
            cands.append(Candidate(sp, model_step_time(sp, num_mb)))
    order = sorted(range(len(cands)), key=lambda i: (cands[i].model_step_time, i))
    return [cands[i] for i in order]


def sample_steps(features: np.ndarray, num: int | None, seed: int) -> np.ndarray:
    """A fixed random subset of steps of ``features [S, D, M, 4]`` (all when ``num`` is None or >= S)."""
    if num is None or num >= len(features):
        return features
    idx = np.sort(np.random.default_rng(seed).choice(len(features), size=num, replace=False))
    return features[idx]


def search(planner: JointPlanner, anchor: StagePlanSet, score: Callable[[StagePlanSet], tuple[float, bool]],
           config: SearchConfig, progress: Callable[[int, int], None] | None = None,
           recompute: str = "adaptive") -> tuple[Candidate, list[Candidate], int]:
    """Rank the neighbours of ``anchor`` and score the best ``top_k`` (the anchor always among them) with
    ``score(plan) -> (mean step seconds, oom)``. Returns (winner, scored candidates, number enumerated)."""
    ranked = rank_candidates(planner, anchor, config, recompute)
    chosen = ranked[: config.top_k]
    if not any(c.plan.parts == anchor.parts for c in chosen):
        chosen = chosen[: max(config.top_k - 1, 0)] + [next(c for c in ranked if c.plan.parts == anchor.parts)]
    scored = []
    for i, cand in enumerate(chosen):
        step, oom = score(cand.plan)
        scored.append(Candidate(cand.plan, cand.model_step_time, step, oom))
        if progress is not None:
            progress(i + 1, len(chosen))
    fitting = [c for c in scored if not c.oom] or scored
    winner = min(fitting, key=lambda c: (c.sim_step_time, c.model_step_time))
    return winner, scored, len(ranked)
