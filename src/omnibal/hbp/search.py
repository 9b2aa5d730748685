"""The simulator's searches of an HBP plan and the plan itself (:func:`plan_hbp`).

The estimate (:func:`omnibal.hbp.balance.choose_levels`) proposes one level set per level count; the simulator
(:mod:`omnibal.hbp.planning`) then chooses

* each level's SP degree (:func:`refine_sp`), one level at a time, longest first, the others fixed;
* the level lengths (:func:`refine_lengths`). The estimate ranks sets differently from the simulator (it has
  no per-step costs, gradient sync and pipeline fill and drain, and charges every pack of a level its
  costliest sample), so its best set need not be the simulator's best (docs/hbp.md). So from the fastest
  multi-level set the search tries one level removed, moved to the next shorter or longer candidate length,
  or one candidate added, each balanced and simulated, and moves to the first faster set;
* the partition (:func:`refine_partition`): the paper's search step around the joint optimum, every level
  simulated, for the single level and the chosen HBP set alike.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
from tqdm import tqdm

from omnibal.data.balance.api import BalanceConfig
from omnibal.errors import InputError
from omnibal.hbp.levels import HBPConfig, LevelCostModel, candidate_lengths
from omnibal.hbp.planning import (
    Candidate,
    HBPContext,
    HBPPlanConfig,
    HBPPlanResult,
    baseline_row,
    hierarchical_row,
    level_a2a,
    level_planner,
    level_stage_plan,
    naive_row,
    simulate_levels,
    simulate_schedule,
    stats_level_cost_model,
)
from omnibal.hbp.sp_cost import sp_table
from omnibal.plan.search import model_step_time, neighbour_parts


def level_lengths_of(cand: Candidate) -> tuple[int, ...]:
    """The level lengths a candidate's schedule uses (levels left empty by the packer are not listed)."""
    return tuple(int(n) for n in cand.schedule.meta["hbp"]["level_lengths"])


def length_moves(lengths: tuple[int, ...], cands: tuple[int, ...], max_levels: int) -> list[tuple[int, ...]]:
    """Level sets one move from ``lengths`` (ascending; the longest level, which holds the longest sample,
    stays): a shorter level removed, moved to the neighbouring candidate between its neighbours, or a
    candidate shorter than the longest level added while there are fewer than ``max_levels``."""
    top, inner = lengths[-1], lengths[:-1]
    out = [inner[:i] + inner[i + 1:] + (top,) for i in range(len(inner))]
    for i, n in enumerate(inner):
        if n not in cands:
            continue
        j, lo, hi = cands.index(n), (inner[i - 1] if i else 0), lengths[i + 1]
        out += [inner[:i] + (cands[k],) + inner[i + 1:] + (top,) for k in (j - 1, j + 1)
                if 0 <= k < len(cands) and lo < cands[k] < hi]
    if len(lengths) < max_levels:
        out += [tuple(sorted(lengths + (c,))) for c in cands if c < top and c not in lengths]
    return list(dict.fromkeys(out))


def refine_lengths(ctx: HBPContext, hbp: HBPPlanConfig, stats, config: HBPConfig, start: Candidate,
                   tried: set, *, cache: dict | None = None, bar=None) -> Candidate:
    """``start``'s level lengths searched by the simulator: moves of :func:`length_moves` over the estimate's
    candidate lengths, each balanced (the estimate's SP degrees) and simulated; the first faster one is kept
    and searched from, at most ``hbp.length_search_rounds`` times. The degrees of a faster set found are then
    chosen by :func:`refine_sp` (with ``hbp.sp_by_simulator``). Returns ``start`` when no move is faster.
    ``tried``: level sets already simulated (skipped; the ones simulated here are added)."""
    cands = candidate_lengths(np.asarray(stats.tokens), config)
    best = start
    for _ in range(hbp.length_search_rounds):
        for lengths in length_moves(level_lengths_of(best), cands, hbp.max_levels):
            if lengths in tried:
                continue
            tried.add(lengths)
            try:
                sched = ctx.balance(stats, replace(config, pack_lengths=lengths, level_sp=None), cache)
            except InputError:  # a level cannot fill whole steps: not a candidate
                continue
            cand = _simulated(ctx, hbp, sched, stats, start.row.name, bar)
            if cand.row.faster_than(best.row):
                best = cand
                break
        else:
            break
    if best is start or not hbp.sp_by_simulator:
        return best
    return refine_sp(ctx, hbp, stats, config, best, cache=cache, bar=bar)


