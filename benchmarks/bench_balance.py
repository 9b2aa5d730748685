"""Benchmark of the balancers on the real InternVL-1.2M statistics (and 1.2M / 10M rows for speed).

    PYTHONPATH=src python benchmarks/bench_balance.py [--stats-dir DIR] [--quick] [--skip-10m] [--scale-only]

Sections: every method on the real subsets (ai2d, chartqa, merged); omnibal against the issue-35 goals on
each real subset, the merged stats, a two-subset mixture with different tile profiles (mostly 3 vs mostly 5
tiles) and the synthetic default mixture, at DP 8-1024 and 1-8 micro-batches: the fixed buffer's compute pad
beside its floor (``pad_floor``: no packing pads less within the samples tolerance) and the target
``max(0.01, floor + 0.002)``, balance across ranks of each named cost, CPU seconds per phase; the fixed caps
9/4096 (InternVL's default), 12/4096, 12/4800 and 16/4352 for omnibal vs faithful ISF; 1.2M and 10M rows
(the real stats replicated; the synthetic default) in separate single-threaded processes (10M rows also
chunked across every core, and unchunked), with a row per phase and the peak memory. Writes
benchmarks/results/balance.json and balance.md. Not a test: it reports what it measured, with the machine
load next to the timings (the machine is shared; CPU seconds are reported beside wall seconds).
``--scale-only`` reruns only the 1.2M / 10M section into the existing balance.json (on a quieter moment
than the whole run had), recording that section's own load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # the two-profile mixture the tests use (balance_helpers)

import numpy as np  # noqa: E402

from balance_helpers import two_profile_mixture  # noqa: E402
from omnibal.data.balance import DEFAULT_COST, BalanceConfig, balance  # noqa: E402
from omnibal.data.balance.floor import pad_floor, vision_balance_floor  # noqa: E402
from omnibal.data.balance.isf import isf_pack, search_caps  # noqa: E402
from omnibal.data.balance.phases import record_phases  # noqa: E402
from omnibal.data.metrics import schedule_metrics  # noqa: E402
from omnibal.stats.io import load_stats  # noqa: E402
from omnibal.stats.synthetic import synthetic_internvl_mixture  # noqa: E402
from omnibal.stats.table import SampleStats  # noqa: E402

FILES = {"ai2d": "ai2d_train_12k_wh_token_lengths.json", "chartqa": "chartqa_train_18k_wh_token_lengths.json"}
METHODS = [("random", "random fixed micro-batch of 4"), ("length-grouped", "LLaVA length-grouped (4)"),
           ("isf", "faithful ISF (argument search)"), ("isf@ref", "faithful ISF at the reference's caps 18/6016"),
           ("isf+assign", "ISF packs + omnibal assignment"),
           ("omnibal", "omnibal")]
FIXED_CAPS = [(9, 4096), (12, 4096), (12, 4800), (16, 4352)]
"""InternVL's default 9/4096 and the caps the issue measured the balancer failing at."""
PAD_KEYS = ["buffer_pad_tiles", "buffer_pad_tokens", "buffer_pad_compute", "vision_max_mean_ranks",
            "llm_max_mean_ranks", "llm_linear_max_mean_ranks", "llm_attention_max_mean_ranks",
            "total_max_mean_ranks", "llm_max_mean_ranks_worst", "vision_max_mean_microbatches",
            "llm_max_mean_microbatches", "total_max_mean_microbatches", "samples_per_microbatch_mean",
            "caps_tiles", "caps_tokens", "num_steps", "microbatches_over_caps", "coverage_ok", "cost_model"]
GOAL_CELLS = [(8, 1), (32, 1), (128, 1), (1024, 1), (32, 4), (8, 8), (128, 8)]
"""(DP, micro-batches per step) of the goals table: DP 8-1024, M 1-8."""
PHASES = ["cap_search", "deal", "tile_repair", "token_levelling", "llm_levelling", "tail", "squeeze", "assign",
          "schedule"]
