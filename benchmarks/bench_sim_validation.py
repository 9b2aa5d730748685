"""Validate the step-time simulator against measured steps of the reference trainer on CPU (held out).

Implements the protocol of docs/sim.md ("Validation protocol", committed before its first run):

* the real InternVL-1.2M rows are cut by one fixed shuffle into a calibration pool and a validation pool;
  calibration draws only from the first, validation only from the second (disjoint keys, checked);
* **calibration** (``CAL_SPECS``): DP 1 and DP 2 whole-model runs at 4 micro-batches, baseline + full
  recompute and balanced + none; ``omnibal.sim.calibrate`` fits one overall scale of a measured layer profile,
  the per-step overhead and the shared-host factor from each rank's own CPU time, and the rank jitter;
  the gloo links are measured separately by :func:`omnibal.measure.links.measure_links` (message ping-pong,
  not steps);
* **validation** (``VAL_SPECS``, ``RANK_SPECS``): micro-batch counts never calibrated (6, 8), the DP 1 x PP 2
  layout and pipeline partitions never calibrated, and four candidate plans (partition x recompute) of one
  job that the simulator must rank as measured.

For every run the simulator is given exactly the micro-batches the trainer ran (same indices, same
padding: baseline rows padded to the longest sample, packs varlen; a pipeline's p2p buffers at the fixed
shape). Measured and predicted time are the sums over the timed steps (the first step of each run is a
warm-up and is dropped). Error = predicted / measured - 1. Runs are repeated in rounds, each holding every
run once in a seeded random order, so that calibration and validation see the same drift of this VM's speed.

The trainer runs and the calibration are the shared helpers of :mod:`benchmarks.cpu_runs`; this module holds the
protocol's runs and its summary. Writes ``benchmarks/results/sim_validation.{json,md}`` (``--out`` elsewhere).

    python -m benchmarks.bench_sim_validation [--steps 8] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, logger, write_result
from benchmarks.cpu_runs import (
    BATCH,
    CAL_SEED,
    MODEL,
    POOL_SEED,
    RANK_SPECS,
    VAL_SEED,
    CalibrationData,
    launch,
    load_stats,
    make_run,
    simulate_run,
)
from omnibal.cost.analytic import analytic_cost_table
from omnibal.cost.presets import get_model_preset
from omnibal.cost.profile import ProfileConfig, cost_table_from_profile
from omnibal.measure.hardware import measure_cpu
from omnibal.measure.links import measure_links
from omnibal.measure.profile import measure

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


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (plus one warm-up)")
    ap.add_argument("--samples", type=int, default=3000, help="rows of the real stats used per seed")
    ap.add_argument("--quick", action="store_true", help="calibration + three validation runs only")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
    ap.add_argument("--table", choices=("profile", "analytic"), default="profile",
                    help="base cost table: measured layer profile (default) or the analytic model")
    ap.add_argument("--profile-repeats", type=int, default=3)
    ap.add_argument("--separate-backward", action="store_true",
                    help="fit forward and backward scales separately")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of all calibration and validation runs (mixed order; validation averaged)")
    ap.add_argument("--groups", default="all", help="layer groups with their own scale: 'all' (default: the "
                    "protocol of docs/sim.md fixes it) or 'vision,llm'")
    return ap.parse_args(argv)


def base_table(spec, args, log):
    """``(table, profile)``: the measured layer profile's table (profile None for the analytic table)."""
    if args.table == "analytic":
        return analytic_cost_table(spec, measure_cpu(threads=1), dtype="fp32"), None
    log("profiling the layers (omnibal.measure.profile, CPU time per op)")
    profile = measure(spec, ProfileConfig(threads=1, statistic="cpu", repeats=args.profile_repeats))
    return cost_table_from_profile(spec, profile), profile


