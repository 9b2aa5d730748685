"""Per-level settings of an HBP schedule: SP degree, partition and recompute, priced by the simulator.

:mod:`omnibal.hbp.levels` chooses the levels from a :class:`LevelCostModel`; this module fills that model
from the cost table and the hardware, and prices the result with the step-time simulator:

* **The SP terms** (:mod:`omnibal.hbp.sp_cost`): the Ulysses all-to-all of a level's SP degree (added to
  the cost table's per-layer collectives), a rank's ``1/d`` share of the pack's work, the most LLM tokens per
  rank that fit the memory budget, and the recompute price of a per-rank length.
* **Partition and recompute**: one partition for the whole run (the joint min-max optimum over every
  level's micro-batches, sized for the largest), and per level the least recompute that fits its own
  micro-batches (:meth:`JointPlanner.evaluate` with ``adaptive``): short levels recompute less.
* **SP degree** per level: the estimate (``omnibal.hbp.levels``) proposes the levels and a degree per level
  (a larger degree adds all-to-all time but shrinks a rank's share of the pack, so less recompute is
  needed; the recompute price per per-rank length comes from the planner,
  :func:`omnibal.hbp.sp_cost.recompute_ratio`). The
  estimate has no per-step costs (gradient reduction, optimizer, pipeline fill) and no small-kernel
  slowdown, so it overrates SP for short packs: a degree ``d`` makes ``d`` times more steps. The simulator
  therefore chooses each level's degree among the memory-feasible ones
  (:func:`omnibal.hbp.search.refine_sp`), one level at a time, longest first, the others fixed, and keeps
  the fastest; every degree tried is reported. It also searches the level lengths
  (:func:`omnibal.hbp.search.refine_lengths`).
* **Other single levels** (``extra``): a packing made elsewhere (the plain ``omnibal plan``: its own caps,
  SP 1, adaptive recompute; ``omnibal.jobs.hbp``) competes as a single level, so neither the single
  level nor HBP is predicted slower than it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from omnibal.cost.table import RECOMPUTE_FULL, RECOMPUTE_SELECTIVE, LayerCostTable, recompute_codes
from omnibal.data.balance.api import BalanceConfig, balance
from omnibal.data.balance.cost import BalanceCost
from omnibal.errors import InputError
from omnibal.hbp.balance import balance_hbp
from omnibal.hbp.levels import LEVEL_MICROBATCHES, LevelCostModel
from omnibal.hbp.sp_cost import max_tokens_per_rank, per_rank_features, recompute_ratio, sp_table, ulysses_a2a_time
from omnibal.plan.joint import JointPlanner
from omnibal.plan.partition import even_partition
from omnibal.plan.search import SearchConfig
from omnibal.plan.stages import StageModelConfig, layer_quantities
from omnibal.sim.epoch import SECONDS_PER_DAY, simulate_epoch
from omnibal.validate import is_int

if TYPE_CHECKING:
    from omnibal.cost.hardware import HardwareSpec
    from omnibal.cost.spec import ModelSpec
    from omnibal.data.balance.schedule import Schedule
    from omnibal.sim.costs import SimConfig

NAIVE = "single level, naive packing"
"""The row of :func:`naive_row`."""
HIERARCHICAL = "levels, naive packing"
"""The row of :func:`hierarchical_row` (HBP's "+ hierarchical")."""


@dataclass(frozen=True, kw_only=True)
class HBPPlanConfig:
    """HBP settings of a plan."""

    sp_degrees: tuple[int, ...] = (1, 2, 4, 8)
    """SP degrees a level may use (those dividing dp_size and the LLM's attention heads; 8 = one node of A100s)."""
    max_levels: int = 5
    """Most levels (the simulator keeps fewer when they are faster)."""
    candidate_lengths: tuple[int, ...] | None = None
    """Level lengths to choose from; None: powers of two and 1.5x midpoints from the median sample to the
    longest (``omnibal.hbp.balance.default_candidates``)."""
    oversize: str = "error"
    """A sample no level holds even at the largest SP degree: ``error`` or ``drop`` (listed)."""
    baseline_batch_size: int = 4
    """Samples per micro-batch of the baseline (random, padded to the longest)."""
    dtype_bytes: int = 2
    """Bytes per activation value the all-to-alls move (bf16)."""
    sp_by_simulator: bool = True
    """Choose each level's SP degree by the simulator (:func:`omnibal.hbp.search.refine_sp`); False: the
    estimate's degree."""
    length_search: bool = True
    """Search the level lengths by the simulator from the fastest of the estimate's multi-level sets
    (:func:`omnibal.hbp.search.refine_lengths`); False: only the estimate's sets."""
    length_search_rounds: int = 10
    """Most faster level sets that search moves to (each round simulates the moves of one set; it stops earlier
    when no move is faster; later rounds gain less for the CPU time they cost)."""
    progress: bool = False
    """Count the level sets simulated on stderr (a tqdm counter: the searches run for a minute or two)."""
    microbatches: str = field(default="tokens", metadata={"flag": "--hbp-microbatches", "choices": LEVEL_MICROBATCHES})
    """Micro-batches per step of each level (``omnibal.hbp.balance.HBPConfig.microbatches``): ``tokens`` (a
    short level's step holds as many tokens per rank as the longest level's, in more micro-batches) or
    ``same`` (the job's count on every level)."""
    partition_search: SearchConfig = field(default_factory=SearchConfig, metadata={"cli": False})
    """The partition search around the joint optimum (:func:`omnibal.hbp.search.refine_partition`;
    ``radius`` 0 keeps the joint optimum)."""

    def __post_init__(self) -> None:
        if self.microbatches not in LEVEL_MICROBATCHES:
            raise InputError(f"unknown micro-batch rule {self.microbatches!r}; choose one of {LEVEL_MICROBATCHES}",
                             source="--hbp-microbatches", field="microbatches")
        for name in ("max_levels", "baseline_batch_size", "length_search_rounds"):
            value = getattr(self, name)
            if not is_int(value) or value < (0 if "rounds" in name else 1):
                raise InputError(f"must be a {'non-negative' if 'rounds' in name else 'positive'} integer, got "
                                 f"{value!r}", source="HBPPlanConfig", field=name)


@dataclass(frozen=True, kw_only=True)
class LevelResult:
    """One level as simulated."""

    length: int
    """Pack length (token cap of a pack, before the SP split)."""
    sp: int
    """SP degree."""
    steps: int
    """Steps of the level in the balanced epoch."""
    microbatches: int
    """Micro-batches per rank in each of the level's steps."""
    samples: int
    """Samples of the level."""
    checkpointed: int
    """Layers recomputed whole on the level's steps."""
    selective: int = 0
    """Blocks recomputed selectively on the level's steps (``omnibal.train.recompute``)."""
    time_s: float
    """Simulated seconds of the level's steps."""
    a2a_share: float
    """Share of the level's busy time that is SP all-to-all."""
    oom_steps: int
    """Steps over the memory budget."""
    sp_trials: tuple[tuple[int, float], ...] = ()
    """``(SP degree, simulated seconds of this level)`` for every degree the simulator tried on this level,
    the other levels fixed (:func:`omnibal.hbp.search.refine_sp`); empty when the degree was not searched."""
    recompute_mask: tuple[int, ...] = ()
    """The level's recompute code of every layer of the chain (``omnibal.cost.table`` codes: none, full,
    selective): what the trainer runs on the level's steps (:func:`omnibal.jobs.hbp.level_recompute_names`)."""

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["sp_trials"] = [[int(d), float(t)] for d, t in self.sp_trials]
        out["recompute_mask"] = [int(c) for c in self.recompute_mask]
        return out


@dataclass(frozen=True, kw_only=True)
class HBPRow:
    """One row of the comparison (baseline, single level, HBP)."""

    name: str
    levels: tuple[LevelResult, ...]
    epoch_time_s: float
    """Simulated epoch seconds (scaled to the whole dataset)."""
    gpu_days: float
    parts: tuple[int, ...]
    """Partition cut points."""
    oom_steps: int
    dropped: int = 0
    """Samples left out on purpose (``oversize='drop'``)."""
    origin: str = "levels"
    """Where the packing comes from: ``levels`` (the level search here) or the name of an ``extra`` single
    level (``omnibal plan``: the plain plan's packing)."""

    def to_dict(self) -> dict:
        return {"name": self.name, "levels": [lv.to_dict() for lv in self.levels], "epoch_time_s": self.epoch_time_s,
                "gpu_days": self.gpu_days, "parts": list(self.parts), "oom_steps": self.oom_steps,
                "dropped": self.dropped, "origin": self.origin}

    @property
    def rank(self) -> tuple[bool, float]:
        """Order of preference: no step over memory first, then fewer GPU days."""
        return self.oom_steps > 0, self.gpu_days

    def faster_than(self, other: HBPRow) -> bool:
        return self.rank < other.rank


@dataclass(frozen=True, kw_only=True, eq=False)
class Candidate:
    """A simulated packing with what produced it (the bound re-runs the single level's features)."""

    row: HBPRow
    schedule: Schedule
    """Its Schedule (single- or multi-level)."""
    level_feats: tuple
    """``(SP degree, per-rank features [S_k, D, M, 4], samples)`` per level (:func:`level_features`)."""


@dataclass(frozen=True, kw_only=True)
class HBPContext:
    """Model, cluster and data of one HBP plan (what :func:`omnibal.hbp.search.plan_hbp` needs besides the
    HBP settings)."""

    table: LayerCostTable
    spec: ModelSpec
    """The ModelSpec (width and heads size the all-to-alls)."""
    hardware: HardwareSpec
    """The HardwareSpec (links)."""
    stage_config: StageModelConfig
    sim_config: SimConfig
    """The simulator's SimConfig (dp_size, budget, links)."""
    epoch_scale: float = 1.0
    """Whole dataset / balanced samples."""
    seed: int = 0
    cost: BalanceCost | None = field(default=None)
    """Per-sample cost (default: from the table)."""

    @property
    def dp_size(self) -> int:
        return self.stage_config.dp_size

    @property
    def num_microbatches(self) -> int:
        return self.stage_config.num_microbatches

    @property
    def num_gpus(self) -> int:
        return self.sim_config.dp_size * self.stage_config.num_stages * self.sim_config.tp_size

    def balance(self, stats, config, cache: dict | None = None):
        """``stats`` balanced into levels by ``config`` (:func:`omnibal.hbp.balance.balance_hbp`) on this job's DP
        ranks, micro-batches and seed."""
        return balance_hbp(stats, dp_size=self.dp_size, num_microbatches=self.num_microbatches, seed=self.seed,
                           config=config, cache=cache)


def stats_level_cost_model(ctx: HBPContext, hbp: HBPPlanConfig, stats) -> LevelCostModel:
    """:func:`level_cost_model` at the tiles per LLM token of ``stats``."""
    return level_cost_model(ctx, hbp, float(stats.tiles.sum()) / max(float(stats.tokens.sum()), 1.0))


def level_cost_model(ctx: HBPContext, hbp: HBPPlanConfig, tiles_per_token: float) -> LevelCostModel:
    """The :class:`LevelCostModel` of this model, cluster and memory budget (seconds per sample)."""
    heads = int(ctx.spec.llm.num_heads)  # Ulysses gives each rank of a group heads/d of them
    degrees = tuple(d for d in hbp.sp_degrees if ctx.dp_size % d == 0 and heads % d == 0)
    if not degrees:
        raise InputError(f"no SP degree of {hbp.sp_degrees} divides both dp_size {ctx.dp_size} and the LLM's {heads} "
                         "attention heads", field="sp_degrees", source="--hbp")
    a2a = [float(ulysses_a2a_time(ctx.table, ctx.spec, ctx.hardware, d, tp_size=ctx.sim_config.tp_size,
                                  dtype_bytes=hbp.dtype_bytes)[:, 2].sum()) for d in degrees]
    # the estimate works in whole-model seconds, the pipeline spreads them over its stages
    cost = ctx.cost or BalanceCost.from_cost_table(ctx.table, name="cost-table")
    most = max_tokens_per_rank(ctx.table, ctx.stage_config, tiles_per_token)
    grid = sorted({*(1 << k for k in range(9, most.bit_length()) if (1 << k) < most), most})
    ratios = tuple(recompute_ratio(ctx.table, ctx.stage_config, t, tiles_per_token) for t in grid)
    return LevelCostModel(cost=cost, sp_degrees=degrees, a2a_per_token=tuple(a2a), max_tokens_per_rank=most,
                          recompute_tokens=tuple(grid), recompute_ratio=ratios)


# -- simulation --------------------------------------------------------------------------------------
def level_features(schedule, stats, padding: str = "varlen") -> list[tuple[int, np.ndarray, int]]:
    """``[(SP degree, per-rank features [S_k, D, M_k, 4], samples)]`` per level of a (multi-level) schedule
    (``M_k``: the level's micro-batches per step)."""
    feats = schedule.features(stats, padding=padding)
    sizes = np.diff(schedule.pack_offsets)[schedule.pack_ids].sum(axis=2) * schedule.leader_mask()  # [S, D]
    if schedule.levels is None:
        return [(1, feats, int(sizes.sum()))]
    levels = np.asarray(schedule.levels)
    counts = schedule.level_microbatches or (schedule.num_microbatches,) * len(schedule.level_sp)
    return [(d, per_rank_features(feats[levels == k][:, :, :counts[k]], d), int(sizes[levels == k].sum()))
            for k, d in enumerate(schedule.level_sp) if (levels == k).any()]


def level_a2a(ctx: HBPContext, hbp: HBPPlanConfig, degree: int) -> np.ndarray:
    """A level's all-to-all seconds per layer (:func:`ulysses_a2a_time`) on this job's model and links."""
    return ulysses_a2a_time(ctx.table, ctx.spec, ctx.hardware, degree, tp_size=ctx.sim_config.tp_size,
                            dtype_bytes=hbp.dtype_bytes)


def choose_partition(ctx: HBPContext, hbp: HBPPlanConfig, level_feats) -> tuple[int, ...]:
    """One partition for every level: the joint min-max optimum over all levels' per-rank micro-batches
    (time: their mean; memory: the largest), each level's all-to-all included at its share."""
    everything = np.concatenate([f.reshape(-1, 4) for _, f, _ in level_feats])
    weights = np.array([f[..., 0].size for _, f, _ in level_feats], np.float64)
    a2a = sum(w * level_a2a(ctx, hbp, d) for w, (d, _, _) in zip(weights, level_feats)) / weights.sum()
    planner = JointPlanner(layer_quantities(sp_table(ctx.table, a2a), everything, ctx.stage_config),
                           ctx.stage_config)
    return tuple(planner.plan().parts)


def level_planner(ctx: HBPContext, table: LayerCostTable, feats) -> JointPlanner:
    """The joint planner of one level's micro-batches ``feats`` with its SP-adjusted ``table``."""
    return JointPlanner(layer_quantities(table, feats, ctx.stage_config), ctx.stage_config)


def level_stage_plan(planner: JointPlanner, parts, recompute: str = "adaptive"):
    """A level's stages on ``parts``: the joint planner's ``recompute`` (``adaptive``: the least that fits),
    else full recompute."""
    return planner.evaluate(parts, recompute) or planner.evaluate(parts, "full")


def level_recompute_mask(ctx: HBPContext, table: LayerCostTable, feats, parts, recompute: str = "adaptive"):
    """The checkpointed layers of one level's micro-batches ``feats`` on ``parts`` (:func:`level_stage_plan`)."""
    return level_stage_plan(level_planner(ctx, table, feats), parts, recompute).recompute_mask(table.num_layers)


def simulate_levels(ctx: HBPContext, hbp: HBPPlanConfig, level_feats, lengths, *, name: str, parts=None,
                    recompute: str = "adaptive", dropped: int = 0, masks=None, origin: str = "levels") -> HBPRow:
    """Simulate every level's steps with its SP degree and its own recompute (``adaptive``: the least that
    fits its micro-batches; ``full``; or the given per-level ``masks``) on one partition (None:
    :func:`choose_partition`)."""
    parts = tuple(parts) if parts is not None else choose_partition(ctx, hbp, level_feats)
    results = []
    for k, (length, (d, feats, samples)) in enumerate(zip(lengths, level_feats)):
        a2a = level_a2a(ctx, hbp, d)
        table = sp_table(ctx.table, a2a)
        mask = recompute_codes(masks[k]) if masks is not None else level_recompute_mask(
            ctx, table, feats, parts, recompute)
        res = simulate_epoch(table, parts, mask, feats, ctx.sim_config)
        busy = float(res.busy.sum())
        comm = float(feats.reshape(-1, feats.shape[-1]).sum(axis=0) @ a2a.sum(axis=0))  # device-seconds, as busy
        results.append(LevelResult(
            length=int(length), sp=int(d), steps=int(len(feats)), microbatches=int(feats.shape[2]), samples=samples,
            checkpointed=int((mask == RECOMPUTE_FULL).sum()), selective=int((mask == RECOMPUTE_SELECTIVE).sum()),
            time_s=res.total_time * ctx.epoch_scale, a2a_share=comm / busy if busy > 0 else 0.0,
            oom_steps=int(res.oom.any(axis=(1, 2)).sum()) if res.oom is not None else 0,
            recompute_mask=tuple(int(c) for c in mask)))
    total = sum(r.time_s for r in results)
    return HBPRow(name=name, levels=tuple(results), epoch_time_s=total,
                  gpu_days=total * ctx.num_gpus / SECONDS_PER_DAY, parts=parts,
                  oom_steps=sum(r.oom_steps for r in results), dropped=dropped, origin=origin)


@dataclass(frozen=True, kw_only=True)
class HBPPlanResult:
    """Baseline, single-level omnibal packing and HBP, as simulated."""

    rows: tuple[HBPRow, ...]
    model: LevelCostModel
    """The level cost model the levels were chosen with."""
    schedule: Schedule
    """The HBP schedule (of the balanced samples): the winner's, single-level when a single level won."""
    tried: tuple[dict, ...] = ()
    """``{"lengths", "sp", "gpu_days", "origin", "sp_trials"}`` of every packing the simulator compared for the
    hbp row (``sp_trials``: per level, ``[degree, simulated seconds of the level]`` of each degree tried)."""
    single: Candidate | None = None
    """The single-level row's candidate (the bound re-runs its features)."""
    bound: object = None
    """An ``omnibal.hbp.bound.HBPBound`` when computed (``omnibal.jobs.hbp``; the bound module builds on this
    one, so the type is not imported here)."""
    notes: tuple[str, ...] = ()
    """Why a candidate was not tried (e.g. the plain plan on data one rank cannot hold)."""

    def row(self, name: str) -> HBPRow:
        return next(r for r in self.rows if r.name == name)

    def ablation(self) -> list[dict]:
        """HBP's own ablation (its paper's Table 6 order): naive packing, + hierarchical (the levels, packed
        naively), + balance (HBP), each with GPU days and its speed-up over naive packing."""
        naive = self.row(NAIVE).gpu_days
        steps = (("naive packing", NAIVE), ("+ hierarchical", HIERARCHICAL), ("+ balance", "hbp"))
        return [{"step": step, "row": name, "gpu_days": self.row(name).gpu_days,
                 "speedup": naive / self.row(name).gpu_days} for step, name in steps]

    def to_dict(self) -> dict:
        m = self.model
        return {"rows": [r.to_dict() for r in self.rows],
                "model": {"sp_degrees": list(m.sp_degrees), "a2a_s_per_token": list(m.a2a_per_token),
                          "max_tokens_per_rank": int(m.max_tokens_per_rank)},
                "level_sets_tried": list(self.tried),
                "speedup_hbp_vs_single": self.row("single level").gpu_days / self.row("hbp").gpu_days,
                "speedup_hbp_vs_naive": self.row(NAIVE).gpu_days / self.row("hbp").gpu_days,
                "speedup_hbp_vs_baseline": self.row("baseline").gpu_days / self.row("hbp").gpu_days,
                "ablation": self.ablation(),
                "bound": None if self.bound is None else self.bound.to_dict(), "notes": list(self.notes)}


def group_level(schedule, stats, degree: int, padding: str = "varlen") -> tuple[int, np.ndarray, int]:
    """A single-level ``schedule`` balanced for ``dp_size / degree`` SP groups as one level of
    :func:`level_features`: each group's micro-batches on its ``degree`` ranks, split over them."""
    feats = per_rank_features(np.repeat(schedule.features(stats, padding=padding), degree, axis=1), degree)
    return degree, feats, int(len(stats) - len(schedule.dropped))


def baseline_row(ctx: HBPContext, hbp: HBPPlanConfig, stats, model: LevelCostModel) -> HBPRow:
    """Random micro-batches of ``baseline_batch_size`` padded to the longest, one SP degree for all (the
    smallest whose run fits memory on the even partition: the per-rank token limit is for the best partition,
    so a degree it allows can still overflow a stage of the even one), even partition, full recompute."""
    longest = int(stats.tokens.max()) * hbp.baseline_batch_size
    degrees = model.feasible_sp(longest) or model.sp_degrees[-1:]
    parts = even_partition(ctx.table.num_layers, ctx.stage_config.num_stages)
    row = None
    for d in degrees:
        sched = balance(stats, dp_size=ctx.dp_size // d, num_microbatches=ctx.num_microbatches, seed=ctx.seed,
                        config=BalanceConfig(method="random", batch_size=hbp.baseline_batch_size, cost=model.cost))
        row = simulate_levels(ctx, hbp, [group_level(sched, stats, d, "pad_to_longest")], [longest],
                              name="baseline", parts=parts, recompute="full")
        if row.oom_steps == 0:
            break
    return row


def naive_row(ctx: HBPContext, hbp: HBPPlanConfig, stats, model: LevelCostModel, length: int,
              config) -> HBPRow:
    """HBP's naive packing as its paper measures against: one pack length (``length``, the longest level),
    the reference ISF packs (random packs filled to the length under no cost, dealt to ranks in contiguous
    blocks; ``BalanceConfig(method="isf")``), and the fewest checkpointed layers that fit memory. Every SP
    degree whose share of ``length`` fits a rank is tried, each step holding the tokens per rank of
    ``config``'s micro-batch rule (:func:`omnibal.hbp.balance.level_microbatch_counts`); the fastest that fits
    is kept (the degree a user would tune)."""
    from omnibal.hbp.balance import level_microbatch_counts

    best = None
    for d in model.feasible_sp(length) or model.sp_degrees[-1:]:  # the model's degrees divide dp_size
        mbs = level_microbatch_counts((length,), (d,), ctx.num_microbatches, config.microbatches,
                                      config.step_tokens, config.min_microbatches)[0]
        sched = balance(stats, dp_size=ctx.dp_size // d, num_microbatches=mbs, seed=ctx.seed,
                        config=BalanceConfig(method="isf", max_tokens=int(length),
                                             max_tiles=int(stats.tiles.sum()) + 1, cost=model.cost))
        row = simulate_levels(ctx, hbp, [group_level(sched, stats, d)], [length], name=NAIVE,
                              recompute="adaptive", dropped=len(sched.dropped))
        if best is None or row.rank < best.rank:
            best = row
    return best


def hierarchical_row(ctx: HBPContext, hbp: HBPPlanConfig, stats, levels_of, config, cache: dict) -> HBPRow:
    """HBP's "+ hierarchical" ablation row: the level lengths and SP degrees of the schedule ``levels_of``,
    each level packed naively (ISF at its length, no balancing), the fewest checkpointed layers that fit."""
    meta = levels_of.meta["hbp"]
    naive = replace(config, pack_lengths=tuple(meta["level_lengths"]), level_sp=tuple(levels_of.level_sp),
                    balance=replace(config.balance, method="isf"))
    return simulate_schedule(ctx, hbp, ctx.balance(stats, naive, cache), stats, name=HIERARCHICAL).row


def simulate_schedule(ctx: HBPContext, hbp: HBPPlanConfig, schedule, stats, *, name: str,
                      recompute: str = "adaptive") -> Candidate:
    """A (multi-level) schedule of :func:`balance_hbp` simulated (:func:`simulate_levels`)."""
    feats = level_features(schedule, stats)
    row = simulate_levels(ctx, hbp, feats, schedule.meta["hbp"]["level_lengths"], name=name, recompute=recompute,
                          dropped=len(schedule.dropped))
    return Candidate(row=row, schedule=schedule, level_feats=tuple(feats))