def refine_sp(ctx: HBPContext, hbp: HBPPlanConfig, stats, config: HBPConfig, start: Candidate, *,
              cache: dict | None = None, bar=None) -> Candidate:
    """``start``'s levels with each level's SP degree chosen by the simulator: one level at a time, longest
    first, the others fixed, every memory-feasible degree (it divides dp_size and a rank's share of a pack
    fits ``max_tokens_per_rank``) balanced and simulated; the fastest is kept. The levels of the result
    carry the degrees tried (``LevelResult.sp_trials``: degree -> that level's simulated seconds)."""
    lengths = tuple(start.schedule.meta["hbp"]["level_lengths"])
    degree = dict(zip(lengths, start.schedule.level_sp))
    best, trials = start, {}
    for length in reversed(lengths):
        seen = {lv.length: lv.time_s for lv in best.row.levels}
        trials[length] = {degree[length]: seen[length]} if length in seen else {}
        for d in config.model.feasible_sp(length):
            if d == degree[length]:
                continue
            trial = {**degree, length: d}
            try:
                sched = ctx.balance(stats, replace(config, pack_lengths=lengths,
                                                   level_sp=tuple(trial[n] for n in lengths)), cache)
            except InputError:  # this degree cannot fill whole steps of the level: not a candidate
                continue
            cand = _simulated(ctx, hbp, sched, stats, start.row.name, bar)
            times = {lv.length: lv.time_s for lv in cand.row.levels}
            if length in times:  # else the level handed its samples to the next (too few for a step)
                trials[length][d] = times[length]
            if cand.row.faster_than(best.row):
                best, degree = cand, trial
    levels = tuple(replace(lv, sp_trials=tuple(sorted(trials.get(lv.length, {}).items())))
                   for lv in best.row.levels)
    return replace(best, row=replace(best.row, levels=levels))


def refine_partition(ctx: HBPContext, hbp: HBPPlanConfig, cand: Candidate) -> Candidate:
    """``cand`` on the fastest partition near its own, as the paper verifies a partition by simulating it.

    :func:`omnibal.hbp.planning.choose_partition` is the min-max optimum for the mean micro-batch of all levels;
    each level's own fill and drain (``M + P - 1`` stage slots at its own count) and its own recompute are
    not in that objective. So every neighbour (each boundary moved by up to ``radius`` layers of
    ``hbp.partition_search``, :func:`omnibal.plan.search.neighbour_parts`) is ranked by the levels'
    stage-model 1F1B estimate (each level at its SP table, count and least recompute, times its steps), and
    the best ``top_k`` are simulated over every level beside the partition itself; the fastest without a
    step over memory wins."""
    search = hbp.partition_search
    lengths = [lv.length for lv in cand.row.levels]
    planners = [(level_planner(ctx, sp_table(ctx.table, level_a2a(ctx, hbp, d)), feats), feats.shape[2], len(feats))
                for d, feats, _ in cand.level_feats]

    def estimate(parts) -> float:
        return sum(steps * model_step_time(level_stage_plan(planner, parts), microbatches)
                   for planner, microbatches, steps in planners)

    anchor = tuple(cand.row.parts)
    ranked = sorted((estimate(parts), parts) for parts in neighbour_parts(anchor, search.radius, search.max_candidates)
                    if parts != anchor)
    best = cand.row
    for _, parts in ranked[:search.top_k]:
        row = simulate_levels(ctx, hbp, cand.level_feats, lengths, name=cand.row.name, parts=parts,
                              dropped=cand.row.dropped, origin=cand.row.origin)
        if row.faster_than(best):
            best = row
    if best is cand.row:
        return cand
    levels = tuple(replace(new, sp_trials=old.sp_trials) for new, old in zip(best.levels, cand.row.levels))
    return replace(cand, row=replace(best, levels=levels))


def _simulated(ctx: HBPContext, hbp: HBPPlanConfig, sched, stats, name: str, bar) -> Candidate:
    """``simulate_schedule``, counted on ``bar`` (a tqdm counter, or None)."""
    cand = simulate_schedule(ctx, hbp, sched, stats, name=name)
    if bar is not None:
        bar.update(1)
        bar.set_postfix_str(f"last {cand.row.gpu_days:.1f} GPU days")
    return cand


def _level_sets(ctx: HBPContext, hbp: HBPPlanConfig, stats, config: HBPConfig, cache: dict,
                bar=None) -> tuple[list[Candidate], HBPConfig]:
    """The estimate's best level set for each level count (each distinct set once), SP by the simulator
    when ``hbp.sp_by_simulator``; the first is the single level. Returns them and the config the multi-level
    sets were balanced with: with ``microbatches="tokens"`` and no ``step_tokens``, the single level's tokens
    per rank per step (:func:`single_step_tokens`), so no level set holds a larger batch than it."""
    out, seen = [], set()
    for count in range(1, hbp.max_levels + 1):
        sched = ctx.balance(stats, replace(config, max_levels=count), cache)
        lengths = tuple(sched.meta["hbp"]["level_lengths"])
        if lengths in seen:
            continue
        seen.add(lengths)
        cand = _simulated(ctx, hbp, sched, stats, "single level" if count == 1 else "hbp", bar)
        out.append(refine_sp(ctx, hbp, stats, config, cand, cache=cache, bar=bar) if hbp.sp_by_simulator else cand)
        if count == 1 and config.microbatches == "tokens" and config.step_tokens is None:
            config = replace(config, step_tokens=single_step_tokens(out[0].schedule))
    return out, config