KEYS = ["vision_max_mean_ranks", "llm_max_mean_ranks", "llm_attention_max_mean_ranks", "total_max_mean_ranks",
        "vision_max_mean_ranks_worst", "buffer_pad_compute", "cost_model",
        "llm_max_mean_ranks_worst", "total_max_mean_microbatches", "buffer_pad_tiles", "buffer_pad_tokens",
        "pad_ratio_longest", "dist_ratio_vision", "dist_ratio_text", "useful_fraction",
        "samples_per_microbatch_mean", "samples_per_microbatch_std", "caps_tiles", "caps_tokens", "num_steps",
        "steps_with_empty_microbatches", "coverage_ok", "coverage_missing", "coverage_repeated"]

_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {src!r})
import numpy as np
from omnibal.data.balance import DEFAULT_COST, BalanceConfig, balance
from omnibal.data.balance.floor import pad_floor
from omnibal.data.balance.phases import record_phases
from omnibal.data.metrics import schedule_metrics
from omnibal.stats.table import SampleStats
from omnibal.stats.io import load_stats
kind, n, dp, micro, method = {kind!r}, {n}, {dp}, {micro}, {method!r}
if kind == "real":
    parts = [load_stats(p) for p in {paths!r}]
    stats = SampleStats.concat(parts).replicate(n)
elif n == 1_200_000:  # the synthetic default is built for 1.2M rows
    from omnibal.stats.synthetic import synthetic_internvl_mixture
    stats = synthetic_internvl_mixture(seed=0)
else:
    from omnibal.stats.synthetic import synthetic_internvl_mixture
    stats = synthetic_internvl_mixture(n, seed=0)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = BalanceConfig(method=method, **{cfg!r})
def children_cpu():  # the balancer's worker processes (``workers`` > 1), once they have exited
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime
w0, c0, k0 = time.perf_counter(), time.process_time(), children_cpu()
with record_phases() as phases:
    sched = balance(stats, dp_size=dp, num_microbatches=micro, config=cfg)
wall, cpu = time.perf_counter() - w0, time.process_time() - c0 + children_cpu() - k0
peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
m = schedule_metrics(sched, stats)
fl = pad_floor(stats.tiles, stats.tokens, slots_per_step=dp * micro, samples_tolerance=cfg.samples_tolerance,
               cost=DEFAULT_COST)
print(json.dumps({{"rows": len(stats), "dp_size": dp, "num_microbatches": micro, "wall_s": wall, "cpu_s": cpu,
                  "phases_cpu_s": phases, "peak_rss_mib": peak / 1024, "input_rss_mib": base / 1024,
                  "samples_tolerance": cfg.samples_tolerance, "floor_tiles": fl.tiles, "floor_tokens": fl.tokens,
                  "floor_compute": fl.compute, "metrics": {{k: m[k] for k in {keys!r}}}}}))
