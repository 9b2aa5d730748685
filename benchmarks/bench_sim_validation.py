"""Validate the step-time simulator against measured steps of the reference trainer on CPU.

Calibration and validation are different runs:

* **calibration** (fits the simulator): three trainer runs on their own data (seed 1001): single-process
  random micro-batches of 4 samples padded to the longest with full recomputation, single-process balanced
  packs without recomputation, and a DP 1 x PP 2 balanced run (each rank's own CPU time covers its stage's
  layers, which separates the vision from the LLM scale). ``omnibal.sim.calibrate`` fits the vision/LLM
  scales of the cost table and the per-step overhead from their per-step CPU times. The
  gloo links (p2p, all-reduce) are measured separately by ``sim_links.py`` (message ping-pong, not steps).
* **validation** (checks the simulator): other runs on other data (seed 0), including every multi-rank
  configuration (DP 1 x PP 2, DP 2 x PP 1), baseline vs balanced data, and several pipeline partitions
  (does the simulator rank them in the measured order?).

For every run the simulator is given exactly the micro-batches the trainer ran (same indices, same
padding: baseline rows padded to the longest sample, packs varlen; a pipeline's p2p buffers at the fixed
shape). Measured and predicted time are the sums over the timed steps (the first step of each run is a
warm-up and is dropped). Error = predicted / measured - 1.

The machine has 2 cores shared with other jobs and its speed drifts over minutes: every run is one torch
thread per rank, the load average is recorded with each run, and all runs are repeated in alternating
rounds (``--repeats``) so that calibration and validation see the same drift.

    PYTHONPATH=src python benchmarks/bench_sim_validation.py [--steps 6] [--repeats 3] [--quick]
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


def load_real_subset(num_samples: int, seed: int):
    """A random subset of the real InternVL-1.2M statistics, in the files' units (256 tokens per tile)."""
    from omnibal.stats.io import load_stats as read
    from omnibal.stats.table import SampleStats

    parts = [read(SHARED_STATS / f) for f in STATS_FILES]
    stats = SampleStats.concat(parts, source="internvl-1.2m-stats (ai2d + chartqa)")
    rows = np.sort(np.random.default_rng(seed).choice(len(stats), size=num_samples, replace=False))
    return replace(stats.take(rows), source=f"{stats.source} subset {num_samples} seed {seed}")


def load_stats(num_samples: int, seed: int):
    """:func:`load_real_subset` with tokens as the tiny model counts them (what its balancer and trainer see)."""
    return model_units(load_real_subset(num_samples, seed))


def model_units(stats):
    """``stats`` with tokens as the tiny model counts them."""
    from omnibal.cost.presets import get_model_preset
    from omnibal.stats.table import SampleStats

    spec = get_model_preset(MODEL)
    tokens = spec.sample_tokens(stats.tiles, stats.tokens, images=stats.images)
    return SampleStats(tiles=stats.tiles, tokens=tokens, images=stats.images, keys=stats.keys,
                       source=f"{stats.source}, tokens for {MODEL}")


def baseline_schedule(stats, dp: int, num_steps: int, seed: int):
    from omnibal.train.feed import random_microbatch_schedule

    return random_microbatch_schedule(len(stats), dp_size=dp, num_microbatches=NUM_MB, batch_size=BATCH, seed=seed,
                                      num_steps=num_steps)


def balanced_schedule(stats, dp: int, seed: int, table):
    from omnibal.data.balance import BalanceConfig, BalanceCost, balance

    return balance(stats, dp_size=dp, num_microbatches=NUM_MB, seed=seed,
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
                      num_microbatches=NUM_MB, pipeline_schedule="1f1b", lr=1e-4, buffer=buffer)
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


