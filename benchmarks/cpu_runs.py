"""The CPU trainer runs the simulator and planner benchmarks share: real-statistics subsets in the tiny
model's units, baseline and balanced schedules, one trainer run over local gloo ranks (warm-up + timed
steps, per-rank CPU time), its features for the simulator, and the calibration runs with their fit.

Moved here from ``bench_sim_validation.py`` so that benchmarks share it without importing each other; the held-out
protocol's pieces (``pool`` of :func:`load_real_subset`, ``mb`` micro-batches per step, ``'vision'`` recompute)
are optional arguments whose defaults keep the earlier behaviour.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np
import torch

from benchmarks.common import SHARED_STATS, STATS_FILES
from omnibal.cost.presets import get_model_preset
from omnibal.cost.table import microbatch_features
from omnibal.data.balance import BalanceConfig, BalanceCost, balance
from omnibal.data.dataset import SyntheticSampleConfig, SyntheticVLMDataset
from omnibal.sim import SimConfig, simulate_epoch
from omnibal.sim.calibrate import CalibrationRun, calibrate, design_matrix, rank_jitter
from omnibal.stats.io import load_stats as read_stats
from omnibal.stats.table import SampleStats
from omnibal.train.distributed import destroy_world, init_world, spawn_local
from omnibal.train.feed import Buffer, fixed_buffer, random_microbatch_schedule
from omnibal.train.loop import Trainer
from omnibal.train.model import VLM
from omnibal.train.stage_layout import even_split, resolve_layout

MODEL = "tiny"
NUM_MB = 4
BATCH = 4
CAL_SEED, VAL_SEED = 1001, 0
POOL_SEED = 20261124
"""Seed of the one shuffle that cuts the real rows into the calibration and the validation pool (docs/sim.md)."""
POOLS = ("calibration", "validation")


# ------------------------------------------------------------------------------------------------ data


def load_real_subset(num_samples: int, seed: int, pool: str | None = None):
    """A random subset of the real InternVL-1.2M statistics, in the files' units (256 tokens per tile).

    ``pool``: ``"calibration"`` / ``"validation"`` draws from that half of the fixed shuffle (``POOL_SEED``) only,
    the held-out protocol of docs/sim.md; None draws from all rows."""
    if pool is not None and pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS} or None, got {pool!r}")
    parts = [read_stats(SHARED_STATS / f) for f in STATS_FILES]
    stats = SampleStats.concat(parts, source="internvl-1.2m-stats (ai2d + chartqa)")
    candidates = np.arange(len(stats))
    if pool is not None:
        halves = np.array_split(np.random.default_rng(POOL_SEED).permutation(len(stats)), 2)
        candidates = halves[POOLS.index(pool)]
    rows = np.sort(np.random.default_rng(seed).choice(candidates, size=num_samples, replace=False))
    label = f" {pool} pool" if pool else ""
    return replace(stats.take(rows), source=f"{stats.source}{label} subset {num_samples} seed {seed}")


def load_stats(num_samples: int, seed: int, pool: str | None = None):
    """:func:`load_real_subset` with tokens as the tiny model counts them (what its balancer and trainer see)."""
    return model_units(load_real_subset(num_samples, seed, pool))


def model_units(stats):
    """``stats`` with tokens as the tiny model counts them."""
    spec = get_model_preset(MODEL)
    tokens = spec.sample_tokens(stats.tiles, stats.tokens, images=stats.images)
    return SampleStats(tiles=stats.tiles, tokens=tokens, images=stats.images, keys=stats.keys,
                       source=f"{stats.source}, tokens for {MODEL}")


def baseline_schedule(stats, dp: int, num_steps: int, seed: int, mb: int = NUM_MB):
    """Random rows of ``BATCH`` samples, ``mb`` micro-batches per rank and step (the trainer pads them)."""
    return random_microbatch_schedule(len(stats), dp_size=dp, num_microbatches=mb, batch_size=BATCH, seed=seed,
                                      num_steps=num_steps)


def balanced_schedule(stats, dp: int, seed: int, table, mb: int = NUM_MB):
    """omnibal's balanced packs under ``table``, ``mb`` micro-batches per rank and step."""
    return balance(stats, dp_size=dp, num_microbatches=mb, seed=seed,
                   config=BalanceConfig(method="omnibal", cost=BalanceCost.from_cost_table(table)))


