"""Interleaved 1F1B plans: the joint partition + recompute over ``P * v`` virtual stages.

Megatron's interleaved 1F1B gives each of the P pipeline devices ``v`` model chunks (virtual stage
``c * P + d`` is chunk ``c`` of device ``d``) and runs micro-batches through them in groups of P, which cuts
the pipeline's fill and drain about v-fold at the price of more point-to-point transfers and more
activations in flight on the early devices. Whether that pays is a planner choice, made per job:

1. **in flight**: chunk ``c`` of device ``d`` holds at most ``chunk_in_flight`` micro-batches, read off the
   schedule's own op order (``omnibal.plan.stages.chunk_in_flight``);
2. **memory**: the chunks of a device share its budget. The exact joint planner
   (:class:`~omnibal.plan.joint.JointPlanner`) works per stage, so each chunk gets a share of its device's
   budget, proportional to what an even split of the layers would need there without recompute (static
   bytes + its in-flight activations); shares summing to 1 per device keep the device within budget under
   the stage model. That bound is loose (the chunks' peaks need not coincide, and each chunk counts its own
   recompute working set), so the shares are also tried scaled up by ``SHARE_SLACK`` factors;
3. **the simulator decides**: every candidate (chunks x slack) is scored by the simulator on the plan's
   sampled steps with the interleaved schedule, whose memory comes from the op order itself, and the fastest
   that does not run out of memory is the interleaved plan. The job keeps it only when it beats the plain
   1F1B plan on the same steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from omnibal.errors import InputError
from omnibal.plan.joint import JointPlanner, StagePlanSet
from omnibal.plan.search import Candidate, model_step_time
from omnibal.plan.stages import StageModelConfig, layer_quantities

REFIT_ROUNDS = 2
"""Times each device's budget shares are refitted to its simulated peak (each one planned and scored)."""
DEFAULT_CHUNKS = (1, 2, 3, 4)
"""Model chunks per device ``omnibal plan`` considers (1: plain 1F1B)."""


@dataclass(frozen=True)
class InterleavedCandidate:
    """One interleaved plan the simulator scored."""

    num_chunks: int
    slack: tuple[float, ...]
    """Per device, its chunks' budget shares times the chunk count (1: an equal split of the budget)."""
    candidate: Candidate
    """The plan over ``P * num_chunks`` virtual stages, its stage-model and simulated step times."""


def check_chunks(chunks, source: str = "--chunks") -> tuple[int, ...]:
    """Chunks per device as a sorted tuple of distinct positive integers (1 = plain 1F1B)."""
    from omnibal.validate import is_int

    values = tuple(chunks)
    if not values or not all(is_int(c) and c >= 1 for c in values):
        raise InputError(f"must be positive integers, got {list(values)!r}", source=source, field="chunks")
    return tuple(sorted(set(values)))


def interleaved_config(config: StageModelConfig, num_chunks: int) -> StageModelConfig:
    """``config`` (P devices, plain 1F1B) as ``P * num_chunks`` interleaved virtual stages."""
    return replace(config, num_stages=config.num_stages * num_chunks, num_chunks=num_chunks, pp_schedule="interleaved",
                   budget_shares=None)


def budget_shares(config: StageModelConfig, slack) -> tuple[float, ...]:
    """Per virtual stage of ``config`` (interleaved), its share of the device budget: ``slack[d] / v`` for the
    chunks of device ``d`` (each at most 1; ``slack`` a number: the same for every device)."""
    p, v = config.num_devices, config.num_chunks
    per_device = np.broadcast_to(np.asarray(slack, dtype=np.float64), (p,))
    return tuple(float(min(per_device[s % p] / v, 1.0)) for s in range(config.num_stages))


def interleaved_candidates(table, features, config: StageModelConfig, score: Callable[[StagePlanSet, int], tuple],
                           chunks: tuple[int, ...], rounds: int = REFIT_ROUNDS) -> list[InterleavedCandidate]:
    """The joint plans over the virtual stages tried, per chunk count, scored by ``score(plan, num_chunks) ->
    (mean step seconds, oom, [P] simulated peak bytes per device)``: shares of 1/v first, then ``rounds``
    refits that scale each device's shares by its budget over its simulated peak. Chunk counts the schedule
    cannot run (micro-batches not a multiple of the devices, fewer layers than virtual stages) are left out."""
    out = []
    p, m, budget = config.num_stages, config.num_microbatches, config.memory_budget_bytes
    for v in chunks:
        if v < 2 or m % p or p * v > table.num_layers:
            continue
        base = interleaved_config(config, v)
        q = layer_quantities(table, features, base)
        slack = np.ones(p)
        for _ in range(rounds + 1):
            try:
                plan = JointPlanner(q, replace(base, budget_shares=budget_shares(base, slack))).plan()
            except InputError:  # no split fits these shares
                break
            step, oom, peak = score(plan, v)
            out.append(InterleavedCandidate(v, tuple(float(x) for x in slack),
                                            Candidate(plan, model_step_time(plan, m), step, oom)))
            if budget is None:
                break
            slack = np.clip(slack * budget / np.asarray(peak, dtype=np.float64), 0.5, float(v))
    return out


def best_interleaved(cands: list[InterleavedCandidate]) -> InterleavedCandidate | None:
    """The fastest candidate that fits (None: none fits)."""
    fitting = [c for c in cands if not c.candidate.oom]
    return min(fitting, key=lambda c: c.candidate.sim_step_time) if fitting else None