def make_run(name, *, dp, pp, mode, ranges, recompute, seed, stats, table, steps, names):
    """Schedule, layout and features of one run (``recompute``: 'full' or 'none')."""
    from omnibal.train.loop import fixed_buffer

    if mode == "baseline":
        sched = baseline_schedule(stats, dp, steps, seed)
    else:
        sched = balanced_schedule(stats, dp, seed, table)
    if ranges is None:
        from omnibal.train.pipeline import even_split

        ranges = even_split(len(names), pp)
    rec_sets = tuple(tuple(names[a:b]) if recompute == "full" else () for a, b in ranges)
    buf = fixed_buffer(sched, stats, mode=mode) if pp > 1 else None
    feats = step_features(sched, stats, steps, padded=mode == "baseline")
    run = {"name": name, "dp": dp, "pp": pp, "mode": mode, "ranges": [list(r) for r in ranges],
           "recompute_sets": rec_sets, "recompute": recompute, "seed": seed, "steps": steps,
           "buffer": None if buf is None else [buf.tiles, buf.tokens]}
    return run, sched, feats


def simulate_run(run, feats, table, links, overhead, jitter=0.0):
    from omnibal.sim import SimConfig, simulate_epoch

    cuts = [r[0] for r in run["ranges"]] + [run["ranges"][-1][1]]
    rec = np.zeros(table.num_layers, bool)
    if run["recompute"] == "full":
        rec[:] = True
    buffer = None
    if run["buffer"] is not None:
        q_v, q_t = run["buffer"]
        buffer = np.broadcast_to(microbatch_features(q_v, q_t, q_t * q_t), feats.shape)
    cfg = SimConfig(dp_size=run["dp"], p2p_bandwidth=links["p2p_bandwidth"], p2p_latency=links["p2p_latency"],
                    dp_bandwidth=links["dp_bandwidth"], dp_latency=links["dp_latency"], step_overhead=overhead,
                    p2p_occupancy=1.0, compute_jitter=jitter)
    return simulate_epoch(table, cuts, rec, feats, cfg, buffer_features=buffer)