def step_features(schedule, stats, num_steps: int, *, padded: bool) -> np.ndarray:
    """``[S, D, M, 4]`` features of what the trainer computes: packs varlen, baseline rows padded."""
    out = np.zeros((num_steps, schedule.dp_size, schedule.num_microbatches, 4))
    for s in range(num_steps):
        for r in range(schedule.dp_size):
            for k in range(schedule.num_microbatches):
                mb = np.asarray(schedule.microbatch(s, r, k))
                t = stats.tokens[mb].astype(np.float64)
                tiles = float(stats.tiles[mb].sum())
                if padded:
                    out[s, r, k] = microbatch_features(tiles, len(mb) * t.max(), len(mb) * t.max() ** 2)
                else:
                    out[s, r, k] = microbatch_features(tiles, t.sum(), (t * t).sum())
    return out


# ------------------------------------------------------------------------------------------------ runs


def rank_run(run: dict, stats, schedule):
    """One rank of a trainer run: warm-up + timed steps; rank 0 returns the step records."""
    torch.set_num_threads(1)

    spec = get_model_preset(MODEL)
    world = init_world(dp_size=run["dp"], pp_size=run["pp"], timeout_s=300)
    dataset = SyntheticVLMDataset(stats, SyntheticSampleConfig(
        image_size=spec.vision.image_size, tokens_per_tile=spec.llm_tokens_per_tile, vocab_size=spec.llm.vocab_size,
        image_token_id=spec.llm.vocab_size - 1, seed=0))
    model = VLM(spec, seed=0)
    names = [s.name for s, _ in model.chain()]
    layout = resolve_layout(names, pp_size=run["pp"], mode=run["mode"], stage_layers=run["ranges"],
                            recompute=run["recompute_sets"])
    buffer = Buffer(*run["buffer"]) if run["pp"] > 1 else None
    trainer = Trainer(world=world, model=model, layout=layout, schedule=schedule, dataset=dataset, mode=run["mode"],
                      num_microbatches=run["mb"], pp_schedule="1f1b", lr=1e-4, buffer=buffer)
    records, cpu = [], []
    for _ in range(run["steps"]):
        c0 = time.thread_time()  # this rank's own CPU seconds: compute runs on this thread (1 torch thread)
        rec = trainer.train_step()
        cpu.append(time.thread_time() - c0)
        if rec is not None:
            records.append({"step_s": rec.step_s, "ranks": rec.ranks, "load": os.getloadavg()[0]})
    destroy_world()
    return {"records": records, "cpu": cpu}


def launch(run: dict, stats, schedule) -> list[dict]:
    """Run ``run`` (from :func:`make_run`) on local gloo ranks; per step: rank 0's record plus every rank's CPU
    seconds (``cpu_s``) and the wall / CPU ``slowdown`` of the ranks' own work."""
    results = spawn_local(rank_run, run["dp"] * run["pp"], args=(run, stats, schedule), deadline_s=900,
                          start_method="fork")
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError("\n".join(errors))
    records = results[0].value["records"]
    cpu = np.array([r.value["cpu"] for r in results])  # [ranks, steps]
    for s, rec in enumerate(records):
        busy_wall = sum(r["compute_s"] + r["optim_s"] + r["data_s"] for r in rec["ranks"])
        rec["cpu_s"] = cpu[:, s].tolist()
        # contention: how much longer the ranks' own work took on the wall clock than on their CPU clocks
        rec["slowdown"] = float(busy_wall / max(cpu[:, s].sum(), 1e-9))
    return records


# ------------------------------------------------------------------------------------------------ main


def recompute_mask(names, recompute: str) -> np.ndarray:
    """Per-layer checkpoint mask of ``recompute``: 'full', 'none' or 'vision' (the encoder's layers only)."""
    if recompute == "vision":
        return np.array([n.startswith("vision.") for n in names])
    assert recompute in ("full", "none"), recompute
    return np.full(len(names), recompute == "full")


