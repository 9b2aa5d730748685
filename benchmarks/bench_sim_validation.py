"""Validate the step-time simulator against measured steps of the reference trainer on CPU (held out).

Implements the protocol of docs/sim.md ("Validation protocol", committed before its first run):

* the real InternVL-1.2M rows are cut by one fixed shuffle into a calibration pool and a validation pool;
  calibration draws only from the first, validation only from the second (disjoint keys, checked);
* **calibration** (``CAL_SPECS``): DP 1 and DP 2 whole-model runs at 4 micro-batches, baseline + full
  recompute and balanced + none; ``omnibal.sim.calibrate`` fits one overall scale of a measured layer profile,
  the per-step overhead and the shared-host factor from each rank's own CPU time, and the rank jitter;
  the gloo links are measured separately by ``sim_links.py`` (message ping-pong, not steps);
* **validation** (``VAL_SPECS``, ``RANK_SPECS``): micro-batch counts never calibrated (6, 8), the DP 1 x PP 2
  layout and pipeline partitions never calibrated, and four candidate plans (partition x recompute) of one
  job that the simulator must rank as measured.

For every run the simulator is given exactly the micro-batches the trainer ran (same indices, same
padding: baseline rows padded to the longest sample, packs varlen; a pipeline's p2p buffers at the fixed
shape). Measured and predicted time are the sums over the timed steps (the first step of each run is a
warm-up and is dropped). Error = predicted / measured - 1. Runs are repeated in rounds, each holding every
run once in a seeded random order, so that calibration and validation see the same drift of this VM's speed.

    PYTHONPATH=src python benchmarks/bench_sim_validation.py [--steps 8] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from omnibal.cost.table import microbatch_features  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_CANDIDATES = [Path(os.environ["OMNIBAL_SHARED_STATS"])] if "OMNIBAL_SHARED_STATS" in os.environ else [
    up / "shared" / "data" / "internvl-1.2m-stats" for up in (ROOT.parent, ROOT.parent.parent)]  # checkout, worktree
SHARED_STATS = next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0])
STATS_FILES = ("ai2d_train_12k_wh_token_lengths.json", "chartqa_train_18k_wh_token_lengths.json")
MODEL = "tiny"
NUM_MB = 4
BATCH = 4
CAL_SEED, VAL_SEED = 1001, 0


# ------------------------------------------------------------------------------------------------ data


POOL_SEED = 20261124
"""Seed of the one shuffle that cuts the real rows into the calibration and the validation pool (docs/sim.md)."""


def load_real_subset(num_samples: int, seed: int, pool: str | None = None):
    """A random subset of the real InternVL-1.2M statistics, in the files' units (256 tokens per tile).

    ``pool``: ``"calibration"`` / ``"validation"`` draws from that half of the fixed shuffle only (the held-out
    protocol of docs/sim.md); None draws from all rows."""
    from omnibal.stats.io import load_stats as read
    from omnibal.stats.table import SampleStats

    parts = [read(SHARED_STATS / f) for f in STATS_FILES]
    stats = SampleStats.concat(parts, source="internvl-1.2m-stats (ai2d + chartqa)")
    candidates = np.arange(len(stats))
    if pool is not None:
        halves = np.array_split(np.random.default_rng(POOL_SEED).permutation(len(stats)), 2)
        candidates = halves[("calibration", "validation").index(pool)]
    rows = np.sort(np.random.default_rng(seed).choice(candidates, size=num_samples, replace=False))
    label = f" {pool} pool" if pool else ""
    return replace(stats.take(rows), source=f"{stats.source}{label} subset {num_samples} seed {seed}")


def load_stats(num_samples: int, seed: int, pool: str | None = None):
    """:func:`load_real_subset` with tokens as the tiny model counts them (what its balancer and trainer see)."""
    return model_units(load_real_subset(num_samples, seed, pool))


def model_units(stats):
    """``stats`` with tokens as the tiny model counts them."""
    from omnibal.cost.presets import get_model_preset
    from omnibal.stats.table import SampleStats

    spec = get_model_preset(MODEL)
    tokens = spec.sample_tokens(stats.tiles, stats.tokens, images=stats.images)
    return SampleStats(tiles=stats.tiles, tokens=tokens, images=stats.images, keys=stats.keys,
                       source=f"{stats.source}, tokens for {MODEL}")


def baseline_schedule(stats, dp: int, num_steps: int, seed: int, mb: int = NUM_MB):
    from omnibal.train.feed import random_microbatch_schedule

    return random_microbatch_schedule(len(stats), dp_size=dp, num_microbatches=mb, batch_size=BATCH, seed=seed,
                                      num_steps=num_steps)


def balanced_schedule(stats, dp: int, seed: int, table, mb: int = NUM_MB):
    from omnibal.data.balance import BalanceConfig, BalanceCost, balance

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
    import torch

    torch.set_num_threads(1)
    from omnibal.cost.presets import get_model_preset
    from omnibal.data.dataset import SyntheticSampleConfig, SyntheticVLMDataset
    from omnibal.train.distributed import destroy_world, init_world
    from omnibal.train.loop import Buffer, Trainer
    from omnibal.train.model import VLM
    from omnibal.train.pipeline import resolve_layout

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
                      num_microbatches=run["mb"], pipeline_schedule="1f1b", lr=1e-4, buffer=buffer)
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
    from omnibal.train.distributed import spawn_local

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


def make_run(name, *, dp, pp, mode, ranges, recompute, seed, stats, table, steps, names, mb=NUM_MB):
    """Schedule, layout and features of one run (``recompute``: 'full', 'none' or 'vision')."""
    from omnibal.train.loop import fixed_buffer

    if mode == "baseline":
        sched = baseline_schedule(stats, dp, steps, seed, mb)
    else:
        sched = balanced_schedule(stats, dp, seed, table, mb)
    if ranges is None:
        from omnibal.train.pipeline import even_split

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
    from omnibal.sim import SimConfig, simulate_epoch

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


CAL_SPECS = (
    # the held-out protocol of docs/sim.md: whole-model layouts at 4 micro-batches only
    ("C1 1x1 M4 baseline, full recompute", dict(dp=1, pp=1, mb=4, mode="baseline", ranges=None, recompute="full")),
    ("C2 1x1 M4 balanced, no recompute", dict(dp=1, pp=1, mb=4, mode="omnibal", ranges=None, recompute="none")),
    # a rank of a multi-rank run computes slower than a rank alone: the DP runs fit the shared-core factor
    # and give the stragglers' jitter
    ("C3 2x1 M4 balanced, no recompute", dict(dp=2, pp=1, mb=4, mode="omnibal", ranges=None, recompute="none")),
    ("C4 2x1 M4 baseline, full recompute", dict(dp=2, pp=1, mb=4, mode="baseline", ranges=None, recompute="full")),
)
"""Calibration runs (name, make_run arguments), run on the calibration data (``CAL_SEED``)."""

VAL_SPECS = (
    ("V1 1x1 M8 balanced, vision recompute", dict(dp=1, pp=1, mb=8, mode="omnibal", ranges=None, recompute="vision")),
    ("V2 1x1 M6 baseline, no recompute", dict(dp=1, pp=1, mb=6, mode="baseline", ranges=None, recompute="none")),
    ("V3 2x1 M6 balanced, full recompute", dict(dp=2, pp=1, mb=6, mode="omnibal", ranges=None, recompute="full")),
    ("V4 1x2 M6 baseline, cut at 8 (even), full recompute",
     dict(dp=1, pp=2, mb=6, mode="baseline", ranges=((0, 8), (8, 15)), recompute="full")),
)
"""Validation runs (docs/sim.md): every one has a micro-batch count, and the pipeline ones a layout and partition,
that no calibration run has; run on the validation data (``VAL_SEED``, the other pool)."""

RANK_SPECS = tuple(
    (f"R{i + 1} 1x2 M6 balanced, cut at {k}, {rec} recompute",
     dict(dp=1, pp=2, mb=6, mode="omnibal", ranges=((0, k), (k, 15)), recompute=rec))
    for i, (k, rec) in enumerate(((4, "none"), (8, "none"), (11, "none"), (8, "full"))))
"""The candidate plans (partition x recompute) of one job the simulator must rank as measured."""


class CalibrationData:
    """What the calibration runs measured, gathered over rounds; :meth:`fit` gives the calibrated tables."""

    def __init__(self, table, names, stats, steps: int) -> None:
        self.table, self.names, self.stats, self.steps = table, names, stats, steps
        self.runs: list = []  # CalibrationRun per rank and run
        self.rows: list[dict] = []  # one table row per rank and run (same order as ``runs``)
        self.dp_runs: list = []  # (features [S, D, M, 4], recompute mask, per-rank CPU [S, D]) of each DP run

    def run_round(self, rep: int, log) -> None:
        """Every calibration run once (one round)."""
        for name, kw in CAL_SPECS:
            self.run_one(name, kw, rep, log)

    def run_one(self, name: str, kw: dict, rep: int, log) -> None:
        """One calibration run (``name``, ``kw`` from :data:`CAL_SPECS`) of round ``rep``."""
        from omnibal.sim.calibrate import CalibrationRun

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
        from omnibal.sim.calibrate import calibrate, rank_jitter

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
        from omnibal.sim.calibrate import design_matrix

        ratios: dict[str, list[tuple[float, float]]] = {}
        for run, row in zip(self.runs, self.rows):
            table = cal.apply(self.table, shared_host=run.shared_host)
            pred = design_matrix(table, run, ("all",), separate_backward=False)[:, 0] + cal.step_overhead
            ratios.setdefault(row["name"], []).append((float(run.step_times.sum()), float(pred.sum())))
        return {name: sum(m for m, _ in v) / sum(p for _, p in v) - 1.0 for name, v in ratios.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (plus one warm-up)")
    ap.add_argument("--samples", type=int, default=3000, help="rows of the real stats used per seed")
    ap.add_argument("--quick", action="store_true", help="calibration + two validation runs only")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--table", choices=("profile", "analytic"), default="profile",
                    help="base cost table: measured layer profile (default) or the analytic model")
    ap.add_argument("--profile-repeats", type=int, default=3)
    ap.add_argument("--separate-backward", action="store_true",
                    help="fit forward and backward scales separately")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of all calibration and validation runs (mixed order; validation averaged)")
    ap.add_argument("--groups", default="all", help="layer groups with their own scale: 'all' (default: the "
                    "protocol of docs/sim.md fixes it) or 'vision,llm'")
    args = ap.parse_args()

    from omnibal.cost.analytic import analytic_cost_table
    from omnibal.cost.hardware import get_hardware
    from omnibal.cost.presets import get_model_preset
    from sim_links import measure_links

    spec = get_model_preset(MODEL)
    names = [layer.name for layer in spec.layers()]
    steps = args.steps + 1
    t_start = time.time()
    log = lambda msg: print(f"[{time.time() - t_start:6.0f}s load {os.getloadavg()[0]:.1f}] {msg}",  # noqa: E731
                            file=sys.stderr, flush=True)
    if args.table == "profile":
        from omnibal.cost.profile import cost_table_from_profile, measure

        log("profiling the layers (omnibal.cost.profile, CPU time per op)")
        profile = measure(spec, threads=1, statistic="cpu", repeats=args.profile_repeats)
        table = cost_table_from_profile(spec, profile)
    else:
        table = analytic_cost_table(spec, get_hardware("cpu", threads=1), dtype="fp32")

    cal_stats = load_stats(args.samples, CAL_SEED, "calibration")
    val_stats = load_stats(args.samples, VAL_SEED, "validation")
    shared_keys = np.intersect1d(cal_stats.keys, val_stats.keys)
    if len(shared_keys):
        raise SystemExit(f"calibration and validation data share {len(shared_keys)} samples: not held out")
    log("measuring gloo links")
    links = measure_links()
    log(f"links: p2p {links['p2p_latency'] * 1e3:.2f} ms + {links['p2p_bandwidth'] / 1e9:.2f} GB/s, all-reduce "
        f"{links['dp_latency'] * 1e3:.2f} ms + {links['dp_bandwidth'] / 1e9:.2f} GB/s")
    common = dict(table=table, steps=steps, names=names)
    val_specs, rank_specs = list(VAL_SPECS), list(RANK_SPECS)
    if args.quick:
        val_specs, rank_specs = val_specs[:1], rank_specs[:2]

    # Calibration and validation runs in a random order in every round: this machine's speed drifts by 10-25%
    # over minutes (a fixed GEMM loop varies that much, with no steal time or load to show for it), so
    # calibrating in one block of time and validating in another would measure the drift, not the simulator.
    calib = CalibrationData(table, names, cal_stats, steps)
    runs = []
    order_rng = np.random.default_rng(0)
    for rep in range(args.repeats):
        jobs = [("cal", name, kw) for name, kw in CAL_SPECS] + [("val", name, kw) for name, kw in val_specs + rank_specs]
        for kind, name, kw in [jobs[i] for i in order_rng.permutation(len(jobs))]:
            if kind == "cal":
                calib.run_one(name, kw, rep, log)
                continue
            run, sched, feats = make_run(name, seed=VAL_SEED, stats=val_stats, **kw, **common)
            log(f"running {name} (repeat {rep + 1}/{args.repeats})")
            records = launch(run, val_stats, sched)[1:]
            wall = np.array([r["step_s"] for r in records])
            slowdown = np.array([r["slowdown"] for r in records])
            runs.append((name, run, feats, wall, slowdown, float(np.mean([r["load"] for r in records]))))
            log(f"{name}: wall {wall.sum():.2f} s, slowdown {slowdown.mean():.2f}, "
                f"measured {(wall / slowdown).sum():.2f} s")
    # the ranks of a multi-rank run share this machine's cores
    cal, ctable, ctable_shared, jitter = calib.fit(args.groups.split(","), args.separate_backward)
    log(f"calibration: {cal.to_dict()}, rank jitter {jitter:.3f}")

    rows = []
    for name, _kw in val_specs + rank_specs:
        mine = [r for r in runs if r[0] == name]
        _, run, feats, _, _, _ = mine[0]
        shared = run["dp"] * run["pp"] > 1
        sim = simulate_run(run, feats[1:], ctable_shared if shared else ctable, links["wall_clock"], cal.step_overhead,
                           jitter)
        pred = sim.step_time
        per_rep = [wall.sum() for _, _, _, wall, _, _ in mine]
        # the same steps on the same data each time: average the repeats step by step
        wall = np.mean([r[3] for r in mine], axis=0)
        slowdown = np.mean([r[4] for r in mine], axis=0)
        measured = np.mean([r[3] / r[4] for r in mine], axis=0)
        rows.append({"name": name, "dp": run["dp"], "pp": run["pp"], "mb": run["mb"], "mode": run["mode"], "ranges": run["ranges"],
                     "recompute": run["recompute"], "steps": len(measured), "repeats": len(mine),
                     "wall_repeats_s": [float(x) for x in per_rep], "wall_s": float(wall.sum()),
                     "slowdown": float(slowdown.mean()), "normalised_s": float(measured.sum()),
                     "predicted_s": float(pred.sum()), "error": float(pred.sum() / wall.sum() - 1.0),
                     "error_normalised": float(pred.sum() / measured.sum() - 1.0),
                     "step_errors": (pred / wall - 1.0).tolist(), "bubble_pred": float(sim.bubble.mean()),
                     "load": float(np.mean([r[5] for r in mine])), "ranking": name in dict(rank_specs)})
        log(f"{name}: measured {wall.sum():.2f} s (repeats {np.round(per_rep, 2).tolist()}), predicted "
            f"{pred.sum():.2f} s, error {rows[-1]['error']:+.1%}")

    write_results(Path(args.out), links, cal, calib.rows, rows, args, jitter, calib.residuals(cal),
                  profile if args.table == "profile" else None)


def kendall_tau(a, b) -> float:
    """Kendall's tau between two score lists (1: same order, -1: reversed)."""
    n, total = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            total += np.sign(a[i] - a[j]) * np.sign(b[i] - b[j])
    return float(total / max(n * (n - 1) / 2, 1))