"""


def run_child(kind: str, n: int, dp: int, method: str, paths: list[str], cfg: dict, timeout: int,
              micro: int = 1) -> dict:
    code = _CHILD.format(src=str(ROOT / "src"), kind=kind, n=n, dp=dp, micro=micro, method=method, paths=paths,
                         cfg=cfg, keys=sorted(set(KEYS) | set(PAD_KEYS)))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"rc {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def isf_timing(stats: SampleStats, dp: int, iterations: int) -> dict:
    """Faithful ISF on the big input: one packing run at the caps its search picks on the real rows, and the
    size of the search (candidates x one run) -- the search itself is what makes the reference slow."""
    small = stats.take(np.arange(min(len(stats), 30730)))
    t0 = time.perf_counter()
    qv, qt, tried = search_caps(small.tiles, small.tokens, dp_size=dp, threshold=128, iterations=iterations,
                                rng=np.random.default_rng(0))
    search_small = time.perf_counter() - t0
    w0, c0 = time.perf_counter(), time.process_time()
    isf_pack(stats.tiles, stats.tokens, max_tiles=qv, max_tokens=qt, threshold=128, iterations=iterations,
             rng=np.random.default_rng(0))
    one_wall, one_cpu = time.perf_counter() - w0, time.process_time() - c0
    return {"caps": [qv, qt], "search_candidates": tried, "one_run_wall_s": one_wall, "one_run_cpu_s": one_cpu,
            "per_iteration_cpu_s": one_cpu / iterations, "search_on_30k_rows_s": search_small,
            "search_estimate_cpu_s": tried * one_cpu + one_cpu}


def fmt(x) -> str:
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.4f}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)


def timed_balance(stats, dp: int, config: BalanceConfig, num_microbatches: int = 1):
    """(schedule or the error's text, wall s, CPU s)."""
    w0, c0 = time.perf_counter(), time.process_time()
    try:
        sched = balance(stats, dp_size=dp, num_microbatches=num_microbatches, config=config)
    except ValueError as exc:  # InputError: report it, it is a result
        sched = f"{type(exc).__name__}: {str(exc)[:160]}"
    return sched, time.perf_counter() - w0, time.process_time() - c0


def methods_table(subsets: dict, iters: int) -> list[dict]:
    """Every method on the real subsets at DP 8/32/128 (ISF with its own argument search)."""
    rows = []
    for name in ("ai2d", "chartqa", "merged"):
        stats = subsets[name]
        for dp in (8, 32, 128):
            for method, label in METHODS:
                if method == "isf@ref":
                    if name != "merged":
                        continue
                    cfg = BalanceConfig(method="isf", isf_iterations=iters, max_tiles=18, max_tokens=6016)
                else:
                    cfg = BalanceConfig(method=method, isf_iterations=iters)
                sched, wall, cpu = timed_balance(stats, dp, cfg)
                if isinstance(sched, str):
                    raise RuntimeError(f"{name} dp {dp} {method}: {sched}")
                m = schedule_metrics(sched, stats)
                rows.append({"subset": name, "rows": len(stats), "dp_size": dp, "method": method, "label": label,
                             "caps_source": "fixed" if method == "isf@ref" else "searched",
                             "wall_s": wall, "cpu_s": cpu, **{k: m[k] for k in KEYS}})
                print(f"{name:8s} dp={dp:4d} {method:15s} vis {m['vision_max_mean_ranks']:.4f} "
                      f"llm {m['llm_max_mean_ranks']:.4f} pad {m['buffer_pad_tiles']:.3f}/{m['buffer_pad_tokens']:.3f} "
                      f"{cpu:.2f}s cpu", file=sys.stderr)
    return rows


def goal_row(name: str, stats, dp: int, micro: int) -> dict:
    """omnibal's derived buffer in one cell: pads and their floors, balance of each named cost, phases."""
    with record_phases() as phases:
        sched, wall, cpu = timed_balance(stats, dp, BalanceConfig(), micro)
    if isinstance(sched, str):
        return {"subset": name, "rows": len(stats), "dp_size": dp, "num_microbatches": micro, "error": sched,
                "wall_s": wall, "cpu_s": cpu}
    m = schedule_metrics(sched, stats)
    fl = pad_floor(stats.tiles, stats.tokens, slots_per_step=dp * micro, cost=DEFAULT_COST)
    target = max(0.01, fl.compute + 0.002)
    vision_floor = vision_balance_floor(stats.tiles, dp_size=dp, tile_pad=m["buffer_pad_tiles"])
    return {"subset": name, "rows": len(stats), "dp_size": dp, "num_microbatches": micro,
            "floor_tiles": fl.tiles, "floor_tokens": fl.tokens, "floor_both": fl.larger, "floor_compute": fl.compute,
            "vision_floor": vision_floor, "vision_floor_pad_0_1": vision_balance_floor(stats.tiles, dp_size=dp,
                                                                                         tile_pad=0.1),
            "target_compute": target, "pad_met": m["buffer_pad_compute"] <= target + 1e-12,
            "balance_met": max(m["vision_max_mean_ranks"], m["llm_max_mean_ranks"]) <= 1.002,
            "wall_s": wall, "cpu_s": cpu, "phases_cpu_s": dict(phases), **{k: m[k] for k in PAD_KEYS}}


def goals_table(subsets: dict) -> list[dict]:
    """omnibal on every data set at DP 8-1024 x M 1-8 against the issue-35 goals (pad <= max(0.01, floor +
    0.002), vision and LLM max/mean <= 1.002), with the floors and the CPU seconds of each phase."""
    rows = []
    for name, stats in subsets.items():
        for dp, micro in GOAL_CELLS:
            if len(stats) < dp * micro:
                continue
            row = goal_row(name, stats, dp, micro)
            rows.append(row)
            if "error" in row:
                print(f"goal {name} dp={dp} M={micro}: {row['error']}", file=sys.stderr)
                continue
            print(f"goal {name:10s} dp={dp:4d} M={micro} pad {row['buffer_pad_tiles']:.4f}/"
                  f"{row['buffer_pad_tokens']:.4f} compute {row['buffer_pad_compute']:.4f} floor "
                  f"{row['floor_compute']:.4f} vis {row['vision_max_mean_ranks']:.4f} llm "
                  f"{row['llm_max_mean_ranks']:.4f} {row['cpu_s']:.2f}s cpu", file=sys.stderr)
    return rows


def fixed_caps_table(subsets: dict, iters: int, dp: int = 32) -> list[dict]:
    """omnibal vs faithful ISF at the fixed caps (samples over a cap run alone: oversize='own_pack')."""
    rows = []
    for name, stats in subsets.items():
        for qv, qt in FIXED_CAPS:
            for method in ("omnibal", "isf"):
                cfg = BalanceConfig(method=method, max_tiles=qv, max_tokens=qt, oversize="own_pack",
                                    isf_iterations=iters)
                sched, wall, cpu = timed_balance(stats, dp, cfg)
                row = {"subset": name, "rows": len(stats), "dp_size": dp, "caps": f"{qv}/{qt}", "method": method,
                       "wall_s": wall, "cpu_s": cpu}
                if isinstance(sched, str):
                    row["error"] = sched
                else:
                    m = schedule_metrics(sched, stats)
                    own = len(sched.meta.get("own_packs", [])) if method == "omnibal" else int(
                        ((stats.tiles > qv) | (stats.tokens > qt)).sum())
                    row.update({k: m[k] for k in PAD_KEYS}, own_packs=own)
                rows.append(row)
                print(f"fixed {name:10s} {qv}/{qt} {method:8s} {row.get('error', 'ok')[:60]}", file=sys.stderr)
    return rows


def scale_runs(subsets: dict, paths: list[str], skip_10m: bool) -> dict:
    """1.2M rows (real stats replicated; the synthetic default) and 10M in separate single-threaded processes."""
    scale = {}
    for dp, micro in ((8, 1), (32, 1), (128, 1), (1024, 1), (32, 8)):
        scale[f"omnibal_1.2M_dp{dp}x{micro}"] = run_child("real", 1_200_000, dp, "omnibal", paths, {}, timeout=1800,
                                                          micro=micro)
    scale["omnibal_1.2M_synthetic_dp32"] = run_child("synthetic", 1_200_000, 32, "omnibal", [], {}, timeout=1800)
    print("1.2M omnibal:", {k: (v.get("cpu_s"), v.get("error")) for k, v in scale.items()}, file=sys.stderr)
    scale["isf_1.2M_dp32"] = isf_timing(subsets["merged"].replicate(1_200_000), 32, 50)
    if not skip_10m:  # chunked (``BalanceConfig.chunk_rows``): one core, every core (the same schedule), unchunked
        cores = os.cpu_count() or 1
        for name, cfg in (("omnibal_10M_dp128", {}), (f"omnibal_10M_dp128_{cores}cores", {"workers": cores}),
                          ("omnibal_10M_dp128_unchunked", {"chunk_rows": None})):
            scale[name] = run_child("real", 10_000_000, 128, "omnibal", paths, cfg, timeout=3600)
            print(f"10M {name}:", scale[name].get("wall_s"), scale[name].get("cpu_s"), file=sys.stderr)
    return scale


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stats-dir", default=str(ROOT.parent / "shared" / "data" / "internvl-1.2m-stats"))
    ap.add_argument("--quick", action="store_true", help="fewer ISF iterations, no 1.2M / 10M runs")
    ap.add_argument("--skip-10m", action="store_true")
    ap.add_argument("--scale-only", action="store_true",
                    help="rerun only the 1.2M / 10M section into the existing balance.json, with its own load")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    sd = Path(args.stats_dir)
    if not sd.is_dir():
        sd = Path("/work/shared/data/internvl-1.2m-stats")
    paths = [str(sd / f) for f in FILES.values()]
    parts = {name: load_stats(str(sd / f)) for name, f in FILES.items()}
    merged = SampleStats.concat([parts["ai2d"], parts["chartqa"]])
    subsets = {**parts, "merged": merged, "mixture-3/5": two_profile_mixture(30_000),
               "synthetic": synthetic_internvl_mixture(len(merged), seed=0)}
    out = Path(args.out)
    if args.scale_only:
        result = json.loads((out / "balance.json").read_text())
        load_before = os.getloadavg()
        result["scale"] = scale_runs(subsets, paths, args.skip_10m)
        result["scale_load"] = [load_before[0], os.getloadavg()[0]]
        return _write(result, out)
    iters = 10 if args.quick else 50
    result = {"load_before": os.getloadavg(), "cpu_count": os.cpu_count(), "scale": {}}
    t_start, c_start = time.time(), time.process_time()
    result["table"] = methods_table(subsets, iters)
    result["goals"] = goals_table(subsets)
    result["fixed_caps"] = fixed_caps_table(subsets, iters)
    if not args.quick:
        result["scale"] = scale_runs(subsets, paths, args.skip_10m)
    result["load_after"] = os.getloadavg()
    result["bench_minutes"] = (time.time() - t_start) / 60
    result["bench_cpu_minutes_main_process"] = (time.process_time() - c_start) / 60
    return _write(result, out)


def _write(result: dict, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "balance.json").write_text(json.dumps(result, indent=1))
    (out / "balance.md").write_text(render_md(result))
    print((out / "balance.md").read_text())
    return 0


def render_md(result: dict) -> str:
    lines = ["# Balance benchmark (benchmarks/bench_balance.py)", "",
             f"Machine: {result['cpu_count']} cores shared with other jobs; load average before "
             f"{result['load_before'][0]:.1f}, after {result['load_after'][0]:.1f}. Cost model: analytic "
             "InternViT-6B + InternLM2-20B (training FLOPs). max/mean columns are per-step max/mean across "
             "ranks (or across all micro-batches of a step), averaged over steps (worst step beside); pads are "
             "against the fixed (Q_v, Q_t) buffer; random and length-grouped run padded to their longest sample.",
             ""]
    lines += _md_methods(result["table"]) + _md_goals(result["goals"]) + _md_fixed(result["fixed_caps"])
    lines += _md_scale(result) if result["scale"] else []
    return "\n".join(lines) + "\n"


def _md_table(heads: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)] + [
        "| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]


def _md_methods(table: list[dict]) -> list[str]:
    cols = ["subset", "dp_size", "label", "vision_max_mean_ranks", "llm_max_mean_ranks", "total_max_mean_ranks",
            "llm_max_mean_ranks_worst", "buffer_pad_tiles", "buffer_pad_tokens", "dist_ratio_vision",
            "dist_ratio_text", "useful_fraction", "samples_per_microbatch_mean", "caps_tiles", "caps_tokens",
            "coverage_ok", "cpu_s"]
    heads = ["subset", "DP", "method", "vision max/mean", "LLM max/mean", "total max/mean", "LLM worst step",
             "tile pad", "token pad", "vision DR", "text DR", "useful", "samples/mb", "Q_v", "Q_t", "exactly once",
             "CPU s"]
    return ["## Every method on the real subsets (one micro-batch per rank)", ""] + _md_table(
        heads, [[row[c] for c in cols] for row in table])


def _md_goals(table: list[dict]) -> list[str]:
    ok = [r for r in table if "error" not in r]
    cols = ["subset", "rows", "dp_size", "num_microbatches", "buffer_pad_tiles", "buffer_pad_tokens",
            "buffer_pad_compute", "floor_compute", "target_compute", "pad_met", "vision_max_mean_ranks",
            "vision_floor", "llm_max_mean_ranks", "llm_attention_max_mean_ranks", "total_max_mean_ranks", "balance_met",
            "samples_per_microbatch_mean", "caps_tiles", "caps_tokens", "coverage_ok", "cpu_s", "wall_s"]
    heads = ["data", "rows", "DP", "M", "tile pad", "token pad", "compute pad", "compute floor",
             "target max(0.01, floor+0.002)", "pad met", "vision max/mean", "vision floor",
             "LLM (linear+attn) max/mean",
             "LLM attention alone", "total max/mean", "<= 1.002", "samples/mb", "Q_v", "Q_t", "exactly once",
             "CPU s", "wall s"]
    note = ("Cost: the analytic training FLOPs of InternViT-6B + InternLM2-20B (`BalanceCost.internvl_6b_20b`): "
            "vision = encoder + projector per tile; LLM = linear (weights, per token) + causal attention (per "
            "sample's tokens**2); the attention part alone beside it; total = vision + LLM. max/mean: per step, the "
            "most loaded rank over the ranks' mean, averaged over steps. Compute pad: `1 - cost packed / cost padded "
            "to the (Q_v, Q_t) buffer`; its floor: `pad_floor(..., cost=)`, the lowest any packing reaches within the "
            "samples tolerance (0.15) with the text coupling and the tokens the fullest packs must hold. mixture-3/5: "
            "two synthetic subsets, wide charts (mostly "
            "3 tiles) and square documents (mostly 5), half and half; synthetic: the default InternVL-like mixture "
            "at the merged stats' size. Vision floor: `vision_balance_floor` at the cell's tile pad, the lowest vision "
            "max/mean any schedule with that tile pad reaches (a step whose tiles are not a multiple of DP has a "
            "rank over the mean; the residues of the steps sum to at least (-V) mod DP): where it is over 1.002 the "
            "balance goal is out of reach without a larger buffer.")
    lines = ["", "## Issue-35 goals: compute pad vs its floor, balance of each named cost (DP 8-1024, M 1-8)", "",
             note, ""] + _md_table(heads, [[row[c] for c in cols] for row in ok])
    errors = [r for r in table if "error" in r]
    if errors:
        lines += ["", "Refused: " + "; ".join(f"{r['subset']} DP {r['dp_size']} x {r['num_microbatches']}: "
                                               f"{r['error'][:120]}" for r in errors)]
    met = sum(r["pad_met"] for r in ok), sum(r["balance_met"] for r in ok)
    bound = [r for r in ok if not r["balance_met"] and r["vision_floor_pad_0_1"] > 1.002]
    lines += ["", f"Pad at or under its target in {met[0]} of {len(ok)} cells; vision and LLM max/mean both <= "
              f"1.002 in {met[1]} of {len(ok)}. Of the {len(ok) - met[1]} others, {len(bound)} cannot meet it "
              "with any schedule whose tile pad is under 0.1 (vision floor at tile pad 0.1 over 1.002: "
              + ", ".join(f"{r['subset']} {r['dp_size']}x{r['num_microbatches']} {r['vision_floor_pad_0_1']:.4f}"
                          for r in bound) + ").", "", "CPU seconds per phase, summed over the cells above:", ""]
    totals = {ph: sum(r["phases_cpu_s"].get(ph, 0.0) for r in ok) for ph in PHASES}
    lines += _md_table(PHASES + ["all"], [[totals[ph] for ph in PHASES] + [sum(r["cpu_s"] for r in ok)]])
    return lines


def _md_fixed(table: list[dict]) -> list[str]:
    heads = ["data", "caps", "method", "packs?", "steps", "tile pad", "token pad", "vision ranks", "LLM ranks",
             "LLM worst step", "samples/mb", "own packs", "CPU s"]
    rows = []
    for r in table:
        if "error" in r:
            rows.append([r["subset"], r["caps"], r["method"], r["error"][:90]] + ["-"] * 8 + [r["cpu_s"]])
        else:
            rows.append([r["subset"], r["caps"], r["method"], "yes", r["num_steps"], r["buffer_pad_tiles"],
                         r["buffer_pad_tokens"], r["vision_max_mean_ranks"], r["llm_max_mean_ranks"],
                         r["llm_max_mean_ranks_worst"], r["samples_per_microbatch_mean"], r["own_packs"], r["cpu_s"]])
    return ["", "## Fixed caps: omnibal vs faithful ISF (DP 32; samples over a cap run alone, oversize=own_pack)",
            "", "Pads count the own packs' micro-batches as they are (over the buffer: a negative pad is possible).",
            ""] + _md_table(heads, rows)


def _md_scale(result: dict) -> list[str]:
    scale = result["scale"]
    lines = ["", "## Scale (one core per run, `_Ncores`: N worker processes; OMP/OPENBLAS/MKL_NUM_THREADS=1; "
             "the real stats replicated; CPU s include the worker processes)", ""]
    if "scale_load" in result:
        lines += [f"This section was rerun on its own (`--scale-only`): load average before "
                  f"{result['scale_load'][0]:.1f}, after {result['scale_load'][1]:.1f}.", ""]
    lines += [
             "| run | rows | DP x M | wall s | CPU s | peak RSS MiB | MiB per 1M rows (over the input) | "
             "vision max/mean | LLM (linear+attn) max/mean | tile pad | token pad | compute pad | compute floor |",
             "|" + "---|" * 13]
    phase_rows = []
    for name, r in scale.items():
        if "metrics" in r:
            m = r["metrics"]
            lines.append(f"| {name} | {r['rows']} | {r['dp_size']} x {r['num_microbatches']} | {r['wall_s']:.1f} | "
                         f"{r['cpu_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                         f"{(r['peak_rss_mib'] - r['input_rss_mib']) / r['rows'] * 1e6:.0f} | "
                         f"{m['vision_max_mean_ranks']:.4f} | {m['llm_max_mean_ranks']:.4f} | "
                         f"{m['buffer_pad_tiles']:.4f} | {m['buffer_pad_tokens']:.4f} | {m['buffer_pad_compute']:.4f}"
                         f" | {r.get('floor_compute', float('nan')):.4f} |")
            phase_rows.append([name] + [r["phases_cpu_s"].get(ph, 0.0) for ph in PHASES] + [r["cpu_s"]])
        elif "one_run_cpu_s" in r:
            lines.append(f"| {name}: one ISF run (T=50) at its caps {r['caps']} | 1200000 | 32 x 1 | "
                         f"{r['one_run_wall_s']:.1f} | {r['one_run_cpu_s']:.1f} | - | - | - | - | - | - | - | - |")
            lines.append(f"| {name}: argument search, {r['search_candidates']} candidates x one run (estimate) | "
                         f"1200000 | 32 x 1 | - | {r['search_estimate_cpu_s']:.0f} | - | - | - | - | - | - | - | - |")
        else:
            lines.append(f"| {name} | - | - | {r.get('error')} | | | | | | | | | |")
    lines += ["", "CPU seconds per phase (a phase that grows shows here first):", ""]
    lines += _md_table(["run"] + PHASES + ["all"], phase_rows)
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
