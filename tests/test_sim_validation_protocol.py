"""The held-out protocol of docs/sim.md as benchmarks/bench_sim_validation.py implements it: calibration and
validation data are disjoint, every validation run has a configuration no calibration run has, and the
summary checks the stated targets."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    """The benchmark as ``python -m benchmarks.bench_sim_validation`` imports it (the repository root on the path,
    as ``python -m pytest`` from the root has it; plain ``pytest`` does not)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module("benchmarks.bench_sim_validation")


def test_calibration_and_validation_draw_disjoint_real_rows(shared_stats_dir, monkeypatch):
    bench = _bench()
    runs = importlib.import_module("benchmarks.cpu_runs")  # the benchmark's data draw is the shared helper's
    monkeypatch.setattr(runs, "SHARED_STATS", shared_stats_dir)
    cal = runs.load_real_subset(3000, bench.CAL_SEED, "calibration")
    val = runs.load_real_subset(3000, bench.VAL_SEED, "validation")
    assert len(np.intersect1d(cal.keys, val.keys)) == 0
    # without the pools (the previous protocol) the two seeds' subsets overlap
    assert len(np.intersect1d(runs.load_real_subset(3000, 1001).keys, runs.load_real_subset(3000, 0).keys)) > 0


def _config(kw: dict) -> tuple:
    ranges = None if kw["ranges"] is None else tuple(map(tuple, kw["ranges"]))
    return kw["dp"], kw["pp"], kw["mb"], ranges


def test_every_validation_run_has_a_configuration_no_calibration_run_has():
    bench = _bench()
    cal_layouts = {(kw["dp"], kw["pp"]) for _, kw in bench.CAL_SPECS}
    cal_mbs = {kw["mb"] for _, kw in bench.CAL_SPECS}
    assert all(kw["ranges"] is None for _, kw in bench.CAL_SPECS)  # no pipeline partition is calibrated
    for name, kw in bench.VAL_SPECS + bench.RANK_SPECS:
        assert kw["mb"] not in cal_mbs, name
        if kw["pp"] > 1:
            assert (kw["dp"], kw["pp"]) not in cal_layouts and kw["ranges"] is not None, name
    assert len({(_config(kw), kw["recompute"]) for _, kw in bench.RANK_SPECS}) == len(bench.RANK_SPECS)


def test_summary_checks_the_targets_and_the_ranking():
    bench = _bench()

    def row(name, wall, pred, ranking=True):
        return {"name": name, "wall_s": wall, "predicted_s": pred, "error": pred / wall - 1, "ranking": ranking}

    good = bench.summary([row("a", 1.0, 1.02), row("b", 2.0, 1.96), row("c", 3.0, 3.1), row("v", 5, 5.2, False)])
    assert good["same_order"] and good["kendall_tau"] == 1.0 and all(good["targets"].values())
    bad = bench.summary([row("a", 1.0, 2.5), row("b", 2.0, 1.9)])
    assert not bad["same_order"] and bad["kendall_tau"] == -1.0
    assert not bad["targets"]["mean_abs_error <= 5%"] and not bad["targets"]["max_abs_error <= 10%"]


def _ranking():
    _bench()  # puts the repository root on the path
    return importlib.import_module("benchmarks.bench_sim_ranking")


def test_candidate_pairs_count_only_when_the_rounds_order_them():
    """docs/sim.md's pre-registered rule: a pair is ordered when its per-round mean difference is over two
    standard errors from zero; the target fails only on an ordered pair the simulator orders the other way."""
    ranking = _ranking()
    rng = np.random.default_rng(0)
    noise = rng.normal(0.0, 0.3, size=20)
    measured = {name: [{"wall_s": base + n + (0.02 * i if name == "C" else 0.0)} for i, n in enumerate(noise)]
                for name, base in (("A", 10.0), ("B", 12.0), ("C", 10.0))}
    predicted = {"A": 10.1, "B": 11.9, "C": 9.9}
    pairs = {(p["a"], p["b"]): p for p in ranking.pair_verdicts(measured, predicted)}
    assert pairs["A", "B"]["ordered"] and pairs["A", "B"]["measured_faster"] == "A" and pairs["A", "B"]["agrees"]
    # A and C share the round noise; C drifts 0.02 s a round: the mean 0.19 s is far over 2 SE (0.03 s)
    assert pairs["A", "C"]["ordered"] and pairs["A", "C"]["measured_faster"] == "A"
    assert pairs["A", "C"]["agrees"] is False and not ranking.ranking_met(list(pairs.values()))
    # the same data with a noisy C: a tie at this resolution, which counts neither way
    measured["C"] = [{"wall_s": 10.0 + x} for x in rng.normal(0.0, 1.0, size=20)]
    tied = {(p["a"], p["b"]): p for p in ranking.pair_verdicts(measured, predicted)}
    assert not tied["A", "C"]["ordered"] and tied["A", "C"]["agrees"] is None
    assert tied["A", "C"]["se_s"] > 0.1 and ranking.ranking_met([tied["A", "B"], tied["A", "C"]])


def test_stored_run3_packs_give_run3s_prediction(shared_stats_dir, monkeypatch):
    """The packs bench_sim_ranking measures are run 3's: its stored calibration predicts them to 1e-6."""
    ranking = _ranking()
    runs_mod = importlib.import_module("benchmarks.cpu_runs")
    monkeypatch.setattr(runs_mod, "SHARED_STATS", shared_stats_dir)
    from omnibal.cost.presets import get_model_preset
    from omnibal.cost.profile import cost_table_from_profile

    ref = ranking.load_reference(ranking.RUN3)
    spec = get_model_preset(runs_mod.MODEL)
    table = cost_table_from_profile(spec, ref["profile"])
    stats = runs_mod.load_stats(ref["samples_per_seed"], runs_mod.VAL_SEED, "validation")
    runs = ranking.run3_candidates(ref, table, stats, ref["timed_steps"] + 1, [la.name for la in spec.layers()])
    rebuilt = ranking.rebuilt_prediction(ref, runs, table)
    stored = {r["name"]: r["predicted_s"] for r in ref["validation"] if r["name"] in runs}
    assert sorted(rebuilt) == sorted(stored) and len(stored) == 4
    for name, value in stored.items():
        assert abs(rebuilt[name] / value - 1.0) < 1e-6, name