def make_run(name, *, dp, pp, mode, ranges, recompute, seed, stats, table, steps, names, mb=NUM_MB, schedule=None):
    """Schedule, layout and features of one run (``recompute``: 'full', 'none' or 'vision'; ``mb``
    micro-batches per rank and step). ``schedule``: run these packs instead of building them (a stored run's)."""
    if schedule is not None:
        if (schedule.dp_size, schedule.num_microbatches) != (dp, mb):
            raise ValueError(f"{name}: the given schedule has DP {schedule.dp_size} x {schedule.num_microbatches} "
                             f"micro-batches, the run DP {dp} x {mb}")
        sched = schedule
    elif mode == "baseline":
        sched = baseline_schedule(stats, dp, steps, seed, mb)
    else:
        sched = balanced_schedule(stats, dp, seed, table, mb)
    if ranges is None:
        ranges = even_split(len(names), pp)
    mask = recompute_mask(names, recompute)
    rec_sets = tuple(tuple(n for n, m in zip(names[a:b], mask[a:b]) if m) for a, b in ranges)
    buf = fixed_buffer(sched, stats, mode=mode) if pp > 1 else None
    feats = step_features(sched, stats, steps, padded=mode == "baseline")
    run = {"name": name, "dp": dp, "pp": pp, "mb": mb, "mode": mode, "ranges": [list(r) for r in ranges],
           "recompute_sets": rec_sets, "recompute": recompute, "seed": seed, "steps": steps,
           "buffer": None if buf is None else [buf.tiles, buf.tokens]}
    return run, sched, feats


def simulate_run(run, feats, table, links, overhead, jitter=0.0):
    """The simulator's prediction of ``run`` (from :func:`make_run`) on ``feats`` under ``table`` and ``links``."""
    cuts = [r[0] for r in run["ranges"]] + [run["ranges"][-1][1]]
    rec = recompute_mask(table.names, run["recompute"])
    buffer = None
    if run["buffer"] is not None:
        q_v, q_t = run["buffer"]
        buffer = np.broadcast_to(microbatch_features(q_v, q_t, q_t * q_t), feats.shape)
    cfg = SimConfig(dp_size=run["dp"], p2p_bandwidth=links["p2p_bandwidth"], p2p_latency=links["p2p_latency"],
                    dp_bandwidth=links["dp_bandwidth"], dp_latency=links["dp_latency"], step_overhead=overhead,
                    p2p_occupancy=1.0, compute_jitter=jitter)
    return simulate_epoch(table, cuts, rec, feats, cfg, buffer_features=buffer)


RANK_SPECS = tuple(
    (f"R{i + 1} 1x2 M6 balanced, cut at {k}, {rec} recompute",
     dict(dp=1, pp=2, mb=6, mode="offline", ranges=((0, k), (k, 15)), recompute=rec))
    for i, (k, rec) in enumerate(((4, "none"), (8, "none"), (11, "none"), (8, "full"))))
"""The candidate plans (partition x recompute) of one job the simulator must rank as measured (docs/sim.md's
protocol; bench_sim_validation measures them beside its other runs, bench_sim_ranking alone)."""


CAL_SPECS = (
    ("cal: 1x1 baseline, full recompute", dict(dp=1, pp=1, mode="baseline", ranges=None, recompute="full")),
    ("cal: 1x1 balanced, no recompute", dict(dp=1, pp=1, mode="offline", ranges=None, recompute="none")),
    # each rank's CPU time covers its stage's layers only: separates the vision from the LLM scale
    ("cal: 1x2 balanced, even split, no recompute (per-rank CPU)",
     dict(dp=1, pp=2, mode="offline", ranges=None, recompute="none")),
    # a rank of a multi-rank run computes slower than a rank alone (4-17% on this VM): DP runs of both kinds
    # and the pipeline run above fit the shared-core factor; the DP runs also give the stragglers' jitter
    ("cal: 2x1 balanced, no recompute (per-rank CPU)", dict(dp=2, pp=1, mode="offline", ranges=None, recompute="none")),
    ("cal: 2x1 baseline, full recompute (per-rank CPU)",
     dict(dp=2, pp=1, mode="baseline", ranges=None, recompute="full")),
)
"""Calibration runs (name, make_run arguments), run on the calibration data (``CAL_SEED``): the default of
:class:`CalibrationData` (bench_sim_validation's held-out protocol has its own)."""