def summary(rows: list[dict]) -> dict:
    """The protocol's figures: mean / max |error|, the candidates' order, and whether each target is met."""
    errs = np.array([abs(r["error"]) for r in rows])
    ranked = [r for r in rows if r["ranking"]]
    by_meas = [r["name"] for r in sorted(ranked, key=lambda r: r["wall_s"])]
    by_pred = [r["name"] for r in sorted(ranked, key=lambda r: r["predicted_s"])]
    walls = sorted(r["wall_s"] for r in ranked)
    return {"mean_abs_error": float(errs.mean()), "max_abs_error": float(errs.max()), "runs": len(rows),
            "measured_order": by_meas, "predicted_order": by_pred, "same_order": by_meas == by_pred,
            "kendall_tau": kendall_tau([r["wall_s"] for r in ranked], [r["predicted_s"] for r in ranked]),
            "measured_gaps_s": [float(b - a) for a, b in zip(walls, walls[1:])],
            "targets": {"mean_abs_error <= 5%": bool(errs.mean() <= 0.05), "max_abs_error <= 10%": bool(errs.max() <= 0.10),
                        "candidates ranked as measured": by_meas == by_pred}}


def write_results(out: Path, links, cal, cal_rows, rows, args, jitter: float, residuals: dict[str, float],
                  profile: dict | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summ = summary(rows)
    doc = {"protocol": "docs/sim.md, 'Validation protocol (held out)'", "model": MODEL, "baseline_batch": BATCH,
           "timed_steps": args.steps, "samples_per_seed": args.samples, "repeats": args.repeats, "table": args.table,
           "pool_seed": POOL_SEED, "calibration_seed": CAL_SEED, "validation_seed": VAL_SEED, "summary": summ,
           "links": {k: v for k, v in links.items() if k != "raw"},
           "calibration": {**cal.to_dict(), "rank_jitter": jitter, "residuals": residuals, "runs": cal_rows},
           "validation": rows, "profile": profile}
    (out / "sim_validation.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [
        "# Simulator validation against the reference trainer (CPU, gloo), held out", "",
        "Protocol: `docs/sim.md`, section *Validation protocol*, committed before this run. Model `tiny`; one torch "
        f"thread per rank; data: {args.samples} rows per seed of the real InternVL-1.2M statistics, calibration from "
        f"one half of a fixed shuffle (seed {POOL_SEED}) and validation from the other (disjoint keys, checked). "
        f"Each run: one warm-up step, then {args.steps} timed steps (sums below). {args.repeats} rounds, each holding "
        "every calibration and validation run once in a seeded random order. Produced by "
        "`benchmarks/bench_sim_validation.py`.", "",
        f"## Calibration (calibration pool, seed {CAL_SEED})", "",
        "| run | repeat | steps | CPU s | wall s | load |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['repeat'] + 1} | {r['steps']} | {r['cpu_s']:.2f} | {r['wall_s']:.2f} | "
              f"{r['load']:.1f} |" for r in cal_rows]
    scales = ", ".join(f"{g} {f:.3f}" for g, f in zip(cal.groups, cal.fwd_scale))
    lines += ["", "Fit residual per calibration run (measured / fitted CPU time - 1, over the rounds): " + "; ".join(
        f"{name} {r:+.1%}" for name, r in residuals.items()) + ".", "",
        f"Base table: {'measured layer profile (CPU time per op)' if args.table == 'profile' else 'analytic'}; "
        f"fitted scale ({', '.join(cal.groups)}): {scales}; shared-core factor {cal.shared_host_scale:.3f}; step "
        f"overhead {cal.step_overhead * 1e3:.1f} ms; fit RMS error {cal.rel_rms_error:.1%} over {cal.num_steps} steps; "
        f"rank jitter {jitter:.1%}. Links (wall clock): p2p {links['wall_clock']['p2p_latency'] * 1e3:.2f} ms + bytes / "
        f"{links['wall_clock']['p2p_bandwidth'] / 1e9:.2f} GB/s, all-reduce {links['wall_clock']['dp_latency'] * 1e3:.2f} "
        f"ms per ring step + bytes / {links['wall_clock']['dp_bandwidth'] / 1e9:.2f} GB/s.",
        "", f"## Validation (validation pool, seed {VAL_SEED}; every run reported)", "",
        "| run | steps | measured wall s: mean (each round) | predicted s | error | worst step | slowdown | "
        "error vs CPU-normalised | predicted bubble | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        worst = max(r["step_errors"], key=abs)
        reps = ", ".join(f"{x:.2f}" for x in r["wall_repeats_s"])
        lines.append(f"| {r['name']} | {r['steps']} | {r['wall_s']:.2f} ({reps}) | {r['predicted_s']:.2f} | "
                     f"{r['error']:+.1%} | {worst:+.1%} | {r['slowdown']:.2f} | {r['error_normalised']:+.1%} | "
                     f"{r['bubble_pred']:.1%} | {r['load']:.1f} |")
    t = summ["targets"]
    lines += ["", f"**Mean |error| {summ['mean_abs_error']:.1%}** (target <= 5%: {'met' if t['mean_abs_error <= 5%'] else 'MISSED'}), "
              f"**max {summ['max_abs_error']:.1%}** (target <= 10%: {'met' if t['max_abs_error <= 10%'] else 'MISSED'}) over "
              f"{summ['runs']} validation runs, against the wall clock.", "",
              "## Candidate plans (R1-R4: one job's partition x recompute candidates)", "",
              f"- measured, fastest first: {'; '.join(summ['measured_order'])}",
              f"- simulated, fastest first: {'; '.join(summ['predicted_order'])}",
              f"- same order: **{'yes' if summ['same_order'] else 'no'}** (Kendall tau {summ['kendall_tau']:+.2f}; "
              f"measured gaps between neighbours: {', '.join(f'{g:.2f} s' for g in summ['measured_gaps_s'])})"]
    (out / "sim_validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