CAL_SPECS = (
    ("cal: 1x1 baseline, full recompute", dict(dp=1, pp=1, mode="baseline", ranges=None, recompute="full")),
    ("cal: 1x1 balanced, no recompute", dict(dp=1, pp=1, mode="omnibal", ranges=None, recompute="none")),
    # each rank's CPU time covers its stage's layers only: separates the vision from the LLM scale
    ("cal: 1x2 balanced, even split, no recompute (per-rank CPU)",
     dict(dp=1, pp=2, mode="omnibal", ranges=None, recompute="none")),
    # a rank of a multi-rank run computes slower than a rank alone (4-17% on this VM): DP runs of both kinds
    # and the pipeline run above fit the shared-core factor; the DP runs also give the stragglers' jitter
    ("cal: 2x1 balanced, no recompute (per-rank CPU)", dict(dp=2, pp=1, mode="omnibal", ranges=None, recompute="none")),
    ("cal: 2x1 baseline, full recompute (per-rank CPU)",
     dict(dp=2, pp=1, mode="baseline", ranges=None, recompute="full")),
)
"""Calibration runs (name, make_run arguments), run on the calibration data (``CAL_SEED``)."""


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
        rec_mask = np.full(len(self.names), run["recompute"] == "full")
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
    ap.add_argument("--repeats", type=int, default=4,
                    help="rounds of all calibration and validation runs (mixed order; validation averaged)")
    ap.add_argument("--groups", default="vision,llm", help="layer groups with their own scale: 'vision,llm' (default; "
                    "the pipeline calibration run separates them) or 'all'")
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

    cal_stats = load_stats(args.samples, CAL_SEED)
    val_stats = load_stats(args.samples, VAL_SEED)
    log("measuring gloo links")
    links = measure_links()
    log(f"links: p2p {links['p2p_latency'] * 1e3:.2f} ms + {links['p2p_bandwidth'] / 1e9:.2f} GB/s, all-reduce "
        f"{links['dp_latency'] * 1e3:.2f} ms + {links['dp_bandwidth'] / 1e9:.2f} GB/s")
    common = dict(table=table, steps=steps, names=names)
    val_specs = [
        ("1x1 baseline, full recompute", dict(dp=1, pp=1, mode="baseline", ranges=None, recompute="full")),
        ("1x1 balanced, no recompute", dict(dp=1, pp=1, mode="omnibal", ranges=None, recompute="none")),
        ("1x2 baseline, even split, full recompute", dict(dp=1, pp=2, mode="baseline", ranges=None, recompute="full")),
        ("2x1 baseline, full recompute", dict(dp=2, pp=1, mode="baseline", ranges=None, recompute="full")),
        ("2x1 balanced, no recompute", dict(dp=2, pp=1, mode="omnibal", ranges=None, recompute="none")),
    ]
    # the even split of the 15-layer chain is the cut at 8: its run is also the 1x2 balanced validation
    rank_specs = [(f"1x2 balanced, cut at {k}{' (even split)' if k == 8 else ''}, no recompute",
                   dict(dp=1, pp=2, mode="omnibal", ranges=((0, k), (k, len(names))), recompute="none"))
                  for k in (3, 8, 12)]
    if args.quick:
        val_specs = val_specs[2:4]
        rank_specs = []

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
        rows.append({"name": name, "dp": run["dp"], "pp": run["pp"], "mode": run["mode"], "ranges": run["ranges"],
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


def write_results(out: Path, links, cal, cal_rows, rows, args, jitter: float, residuals: dict[str, float],
                  profile: dict | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"model": MODEL, "micro_batches": NUM_MB, "baseline_batch": BATCH, "timed_steps": args.steps,
           "samples_per_seed": args.samples, "table": args.table,
           "links": {k: v for k, v in links.items() if k != "raw"},
           "calibration": {**cal.to_dict(), "rank_jitter": jitter, "residuals": residuals, "runs": cal_rows},
           "validation": rows, "profile": profile}
    (out / "sim_validation.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [
        "# Simulator validation against the reference trainer (CPU, gloo)", "",
        f"Model `{MODEL}`, {NUM_MB} micro-batches per step, baseline micro-batches of {BATCH} samples padded to the "
        f"longest (full recompute), balanced packs from `omnibal.data.balance` (no recompute); data: {args.samples} "
        "random rows of the real InternVL-1.2M statistics per seed. One torch thread per rank. Each run: one warm-up "
        f"step, then {args.steps} timed steps; the figures are sums over the timed steps. Every calibration and "
        f"validation run is repeated {args.repeats} times, in rounds that hold every run once in a random order "
        "(calibration and validation runs mixed): the speed of this virtual machine drifts by 10-25% over minutes "
        "(a fixed GEMM loop alone varies that much, with no steal time and no other load to show for it), so a "
        "calibration done in one block of time and a validation in another would measure the drift. The "
        "calibration is fitted on all its rounds; a validation run's measured time is the mean of its rounds' "
        "wall-clock step times. Produced by `benchmarks/bench_sim_validation.py`.", "",
        "**Shared cores.** A multi-rank run puts one rank on each of the machine's 2 cores, and a rank of such a "
        "run computes slower than a rank alone (its communication threads preempt it: ~100 involuntary context "
        "switches per step against 3; two single-process loops side by side do not slow each other). The "
        "calibration's multi-rank runs are flagged as such (`CalibrationRun.shared_host`) and fit one more factor, applied to every "
        "multi-rank validation run (`Calibration.apply(table, shared_host=True)`); a cluster with one rank per "
        "GPU has no such factor. **Wall clock and CPU clock.** Errors are against the wall clock. Every rank "
        "also records its own CPU seconds per step (`time.thread_time`); the *slowdown* column is the ranks' busy "
        "wall time (compute + optimizer + data) over their CPU time, i.e. time the ranks were off their cores "
        "(another job, the hypervisor), and *error normalised* compares with the wall-clock step divided by it.", "",
        f"## Calibration (separate runs, data seed {CAL_SEED})", "",
        f"Base table: {'measured layer profile (omnibal.cost.profile, CPU time per op)' if args.table == 'profile' else 'analytic model on the measured CPU'}; "
        "fitted on the calibration runs' per-step CPU time (a rank's own compute; in the pipeline run each rank "
        "covers its stage's layers, which separates the vision from the LLM scale): per layer group "
        f"({', '.join(args.groups.split(','))}) one scale "
        f"({'forward and backward separately' if args.separate_backward else 'forward, recompute and backward together'}) "
        "and a per-step overhead.", "",
        "| run | repeat | steps | CPU s | wall s | load |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['repeat'] + 1} | {r['steps']} | {r['cpu_s']:.2f} | {r['wall_s']:.2f} | "
              f"{r['load']:.1f} |" for r in cal_rows]
    scales = ", ".join(f"{g} forward {f:.3f} / backward {b:.3f}" for g, f, b in
                       zip(cal.groups, cal.fwd_scale, cal.bwd_scale))
    lines += ["", "Fit residual per calibration run (measured / fitted CPU time - 1, over the rounds): " + "; ".join(
        f"{name.removeprefix('cal: ')} {r:+.1%}" for name, r in residuals.items()) + "."]
    lines += ["", f"Fitted scales: {scales}; shared-core factor {cal.shared_host_scale:.3f}; step overhead "
              f"{cal.step_overhead * 1e3:.1f} ms; "
              f"fit RMS error {cal.rel_rms_error:.1%} over {cal.num_steps} steps; rank jitter (the DP calibration run's "
              f"per-rank variation the table does not predict, `omnibal.sim.calibrate.rank_jitter`; the gradient sync "
              f"waits for the expected slowest rank) {jitter:.1%}. Links (`sim_links.py`, ping-pong and all-reduce "
              f"of 16 KiB-16 MiB on the wall clock): p2p {links['wall_clock']['p2p_latency'] * 1e3:.2f} ms + bytes / "
              f"{links['wall_clock']['p2p_bandwidth'] / 1e9:.2f} GB/s, all-reduce "
              f"{links['wall_clock']['dp_latency'] * 1e3:.2f} ms per ring step + bytes / "
              f"{links['wall_clock']['dp_bandwidth'] / 1e9:.2f} GB/s (divided by a compute probe's slowdown: p2p "
              f"{links['p2p_latency'] * 1e3:.2f} ms + bytes / {links['p2p_bandwidth'] / 1e9:.2f} GB/s).",
              "", f"## Validation (data seed {VAL_SEED})", "",
              "| run (DP x PP) | steps | measured wall s (each repeat) | predicted s | error | worst step | slowdown | "
              "error normalised | predicted bubble | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        worst = max(r["step_errors"], key=abs)
        reps = ", ".join(f"{x:.2f}" for x in r["wall_repeats_s"])
        lines.append(f"| {r['name']} | {r['steps']} | {r['wall_s']:.2f} ({reps}) | {r['predicted_s']:.2f} | "
                     f"{r['error']:+.1%} | {worst:+.1%} | {r['slowdown']:.2f} | {r['error_normalised']:+.1%} | "
                     f"{r['bubble_pred']:.1%} | {r['load']:.1f} |")
    errs = np.array([abs(r["error"]) for r in rows])
    if len(errs):
        norm = np.array([abs(r["error_normalised"]) for r in rows])
        lines += ["", f"Mean |error| {errs.mean():.1%}, max {errs.max():.1%} over {len(errs)} validation runs against the "
                  f"wall clock (target <= 10%, goal 5%); against the slowdown-normalised time: mean {norm.mean():.1%}, "
                  f"max {norm.max():.1%}."]
    ranked = [r for r in rows if r["ranking"]]
    if ranked:
        by_meas = [r["name"] for r in sorted(ranked, key=lambda r: r["wall_s"])]
        by_pred = [r["name"] for r in sorted(ranked, key=lambda r: r["predicted_s"])]
        lines += ["", "## Ranking of candidate partitions (DP 1 x PP 2, balanced)", "",
                  f"- measured, fastest first: {'; '.join(by_meas)}",
                  f"- simulated, fastest first: {'; '.join(by_pred)}",
                  f"- same order: **{'yes' if by_meas == by_pred else 'no'}**"]
    (out / "sim_validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