def held_out_stats(samples: int):
    """Calibration and validation data from the two pools; stops if they share a sample."""
    cal_stats = load_stats(samples, CAL_SEED, "calibration")
    val_stats = load_stats(samples, VAL_SEED, "validation")
    shared_keys = np.intersect1d(cal_stats.keys, val_stats.keys)
    if len(shared_keys):
        raise SystemExit(f"calibration and validation data share {len(shared_keys)} samples: not held out")
    return cal_stats, val_stats


def run_rounds(calib: CalibrationData, val_stats, val_specs, args, common: dict, log) -> list[tuple]:
    """Every round: the calibration and validation runs in a seeded random order. This machine's speed drifts
    by 10-25% over minutes (a fixed GEMM loop varies that much, with no steal time or load to show for it), so
    calibrating in one block of time and validating in another would measure the drift, not the simulator.
    Returns per validation run and round ``(name, run, features, wall [S], slowdown [S], load)``."""
    runs = []
    order_rng = np.random.default_rng(0)
    for rep in range(args.repeats):
        jobs = [("cal", name, kw) for name, kw in CAL_SPECS] + [("val", name, kw) for name, kw in val_specs]
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
    return runs


def validation_row(name: str, mine: list[tuple], fitted, links: dict, ranking: bool) -> dict:
    """Measured (mean over the rounds, step by step: the same steps on the same data each time) vs predicted."""
    cal, ctable, ctable_shared, jitter = fitted
    _, run, feats, _, _, _ = mine[0]
    shared = run["dp"] * run["pp"] > 1  # the ranks of a multi-rank run share this machine's cores
    sim = simulate_run(run, feats[1:], ctable_shared if shared else ctable, links["wall_clock"], cal.step_overhead,
                       jitter)
    pred = sim.step_time
    per_rep = [r[3].sum() for r in mine]
    wall = np.mean([r[3] for r in mine], axis=0)
    slowdown = np.mean([r[4] for r in mine], axis=0)
    measured = np.mean([r[3] / r[4] for r in mine], axis=0)
    return {"name": name, "dp": run["dp"], "pp": run["pp"], "mb": run["mb"], "mode": run["mode"],
            "ranges": run["ranges"], "recompute": run["recompute"], "steps": len(measured), "repeats": len(mine),
            "wall_repeats_s": [float(x) for x in per_rep], "wall_s": float(wall.sum()),
            "slowdown": float(slowdown.mean()), "normalised_s": float(measured.sum()),
            "predicted_s": float(pred.sum()), "error": float(pred.sum() / wall.sum() - 1.0),
            "error_normalised": float(pred.sum() / measured.sum() - 1.0),
            "step_errors": (pred / wall - 1.0).tolist(), "bubble_pred": float(sim.bubble.mean()),
            "load": float(np.mean([r[5] for r in mine])), "ranking": ranking}


def main(argv=None) -> None:
    args = parse_args(argv)
    log = logger("sim_validation")
    spec = get_model_preset(MODEL)
    names = [layer.name for layer in spec.layers()]
    steps = args.steps + 1
    table, profile = base_table(spec, args, log)
    cal_stats, val_stats = held_out_stats(args.samples)
    log("measuring gloo links")
    links = measure_links()
    log(f"links: p2p {links['p2p_latency'] * 1e3:.2f} ms + {links['p2p_bandwidth'] / 1e9:.2f} GB/s, all-reduce "
        f"{links['dp_latency'] * 1e3:.2f} ms + {links['dp_bandwidth'] / 1e9:.2f} GB/s")
    val_specs, rank_specs = list(VAL_SPECS), list(RANK_SPECS)
    if args.quick:
        val_specs, rank_specs = val_specs[:1], rank_specs[:2]

    calib = CalibrationData(table, names, cal_stats, steps, specs=CAL_SPECS)
    runs = run_rounds(calib, val_stats, val_specs + rank_specs, args, dict(table=table, steps=steps, names=names), log)
    fitted = calib.fit(args.groups.split(","), args.separate_backward)
    log(f"calibration: {fitted[0].to_dict()}, rank jitter {fitted[3]:.3f}")

    rows = []
    for name, _kw in val_specs + rank_specs:
        row = validation_row(name, [r for r in runs if r[0] == name], fitted, links, name in dict(rank_specs))
        rows.append(row)
        log(f"{name}: measured {row['wall_s']:.2f} s (repeats {np.round(row['wall_repeats_s'], 2).tolist()}), "
            f"predicted {row['predicted_s']:.2f} s, error {row['error']:+.1%}")
    write_results(args.out, links, fitted[0], calib.rows, rows, args, fitted[3], calib.residuals(fitted[0]), profile)


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
            "targets": {"mean_abs_error <= 5%": bool(errs.mean() <= 0.05),
                        "max_abs_error <= 10%": bool(errs.max() <= 0.10),
                        "candidates ranked as measured": by_meas == by_pred}}