def single_step_tokens(schedule) -> int:
    """LLM tokens per rank per step of a one-level schedule: its micro-batches of its pack length split over
    its SP degree. With it as every level's budget (``HBPConfig.step_tokens``), a level set cannot win by
    choosing a smaller SP degree for its longest level, which would otherwise raise every level's count."""
    length = int(schedule.meta["hbp"]["level_lengths"][0])
    return int(schedule.num_microbatches * length // int(schedule.level_sp[0]))


def plan_hbp(ctx: HBPContext, hbp: HBPPlanConfig, stats, *, model: LevelCostModel | None = None,
             extra: tuple[Candidate, ...] = (), cache: dict | None = None,
             step_tokens: int | None = None) -> HBPPlanResult:
    """Choose the levels, balance them, and simulate HBP against single-level packing and the baseline.

    The estimate (:func:`omnibal.hbp.balance.choose_levels`) proposes the best level set for each level count
    up to ``max_levels``; the simulator chooses each level's SP degree (:func:`refine_sp`), searches the level
    lengths from the fastest multi-level set (``length_search``) and keeps the fastest set; the single level
    and the fastest set then get the partition search (:func:`refine_partition`). The single-level
    row is the fastest of the one-level set and the ``extra`` single levels (e.g. the plain ``omnibal plan``
    packing), and HBP is the fastest of everything, so HBP is never predicted slower than the single level,
    nor the single level than an extra one. ``model``: the level
    cost model (default: :func:`stats_level_cost_model`); ``cache``: memoises balanced levels between calls;
    ``step_tokens``: tokens per rank a step of every level holds with ``hbp.microbatches == "tokens"`` (e.g. the
    plain plan's, so HBP and it are compared at the same batch; ``HBPConfig.step_tokens``)."""
    model = model or stats_level_cost_model(ctx, hbp, stats)
    config = HBPConfig(model=model, max_levels=1, candidate_lengths=hbp.candidate_lengths, oversize=hbp.oversize,
                       balance=BalanceConfig(cost=model.cost), microbatches=hbp.microbatches, step_tokens=step_tokens,
                       min_microbatches=ctx.stage_config.num_stages)
    cache = {} if cache is None else cache
    with tqdm(desc="HBP level sets simulated", unit="set", file=sys.stderr, disable=not hbp.progress) as bar:
        sets, config = _level_sets(ctx, hbp, stats, config, cache, bar)
        if hbp.length_search:
            start = min([c for c in sets if len(c.row.levels) > 1] or sets, key=lambda c: c.row.rank)
            found = refine_lengths(ctx, hbp, stats, config, start, {level_lengths_of(c) for c in sets},
                                   cache=cache, bar=bar)
            sets += [found] if found is not start else []
    # the partition search for the two rows compared (one search when the single level is the fastest set)
    fastest = min(sets, key=lambda c: c.row.rank)
    single_refined = refine_partition(ctx, hbp, sets[0])
    fastest_refined = single_refined if fastest is sets[0] else refine_partition(ctx, hbp, fastest)
    sets = [single_refined if c is sets[0] else fastest_refined if c is fastest else c for c in sets]
    single = min([sets[0], *extra], key=lambda c: c.row.rank)
    best = min([*sets, *extra], key=lambda c: c.row.rank)
    top = tuple(sets[0].schedule.meta["hbp"]["level_lengths"])
    # the usual long-context recipe: the smallest SP degree the longest pack needs, full recompute, for all
    recipe = ctx.balance(stats, replace(config, pack_lengths=top, level_sp=(model.feasible_sp(top[0])[0],)), cache)
    recipe_row = simulate_schedule(ctx, hbp, recipe, stats, name="single level, full recompute", recompute="full").row
    single_row = replace(single.row, name="single level")
    multi = min([c for c in sets if len(c.row.levels) > 1] or sets, key=lambda c: c.row.rank)
    rows = (baseline_row(ctx, hbp, stats, model), naive_row(ctx, hbp, stats, model, top[0], config),
            hierarchical_row(ctx, hbp, stats, multi.schedule, config, cache), recipe_row,
            single_row, replace(best.row, name="hbp"), *(c.row for c in extra))
    tried = tuple({"lengths": [lv.length for lv in c.row.levels], "sp": [lv.sp for lv in c.row.levels],
                   "gpu_days": c.row.gpu_days, "origin": c.row.origin,
                   "sp_trials": [lv.to_dict()["sp_trials"] for lv in c.row.levels]} for c in (*sets, *extra))
    return HBPPlanResult(rows=rows, model=model, schedule=best.schedule, tried=tried,
                         single=replace(single, row=single_row))
