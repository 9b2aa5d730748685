"""Validate the cost model's per-layer predictions against a separate measurement run (CPU, tiny preset).

1. Calibration run: ``omnibal profile`` of the tiny preset over its grid (or ``--profile`` to reuse one);
   written to benchmarks/results/profile_tiny_cpu.json.
2. The analytic model's efficiency factors are calibrated on that profile (omnibal.cost.calibrate).
3. Validation run, measured separately: micro-batches packed from the real InternVL-1.2M statistics
   (AI2D + ChartQA, 1-6 consecutive samples of a shuffled pool, tokens converted to the tiny model's
   16 LLM tokens per tile), each layer kind timed on each pack with varlen segments = the samples.
4. Relative errors per layer kind of (a) the profile-fitted table, (b) the calibrated analytic table and
   (c) the uncalibrated analytic table (measured CPU peak, default efficiencies); and of the whole model's
   forward+backward per micro-batch (sum over the chain). Results: benchmarks/results/cost_validation.{json,md}
   (``--out`` elsewhere), with the provenance.

    python -m benchmarks.bench_cost_validation [--profile PATH] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, SHARED_STATS, STATS_FILES, write_result
from omnibal.cost.analytic import analytic_cost_table
from omnibal.cost.calibrate import calibrate_hardware, prediction_errors
from omnibal.cost.fit import relative_errors
from omnibal.cost.presets import get_model_preset
from omnibal.cost.profile import Point, ProfileConfig, cost_table_from_profile, fit_profile, load_profile, save_profile
from omnibal.measure.hardware import measure_cpu
from omnibal.measure.machine import load_average
from omnibal.measure.profile import measure, measure_points
from omnibal.stats.io import load_stats
from omnibal.stats.table import SampleStats


def validation_packs(spec, num_packs: int, seed: int) -> list[tuple[int, tuple[int, ...]]]:
    """``num_packs`` packs of 1-6 consecutive samples of a shuffled pool of the real statistics, as
    ``(tiles, LLM tokens per sample)`` in the model's units."""
    stats = SampleStats.concat([load_stats(SHARED_STATS / f) for f in STATS_FILES])
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(stats.tiles))
    tiles = stats.tiles[order].astype(np.int64)
    tokens = spec.sample_tokens(tiles, stats.tokens[order], images=stats.images[order])
    packs, start = [], 0
    for k in range(num_packs):
        size = 1 + k % 6
        packs.append((int(tiles[start:start + size].sum()), tuple(int(t) for t in tokens[start:start + size])))
        start += size
    return packs


def whole_model_errors(spec, table, rows, packs) -> dict[str, float]:
    """Per pack: measured sum over the chain (each layer timed as its kind) vs the table's prediction."""
    layer_kinds = [layer.kind for layer in spec.layers()]
    measured, predicted = [], []
    for tiles, lengths in packs:
        feats = Point("x", tiles, lengths).features
        sel = {r["kind"]: r for r in rows if r["tiles"] == tiles and r["tokens"] == sum(lengths)
               and r.get("pack") is not None and list(r["pack"][1]) == list(lengths)}
        measured.append(sum(sel[k]["fwd_s"] + sel[k]["bwd_s"] for k in layer_kinds))
        predicted.append(float((table.fwd_time + table.bwd_time).sum(axis=0) @ feats))
    err = relative_errors(np.array(predicted), np.array(measured))
    return {"points": len(packs), "step_mean_abs": float(np.abs(err).mean()), "step_max_abs": float(np.abs(err).max()),
            "step_bias": float(err.mean()), "measured_s": measured, "predicted_s": predicted}


def with_statistic(rows: list[dict], statistic: str) -> list[dict]:
    """The same measurements with ``fwd_s``/``bwd_s`` taken from another recorded statistic."""
    return [{**r, "fwd_s": r[f"fwd_{statistic}_s"], "bwd_s": r[f"bwd_{statistic}_s"]} for r in rows]


def evaluate(spec, profile_rows, validation_rows, packs, cpu, dtype) -> dict:
    """Fit + calibrate on the calibration rows, predict the validation rows."""
    profile = {"format": "omnibal-profile/1", "model": {"name": spec.name, "fingerprint": spec.fingerprint()},
               "dtype": dtype, "measurements": profile_rows, "fit": fit_profile(profile_rows)}
    calibrated = calibrate_hardware(spec, cpu, profile)
    tables = {
        "profile fit": cost_table_from_profile(spec, profile),
        "analytic, calibrated": analytic_cost_table(spec, calibrated, dtype=dtype),
        "analytic, default efficiencies": analytic_cost_table(spec, cpu, dtype=dtype),
    }
    return {"calibrated": calibrated.to_dict(),
            "errors": {name: prediction_errors(spec, table, validation_rows) for name, table in tables.items()},
            "whole_model": {name: whole_model_errors(spec, table, validation_rows, packs)
                            for name, table in tables.items()}}


