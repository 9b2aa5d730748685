"""``omnibal plan --hbp`` as a library call: the plan job's model, cluster and data planned with HBP
(:mod:`omnibal.hbp.planning`), the plain ``omnibal plan`` packing as one more single-level candidate, and the
bound on what HBP can gain (:mod:`omnibal.hbp.bound`). With a micro-batch count per level, the levels'
steps then hold the plain plan's tokens per rank (its token cap x its micro-batches), so a gain is not a
larger batch.

The plain candidate is the plan job itself (:func:`omnibal.jobs.plan_job.run_plan_job` on the same job and data:
the balancer's own caps, SP 1, its partition search and adaptive recompute), re-simulated here with the plan's
partition and recompute mask. It is tried only when every sample fits one rank (SP 1), and kept only when
the job balanced the same rows (the HBP levels see the statistics as given; the job converts them to the
model's convention first, ``omnibal.cost.units.model_stats``).
"""

from __future__ import annotations

from dataclasses import replace

from omnibal.errors import InputError
from omnibal.hbp.bound import hbp_bound
from omnibal.hbp.planning import (
    Candidate,
    HBPContext,
    HBPPlanConfig,
    HBPPlanResult,
    simulate_levels,
    stats_level_cost_model,
)
from omnibal.hbp.search import plan_hbp
from omnibal.tables import markdown_table

PLAIN = "omnibal plan"
"""Name of the plain plan's row (and its ``origin`` when it is the single level)."""


def hbp_context(config, *, num_samples: int, balanced_samples: int, cost=None) -> HBPContext:
    """The :class:`HBPContext` of an ``omnibal plan`` job (:class:`omnibal.jobs.plan_config.PlanJobConfig`)."""
    from omnibal.jobs.plan_phases import model_phase  # the job's cost table, hardware, simulator and stages

    config.validate()
    model = model_phase(config)
    return HBPContext(table=model.table, spec=model.spec, hardware=model.hw, stage_config=model.stage_config,
                      sim_config=model.sim_config,
                      epoch_scale=num_samples / balanced_samples, seed=config.seed, cost=cost)


def plain_candidate(config, ctx: HBPContext, hbp: HBPPlanConfig, stats, balanced) -> Candidate:
    """The plain ``omnibal plan`` of ``config`` on ``stats`` (all rows; the job subsamples them as
    ``balanced``) as a single-level candidate: its schedule, partition and recompute mask, simulated here.
    InputError when the job fails or balanced other rows than ``balanced``."""
    from omnibal.jobs.plan_job import run_plan_job

    job = run_plan_job(replace(config, chunks=(1,)), stats=stats)  # HBP levels run plain 1F1B
    if job.stats.fingerprint() != balanced.fingerprint():
        raise InputError("the plan job balanced other statistics (converted to the model's convention)",
                         source=stats.source, field="convention")
    final = job.ablation[-1]
    parts, mask = job.row_plans[final.name]
    sched = job.balanced_schedule
    feats = job.plan_features
    samples = len(balanced) - len(sched.dropped)
    row = simulate_levels(ctx, hbp, [(1, feats, samples)], [sched.caps.tokens], name=PLAIN, parts=parts,
                          masks=[mask], dropped=len(sched.dropped), origin=PLAIN)
    return Candidate(row=row, schedule=sched, level_feats=((1, feats, samples),))


def hbp_plan_config(config, *, microbatches: str | None = None, progress: bool = False) -> HBPPlanConfig:
    """The :class:`HBPPlanConfig` ``omnibal plan --hbp`` runs for the plan job ``config``: its baseline batch
    size, oversize policy and partition search; ``microbatches`` (None: the default rule)."""
    return HBPPlanConfig(baseline_batch_size=config.baseline_batch_size, oversize=config.oversize,
                         microbatches=microbatches or HBPPlanConfig.microbatches, partition_search=config.search,
                         progress=progress)


def run_hbp_job(config, hbp: HBPPlanConfig, stats, *, plain: bool = True, bound: bool = True) -> HBPPlanResult:
    """``omnibal plan --hbp``: the job's model and cluster, ``stats`` subsampled as the job does; with
    ``plain`` the plain plan as a single-level candidate (when SP 1 holds every sample), with ``bound`` the
    bound on HBP's gain."""
    from omnibal.jobs.plan_phases import balance_subset

    full, stats = stats, balance_subset(stats, config)
    ctx = hbp_context(config, num_samples=len(full), balanced_samples=len(stats))
    model = stats_level_cost_model(ctx, hbp, stats)
    extra, notes, cache = (), [], {}
    if plain and int(stats.tokens.max()) > model.max_tokens_per_rank:
        notes.append(f"{PLAIN} (SP 1) not tried: the longest sample has {int(stats.tokens.max()):,} tokens, one "
                     f"rank holds {model.max_tokens_per_rank:,}")
    elif plain:
        try:
            extra = (plain_candidate(config, ctx, hbp, full, stats),)
        except InputError as exc:
            notes.append(f"{PLAIN} (SP 1) not tried: {exc}")
    # the levels' steps hold the plain plan's tokens per rank, so both are compared at one batch size
    step_tokens = (int(extra[0].schedule.caps.tokens) * int(extra[0].schedule.num_microbatches)) if extra else None
    result = plan_hbp(ctx, hbp, stats, model=model, extra=extra, cache=cache, step_tokens=step_tokens)
    if bound:
        result = replace(result, bound=hbp_bound(ctx, hbp, stats, result, cache=cache))
    return replace(result, notes=tuple(notes))


