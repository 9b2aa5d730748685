"""Order the candidate plans R1-R4 of the simulator validation by measurement (pre-registered in docs/sim.md,
"Resolving the candidates' order").

Run 3 of the held-out protocol (``benchmarks/results/sim_validation_run3.json``) measured the four candidates
in three rounds only, too few to order R1 and R3. This benchmark runs the same four trainer runs (same
validation rows, the same balanced packs, 6 micro-batches, one warm-up and ``--steps`` timed steps) in
``--rounds`` rounds of a seeded random order, and judges every pair of candidates by the per-round
difference of their wall-clock times: ordered when the mean lies more than two standard errors from zero, a
tie at this resolution otherwise. The prediction is run 3's, read from its file.

The packs are run 3's, stored in ``benchmarks/results/sim_validation_run3_packs.json``: the balancer has changed
since (its cap search and repair), so rebuilding them today gives other packs. They were written by the
balancer of run 3's commit (5a2aaab) under its stored layer profile; this benchmark checks them by recomputing
run 3's prediction from its stored calibration on them (equal to 1e-6, or it stops).

Writes ``benchmarks/results/sim_ranking.{json,md}``.

    python -m benchmarks.bench_sim_ranking [--rounds 20] [--steps 8]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, logger, write_result
from benchmarks.cpu_runs import MODEL, RANK_SPECS, VAL_SEED, launch, load_stats, make_run, simulate_run
from omnibal.cost.presets import get_model_preset
from omnibal.cost.profile import cost_table_from_profile
from omnibal.data.balance.schedule import Schedule
from omnibal.sim.calibrate import Calibration

RUN3 = RESULTS / "sim_validation_run3.json"
"""The protocol run whose prediction and layer profile this benchmark reuses."""

RUN3_PACKS = RESULTS / "sim_validation_run3_packs.json"
"""Run 3's balanced packs (one schedule: the four candidates differ in partition and recompute only)."""

ORDER_SEED = 1
"""Seed of the rounds' run order (run 3 used 0)."""


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="rounds of the four candidates (docs/sim.md fixes 20)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (plus one warm-up), as run 3")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: benchmarks/results)")
    return ap.parse_args(argv)


def load_reference(path: Path) -> dict:
    """Run 3's document; stops with the file named when it lacks what this benchmark reuses."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{path}: cannot read the reference protocol run ({exc})") from exc
    for key in ("profile", "calibration", "links", "validation", "samples_per_seed", "timed_steps"):
        if not doc.get(key):
            raise SystemExit(f"{path}: field {key!r} is missing; it is needed to rebuild run 3's candidates")
    return doc


def rebuilt_prediction(ref: dict, runs: dict, table) -> dict[str, float]:
    """Run 3's prediction of each candidate, recomputed from its stored calibration on the stored packs."""
    c = ref["calibration"]
    cal = Calibration(groups=tuple(c["groups"]), fwd_scale=tuple(c["fwd_scale"]), bwd_scale=tuple(c["bwd_scale"]),
                      step_overhead=c["step_overhead"], rel_rms_error=c["rel_rms_error"], num_steps=c["num_steps"],
                      shared_host_scale=c["shared_host_scale"])
    shared = cal.apply(table, shared_host=True)  # every candidate has two ranks on this machine's cores
    return {name: float(simulate_run(run, feats[1:], shared, ref["links"]["wall_clock"], cal.step_overhead,
                                     c["rank_jitter"]).step_time.sum())
            for name, (run, _, feats) in runs.items()}


def measure_rounds(runs: dict, stats, rounds: int, log) -> dict[str, list[dict]]:
    """Per candidate, one record per round: wall seconds of the timed steps, slowdown and load."""
    out: dict[str, list[dict]] = {name: [] for name in runs}
    rng = np.random.default_rng(ORDER_SEED)
    names = list(runs)
    for rnd in range(rounds):
        for name in [names[i] for i in rng.permutation(len(names))]:
            run, sched, _ = runs[name]
            records = launch(run, stats, sched)[1:]
            wall = float(sum(r["step_s"] for r in records))
            out[name].append({"round": rnd, "wall_s": wall,
                              "slowdown": float(np.mean([r["slowdown"] for r in records])),
                              "load": float(np.mean([r["load"] for r in records]))})
            log(f"round {rnd + 1}/{rounds} {name}: {wall:.2f} s")
    return out