def one_trial(spec, args, packs, progress, profile=None) -> tuple[dict, dict]:
    if profile is None:
        profile = measure(spec, ProfileConfig(repeats=args.repeats, statistic=args.statistic), progress=progress)
    cpu = measure_cpu(threads=1)
    kinds = tuple(dict.fromkeys(layer.kind for layer in spec.layers()))
    points = [Point(kind, tiles, lengths) for tiles, lengths in packs for kind in kinds]
    load_before = load_average()
    rows = measure_points(spec, points, repeats=args.repeats, progress=progress, statistic=args.statistic,
                          dtype=profile["dtype"])
    load_after = load_average()
    for row, point in zip(rows, points):
        row["pack"] = (point.tiles, list(point.lengths))
    statistics = [args.statistic] + [st for st in ("median", "min", "cpu", "cpu_min") if st != args.statistic
                                     and f"fwd_{st}_s" in profile["measurements"][0]]
    by_stat = {st: evaluate(spec, with_statistic(profile["measurements"], st), with_statistic(rows, st), packs, cpu,
                            profile["dtype"]) for st in statistics}
    result = {
        "calibration_profile": profile.get("created"), "calibration_load_average": profile.get("load_average"),
        "validation_load_average": {"before": load_before, "after": load_after}, "cpu": cpu.to_dict(),
        **by_stat[args.statistic], "by_statistic": {st: v["whole_model"] for st, v in by_stat.items()},
        "measurements": rows,
    }
    return result, profile