class CalibrationData:
    """What the calibration runs measured, gathered over rounds; :meth:`fit` gives the calibrated tables.
    ``specs``: the calibration runs of a round (name, :func:`make_run` arguments)."""

    def __init__(self, table, names, stats, steps: int, specs=CAL_SPECS) -> None:
        self.table, self.names, self.stats, self.steps, self.specs = table, names, stats, steps, tuple(specs)
        self.runs: list = []  # CalibrationRun per rank and run
        self.rows: list[dict] = []  # one table row per rank and run (same order as ``runs``)
        self.dp_runs: list = []  # (features [S, D, M, 4], recompute mask, per-rank CPU [S, D]) of each DP run

    def run_round(self, rep: int, log) -> None:
        """Every calibration run once (one round)."""
        for name, kw in self.specs:
            self.run_one(name, kw, rep, log)

    def run_one(self, name: str, kw: dict, rep: int, log) -> None:
        """One calibration run (``name``, ``kw`` as in ``specs``) of round ``rep``."""
        run, sched, feats = make_run(name, seed=CAL_SEED, stats=self.stats, table=self.table, steps=self.steps,
                                     names=self.names, **kw)
        log(f"running {name} (round {rep + 1})")
        records = launch(run, self.stats, sched)[1:]
        wall = np.array([r["step_s"] for r in records])
        rec_mask = recompute_mask(self.names, run["recompute"])
        if run["dp"] > 1 and run["pp"] == 1:  # per-rank times of a DP run: the stragglers' jitter
            self.dp_runs.append((feats[1:], rec_mask, np.array([r["cpu_s"] for r in records])))
        for rank in range(run["dp"] * run["pp"]):
            dp_rank, stage = divmod(rank, run["pp"])  # global rank = dp_rank * pp + stage
            a, b = run["ranges"][stage]
            cpu = np.array([r["cpu_s"][rank] for r in records])  # the rank's own compute
            layers = None if run["pp"] == 1 else (a, b)
            self.runs.append(CalibrationRun(feats[1:, dp_rank], rec_mask, cpu, layers=layers,
                                            shared_host=run["dp"] * run["pp"] > 1))
            where = (f", DP rank {dp_rank}" if run["dp"] > 1 else "") + (
                "" if layers is None else f", stage {stage} (layers {a}-{b - 1})")
            self.rows.append({"name": name + where, "steps": len(cpu), "cpu_s": float(cpu.sum()),
                              "wall_s": float(wall.sum()), "load": float(np.mean([r["load"] for r in records])),
                              "repeat": rep})

    def fit(self, groups=("vision", "llm"), separate_backward: bool = False):
        """``(calibration, table alone, table on shared cores, rank jitter)``; the jitter pools the DP runs
        (each compared with the table under its own recompute mask)."""
        cal = calibrate(self.table, self.runs, groups=tuple(groups), separate_backward=separate_backward)
        alone, shared = cal.apply(self.table), cal.apply(self.table, shared_host=True)
        variances, weights = [], []
        for feats, mask, cpu in self.dp_runs:
            variances.append(rank_jitter(shared, feats, mask, cpu) ** 2)
            weights.append(len(cpu))
        jitter = float(np.sqrt(np.average(variances, weights=weights))) if variances else 0.0
        return cal, alone, shared, jitter

    def residuals(self, cal) -> dict[str, float]:
        """Per calibration run and rank (over the rounds): measured / fitted CPU time - 1. What the fit cannot
        follow shows here as a bias of one kind of run; noise averages out over the rounds."""
        ratios: dict[str, list[tuple[float, float]]] = {}
        for run, row in zip(self.runs, self.rows):
            table = cal.apply(self.table, shared_host=run.shared_host)
            pred = design_matrix(table, run, ("all",), separate_backward=False)[:, 0] + cal.step_overhead
            ratios.setdefault(row["name"], []).append((float(run.step_times.sum()), float(pred.sum())))
        return {name: sum(m for m, _ in v) / sum(p for _, p in v) - 1.0 for name, v in ratios.items()}