def write_results(out: Path, links, cal, cal_rows, rows, args, jitter: float, residuals: dict[str, float],
                  profile: dict | None) -> None:
    """``out/sim_validation.{json,md}`` with the provenance (:func:`benchmarks.common.write_result`)."""
    summ = summary(rows)
    doc = {"protocol": "docs/sim.md, 'Validation protocol (held out)'", "model": MODEL, "baseline_batch": BATCH,
           "timed_steps": args.steps, "samples_per_seed": args.samples, "repeats": args.repeats, "table": args.table,
           "pool_seed": POOL_SEED, "calibration_seed": CAL_SEED, "validation_seed": VAL_SEED, "summary": summ,
           "links": {k: v for k, v in links.items() if k != "raw"},
           "calibration": {**cal.to_dict(), "rank_jitter": jitter, "residuals": residuals, "runs": cal_rows},
           "validation": rows, "profile": profile}
    lines = [
        "# Simulator validation against the reference trainer (CPU, gloo), held out", "",
        "Protocol: `docs/sim.md`, section *Validation protocol*, committed before this run. Model `tiny`; one torch "
        f"thread per rank; data: {args.samples} rows per seed of the real InternVL-1.2M statistics, calibration from "
        f"one half of a fixed shuffle (seed {POOL_SEED}) and validation from the other (disjoint keys, checked). "
        f"Each run: one warm-up step, then {args.steps} timed steps (sums below). {args.repeats} rounds, each holding "
        "every calibration and validation run once in a seeded random order. Produced by "
        "`python -m benchmarks.bench_sim_validation`.", "",
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
        f"rank jitter {jitter:.1%}. Links (wall clock): p2p {links['wall_clock']['p2p_latency'] * 1e3:.2f} ms + "
        f"bytes / {links['wall_clock']['p2p_bandwidth'] / 1e9:.2f} GB/s, all-reduce "
        f"{links['wall_clock']['dp_latency'] * 1e3:.2f} ms per ring step + bytes / "
        f"{links['wall_clock']['dp_bandwidth'] / 1e9:.2f} GB/s.",
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
    lines += ["", f"**Mean |error| {summ['mean_abs_error']:.1%}** "
              f"(target <= 5%: {'met' if t['mean_abs_error <= 5%'] else 'MISSED'}), "
              f"**max {summ['max_abs_error']:.1%}** "
              f"(target <= 10%: {'met' if t['max_abs_error <= 10%'] else 'MISSED'}) over "
              f"{summ['runs']} validation runs, against the wall clock.", "",
              "## Candidate plans (R1-R4: one job's partition x recompute candidates)", "",
              f"- measured, fastest first: {'; '.join(summ['measured_order'])}",
              f"- simulated, fastest first: {'; '.join(summ['predicted_order'])}",
              f"- same order: **{'yes' if summ['same_order'] else 'no'}** (Kendall tau {summ['kendall_tau']:+.2f}; "
              f"measured gaps between neighbours: {', '.join(f'{g:.2f} s' for g in summ['measured_gaps_s'])})"]
    write_result("sim_validation", doc, "\n".join(lines), out=out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