def retest(a: list[dict], b: list[dict]) -> float:
    """Median relative difference of fwd+bwd between two measurement runs of the same shapes."""
    ta = np.array([r["fwd_s"] + r["bwd_s"] for r in a])
    tb = np.array([r["fwd_s"] + r["bwd_s"] for r in b])
    return float(np.median(np.abs(ta - tb) / tb))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, default=None, help="reuse this calibration profile (one trial)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--statistic", default="median", choices=("median", "min", "cpu", "cpu_min"))
    parser.add_argument("--packs", type=int, default=12)
    parser.add_argument("--trials", type=int, default=1, help="independent calibration + validation runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    out = args.out
    spec = get_model_preset("tiny")
    progress = sys.stderr.isatty()
    packs = validation_packs(spec, args.packs, args.seed)
    given = load_profile(args.profile, spec) if args.profile else None
    trials, profiles = [], []
    for trial in range(1 if given else args.trials):
        print(f"trial {trial + 1}/{args.trials}: load {load_average()}", file=sys.stderr, flush=True)
        result, profile = one_trial(spec, args, packs, progress, given)
        trials.append(result)
        profiles.append(profile)
    # The headline trial: the quietest (lowest mean 1-minute load over its calibration and validation).
    def trial_load(i):
        r = trials[i]
        loads = [(r["calibration_load_average"] or {}).get(k, [0])[0] for k in ("before", "after")]
        return float(np.mean(loads + [r["validation_load_average"][k][0] for k in ("before", "after")]))

    best = min(range(len(trials)), key=trial_load)
    if not given:
        save_profile(profiles[best], out / "profile_tiny_cpu.json")
    result = {"model": spec.name, "dtype": profiles[best]["dtype"], "threads": 1, "statistic": args.statistic,
              "repeats": args.repeats, "packs": [{"tiles": t, "tokens": list(lengths)} for t, lengths in packs],
              "headline_trial": best, "trial_loads": [trial_load(i) for i in range(len(trials))],
              "retest_profile": [retest(profiles[0]["measurements"], p["measurements"]) for p in profiles[1:]],
              "retest_validation": [retest(trials[0]["measurements"], t["measurements"]) for t in trials[1:]],
              **trials[best], "trials": [{k: v for k, v in t.items() if k != "measurements"} for t in trials]}
    write_result("cost_validation", result, render(result, profiles[best]), out=out)
    print(render(result, profiles[best]))
    return 0


def render(result, profile) -> str:
    cal = result["calibrated"]
    lines = [
        "# Cost model validation: tiny preset, CPU, 1 thread",
        "",
        f"Headline trial {result['headline_trial'] + 1} of {len(result['trials'])} (the quietest). "
        f"Calibration run: `omnibal profile --model tiny` ({len(profile['measurements'])} grid shapes, "
        f"{profile['repeats']} repeats, {profile.get('statistic', 'median')}), created {profile['created']}, "
        f"load average {profile['load_average']['before']} -> {profile['load_average']['after']}.",
        f"Validation run (separate): {len(result['packs'])} micro-batches packed from the real AI2D + ChartQA "
        f"statistics (1-6 samples, {min(p['tiles'] for p in result['packs'])}-"
        f"{max(p['tiles'] for p in result['packs'])} tiles, {min(sum(p['tokens']) for p in result['packs'])}-"
        f"{max(sum(p['tokens']) for p in result['packs'])} LLM tokens), every layer kind timed on each, "
        f"{result['repeats']} repeats ({result['statistic']}), load average "
        f"{result['validation_load_average']['before']} -> {result['validation_load_average']['after']} "
        "(2 cores shared with other jobs).",
        "",
        f"Measured CPU: fp32 GEMM {result['cpu']['peak_fp32_flops'] / 1e9:.1f} GFLOP/s, copy bandwidth "
        f"{result['cpu']['memory_bandwidth'] / 1e9:.1f} GB/s. Calibrated efficiencies: matmul "
        f"{cal['eff_matmul']:.3f}, attention {cal['eff_attention']:.3f}, memory {cal['eff_memory']:.3f}, "
        f"per-layer overhead {cal['layer_overhead_s'] * 1e3:.3f} ms.",
        "",
        "Relative error of predicted vs measured time per layer kind (mean |err| / max |err|; bias = mean signed):",
        "",
        "| layer kind | points | table | fwd | bwd | fwd+bwd | fwd+bwd bias | saved bytes |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind in result["errors"]["profile fit"]:
        for name, errs in result["errors"].items():
            e = errs[kind]
            act = f"{e['act_mean_abs']:.1%}" if "act_mean_abs" in e else "-"
            lines.append(f"| {kind} | {e['points']} | {name} | {e['fwd_mean_abs']:.1%} / {e['fwd_max_abs']:.1%} | "
                         f"{e['bwd_mean_abs']:.1%} / {e['bwd_max_abs']:.1%} | {e['step_mean_abs']:.1%} / "
                         f"{e['step_max_abs']:.1%} | {e['step_bias']:+.1%} | {act} |")
    lines += ["", "Whole model, forward + backward of one micro-batch (sum over the 15-layer chain):", "",
              "| table | micro-batches | mean abs err | max abs err | bias |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, e in result["whole_model"].items():
        lines.append(f"| {name} | {e['points']} | {e['step_mean_abs']:.1%} | {e['step_max_abs']:.1%} | "
                     f"{e['step_bias']:+.1%} |")
    lines += ["", "Whole-model error over all trials and timing statistics (profile fit / analytic calibrated, mean "
              "abs err; the same measurements refitted with each statistic):", "",
              "| trial | mean 1-min load | statistic | profile fit | analytic, calibrated | analytic, default |",
              "| ---: | ---: | --- | ---: | ---: | ---: |"]
    for i, trial in enumerate(result["trials"]):
        for st, whole in trial["by_statistic"].items():
            lines.append(f"| {i + 1}{' (headline)' if i == result['headline_trial'] else ''} | "
                         f"{result['trial_loads'][i]:.1f} | {st} | {whole['profile fit']['step_mean_abs']:.1%} | "
                         f"{whole['analytic, calibrated']['step_mean_abs']:.1%} | "
                         f"{whole['analytic, default efficiencies']['step_mean_abs']:.1%} |")
    if len(result["trials"]) > 1:
        for st in result["trials"][0]["by_statistic"]:
            med = {name: float(np.median([t["by_statistic"][st][name]["step_mean_abs"] for t in result["trials"]]))
                   for name in ("profile fit", "analytic, calibrated", "analytic, default efficiencies")}
            lines.append(f"| median of trials | - | {st} | {med['profile fit']:.1%} | "
                         f"{med['analytic, calibrated']:.1%} | {med['analytic, default efficiencies']:.1%} |")
    if result["retest_profile"]:
        lines += ["", "Run-to-run variation of the same shapes (median |difference| of fwd+bwd vs trial 1), the noise "
                  f"floor under this load: calibration grid {', '.join(f'{x:.1%}' for x in result['retest_profile'])}; "
                  f"validation packs {', '.join(f'{x:.1%}' for x in result['retest_validation'])}."]
    meas = result["whole_model"]["profile fit"]["measured_s"]
    lines += ["", f"Measured whole-model forward+backward per micro-batch: {min(meas) * 1e3:.0f}-"
              f"{max(meas) * 1e3:.0f} ms.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