def pair_verdicts(measured: dict[str, list[dict]], predicted: dict[str, float]) -> list[dict]:
    """Every pair (a, b): per-round a - b, its mean and standard error, the verdict and the simulator's sign."""
    rows = []
    for a, b in itertools.combinations(measured, 2):
        diff = np.array([x["wall_s"] - y["wall_s"] for x, y in zip(measured[a], measured[b], strict=True)])
        mean, se = float(diff.mean()), float(diff.std(ddof=1) / np.sqrt(len(diff)))
        ordered = abs(mean) > 2.0 * se
        pred = predicted[a] - predicted[b]
        rows.append({"a": a, "b": b, "mean_diff_s": mean, "se_s": se, "ordered": ordered,
                     "measured_faster": (a if mean < 0 else b) if ordered else None,
                     "predicted_diff_s": pred, "predicted_faster": a if pred < 0 else b,
                     "agrees": (mean < 0) == (pred < 0) if ordered else None})
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    log = logger("sim_ranking")
    ref = load_reference(RUN3)
    if args.steps != ref["timed_steps"]:
        raise SystemExit(f"--steps {args.steps} differs from the reference run's {ref['timed_steps']} timed steps")
    spec = get_model_preset(MODEL)
    names = [layer.name for layer in spec.layers()]
    table = cost_table_from_profile(spec, ref["profile"])
    stats = load_stats(ref["samples_per_seed"], VAL_SEED, "validation")
    runs = run3_candidates(ref, table, stats, args.steps + 1, names)
    stored = {r["name"]: r["predicted_s"] for r in ref["validation"] if r["name"] in runs}
    rebuilt = rebuilt_prediction(ref, runs, table)
    for name in runs:
        if abs(rebuilt[name] / stored[name] - 1.0) > 1e-6:
            raise SystemExit(f"{name}: the stored packs predict {rebuilt[name]:.4f} s, run 3 predicted "
                             f"{stored[name]:.4f} s: these are not run 3's candidates")
    log("the stored packs give run 3's prediction; measuring")
    measured = measure_rounds(runs, stats, args.rounds, log)
    write_results(args, ref, stored, measured, pair_verdicts(measured, stored))


def run3_candidates(ref: dict, table, stats, steps: int, names) -> dict:
    """R1-R4 on run 3's stored packs: ``{name: (run, schedule, features)}`` (:func:`benchmarks.cpu_runs.make_run`)."""
    packs = Schedule.from_dict(json.loads(RUN3_PACKS.read_text()), source=str(RUN3_PACKS))
    return {name: make_run(name, seed=VAL_SEED, stats=stats, table=table, steps=steps, names=names, schedule=packs,
                           **kw) for name, kw in RANK_SPECS}


def ranking_met(pairs: list[dict]) -> bool:
    """The pre-registered target: no pair the measurement orders is ordered otherwise by the simulator."""
    return all(p["agrees"] is not False for p in pairs)


def write_results(args, ref: dict, predicted: dict, measured: dict, pairs: list[dict]) -> None:
    met = ranking_met(pairs)
    ordered = [p for p in pairs if p["ordered"]]
    doc = {"protocol": "docs/sim.md, 'Resolving the candidates' order'", "reference": RUN3.name,
           "reference_commit": ref.get("provenance", {}).get("git_commit"), "rounds": args.rounds,
           "timed_steps": args.steps, "order_seed": ORDER_SEED, "predicted_s": predicted, "measured": measured,
           "pairs": pairs, "target_met": met, "ordered_pairs": len(ordered), "ties": len(pairs) - len(ordered)}
    lines = ["# Ordering the candidate plans R1-R4 by measurement (CPU, gloo)", "",
             f"Pre-registered in `docs/sim.md` (*Resolving the candidates' order*). The four candidate runs of the "
             f"held-out validation's run 3 (same rows and packs, {args.steps} timed steps after one warm-up), "
             f"{args.rounds} rounds of a seeded random order; the prediction is run 3's "
             f"(`{RUN3.name}`), not refitted. Produced by `python -m benchmarks.bench_sim_ranking`.", "",
             "| candidate | predicted s | measured wall s: mean (min-max) | error | slowdown | load |",
             "|---|---|---|---|---|---|"]
    for name, recs in measured.items():
        w = np.array([r["wall_s"] for r in recs])
        lines.append(f"| {name} | {predicted[name]:.2f} | {w.mean():.2f} ({w.min():.2f}-{w.max():.2f}) | "
                     f"{predicted[name] / w.mean() - 1:+.1%} | {np.mean([r['slowdown'] for r in recs]):.2f} | "
                     f"{np.mean([r['load'] for r in recs]):.1f} |")
    lines += ["", "Pairs (a - b per round, same machine state):", "",
              "| a | b | measured mean a - b (s) | standard error (s) | verdict | predicted a - b (s) | agrees |",
              "|---|---|---|---|---|---|---|"]
    for p in pairs:
        verdict = f"{p['measured_faster'].split()[0]} faster" if p["ordered"] else "tie at this resolution"
        agrees = "-" if p["agrees"] is None else ("yes" if p["agrees"] else "**no**")
        lines.append(f"| {p['a'].split()[0]} | {p['b'].split()[0]} | {p['mean_diff_s']:+.2f} | {p['se_s']:.2f} | "
                     f"{verdict} | {p['predicted_diff_s']:+.2f} | {agrees} |")
    lines += ["", f"**Candidates ranked as measured: {'met' if met else 'MISSED'}** ({len(ordered)} of {len(pairs)} "
              f"pairs ordered by the measurement, {len(pairs) - len(ordered)} ties)."]
    write_result("sim_ranking", doc, "\n".join(lines), out=args.out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