def training_schedule(config, hbp: HBPPlanConfig, result: HBPPlanResult, stats):
    """The winning level set balanced over every row of ``stats`` (the plan balanced a subset): its level
    lengths, SP degrees and micro-batch rule, on the job's DP ranks, micro-batches and seed, the schedule a
    trainer runs (``Schedule`` with ``levels``). None when the plain plan's single level won (its training
    schedule is ``omnibal balance`` with its caps)."""
    from omnibal.data.balance.api import BalanceConfig
    from omnibal.hbp.levels import HBPConfig

    sched = result.schedule
    if sched.levels is None or "hbp" not in sched.meta:
        return None
    meta = sched.meta["hbp"]
    level = HBPConfig(model=result.model, pack_lengths=tuple(meta["level_lengths"]), level_sp=tuple(sched.level_sp),
                      oversize=hbp.oversize, balance=BalanceConfig(cost=result.model.cost),
                      microbatches=meta["config"]["microbatches"], step_tokens=meta["config"]["step_tokens"],
                      min_microbatches=meta["config"].get("min_microbatches", 1))
    ctx = hbp_context(config, num_samples=len(stats), balanced_samples=len(stats))
    sched = ctx.balance(stats, level)
    row = result.row("hbp")
    if len(row.levels) == len(sched.level_sp) and all(r.recompute_mask for r in row.levels):
        sched.meta["hbp"].update(model=ctx.spec.name, **level_recompute_names(row, ctx.table.names))
    return sched


def level_recompute_names(row, names) -> dict:
    """Per level of ``row`` (an :class:`omnibal.hbp.planning.HBPRow`), the chain layers (``names``) recomputed whole
    and selectively, and the row's stage cuts, as the training schedule records them (``meta.hbp``;
    :mod:`omnibal.train.level_recompute` applies them)."""
    from omnibal.cost.table import RECOMPUTE_FULL, RECOMPUTE_SELECTIVE

    def chosen(mask, code):
        return [str(n) for n, c in zip(names, mask) if int(c) == code]

    return {"level_recompute": [chosen(r.recompute_mask, RECOMPUTE_FULL) for r in row.levels],
            "level_selective": [chosen(r.recompute_mask, RECOMPUTE_SELECTIVE) for r in row.levels],
            "stage_cuts": [int(c) for c in row.parts]}


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f}"


def hbp_markdown(result: HBPPlanResult) -> str:
    """Per-level table of the HBP plan, the comparison rows, the SP degrees tried and the bound."""
    levels = [["level", "pack length", "SP", "micro-batches", "steps", "samples", "checkpointed layers",
               "all-to-all share", "time (h)"]]
    for i, lv in enumerate(result.row("hbp").levels):
        levels.append([str(i), f"{lv.length:,}", str(lv.sp), str(lv.microbatches), f"{lv.steps:,}", f"{lv.samples:,}",
                       str(lv.checkpointed), f"{lv.a2a_share:.1%}", _hours(lv.time_s)])
    packings = [["packing", "levels (length x SP)", "GPU days", "vs single level", "OOM steps"]]
    single = result.row("single level").gpu_days
    for row in result.rows:
        desc = ", ".join(f"{lv.length:,} x {lv.sp}" for lv in row.levels)
        origin = f" ({row.origin})" if row.origin != "levels" and row.name != row.origin else ""
        packings.append([f"{row.name}{origin}", desc, f"{row.gpu_days:.1f}", f"{single / row.gpu_days:.2f}x",
                         str(row.oom_steps)])
    steps = [[t["step"], t["row"], f"{t['gpu_days']:.1f}", f"{t['speedup']:.2f}x"] for t in result.ablation()]
    lines = [markdown_table(levels, compact=True), "", markdown_table(packings, compact=True), "",
             "HBP's ablation (its paper's Table 6 steps): naive packing at the longest level, + hierarchical (HBP's "
             "levels, each packed naively), + balance (HBP):", "",
             markdown_table([["step", "packing", "GPU days", "vs naive packing"], *steps], compact=True)]
    trials = sp_trials_lines(result)
    if trials:
        lines += ["", "SP degree per level, chosen by the simulator (degree: simulated hours of the level, the other "
                  "levels fixed; * = kept):", "", *trials]
    if result.bound is not None:
        lines += ["", *result.bound.lines()]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def sp_trials_lines(result: HBPPlanResult) -> list[str]:
    """One line per level whose SP degree the simulator searched, for every level set compared."""
    out = []
    for t in result.tried:
        for length, sp, trials in zip(t["lengths"], t["sp"], t["sp_trials"]):
            if trials:
                tried = ", ".join(f"{d}{'*' if d == sp else ''}: {_hours(s)}" for d, s in trials)
                out.append(f"- levels {'/'.join(f'{n:,}' for n in t['lengths'])}, level {length:,}: {tried}")
    return out
