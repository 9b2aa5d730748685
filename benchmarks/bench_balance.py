"""Benchmark of the balancers on the real InternVL-1.2M statistics (and 1.2M / 10M rows for speed).

    PYTHONPATH=src python benchmarks/bench_balance.py [--stats-dir DIR] [--quick] [--skip-10m]

Sections: every method on the real subsets (ai2d, chartqa, merged); omnibal's pads against its buffer and
its balance across ranks and micro-batches on each real subset, the merged stats, a two-subset mixture
with different tile profiles (mostly 3 vs mostly 5 tiles) and the synthetic default mixture; the fixed
caps 9/4096 (InternVL's default), 12/4096, 12/4800 and 16/4352 for omnibal vs faithful ISF; 1.2M (and
10M) rows for speed. Beside every pad: ``pad_floor``, the bound no packing beats within the samples
tolerance; where a pad misses 0.02 the case is run again at ``samples_tolerance`` 0.4. Writes
benchmarks/results/balance.json and balance.md. Not a test: it reports what it measured, with the machine
load next to the timings (the machine is shared; CPU seconds are reported beside wall seconds).
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
from omnibal.data.balance import BalanceConfig, balance  # noqa: E402
from omnibal.data.balance.floor import pad_floor  # noqa: E402
from omnibal.data.balance.isf import isf_pack, search_caps  # noqa: E402
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
PAD_KEYS = ["buffer_pad_tiles", "buffer_pad_tokens", "vision_max_mean_ranks", "llm_max_mean_ranks",
            "total_max_mean_ranks", "llm_max_mean_ranks_worst", "vision_max_mean_microbatches",
            "llm_max_mean_microbatches", "total_max_mean_microbatches", "samples_per_microbatch_mean",
            "caps_tiles", "caps_tokens", "num_steps", "microbatches_over_caps", "coverage_ok"]
KEYS = ["vision_max_mean_ranks", "llm_max_mean_ranks", "total_max_mean_ranks", "vision_max_mean_ranks_worst",
        "llm_max_mean_ranks_worst", "total_max_mean_microbatches", "buffer_pad_tiles", "buffer_pad_tokens",
        "pad_ratio_longest", "dist_ratio_vision", "dist_ratio_text", "useful_fraction",
        "samples_per_microbatch_mean", "samples_per_microbatch_std", "caps_tiles", "caps_tokens", "num_steps",
        "steps_with_empty_microbatches", "coverage_ok", "coverage_missing", "coverage_repeated"]

_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {src!r})
import numpy as np
from omnibal.data.balance import BalanceConfig, balance
from omnibal.data.balance.floor import pad_floor
from omnibal.data.metrics import schedule_metrics
from omnibal.stats.table import SampleStats
from omnibal.stats.io import load_stats
kind, n, dp, method = {kind!r}, {n}, {dp}, {method!r}
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
w0, c0 = time.perf_counter(), time.process_time()
sched = balance(stats, dp_size=dp, config=cfg)
wall, cpu = time.perf_counter() - w0, time.process_time() - c0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m = schedule_metrics(sched, stats)
fl = pad_floor(stats.tiles, stats.tokens, slots_per_step=dp, samples_tolerance=cfg.samples_tolerance)
print(json.dumps({{"rows": len(stats), "wall_s": wall, "cpu_s": cpu, "peak_rss_mib": peak / 1024,
                  "input_rss_mib": base / 1024, "samples_tolerance": cfg.samples_tolerance,
                  "floor_tiles": fl.tiles, "floor_tokens": fl.tokens, "metrics": {{k: m[k] for k in {keys!r}}}}}))
"""


def run_child(kind: str, n: int, dp: int, method: str, paths: list[str], cfg: dict, timeout: int) -> dict:
    code = _CHILD.format(src=str(ROOT / "src"), kind=kind, n=n, dp=dp, method=method, paths=paths, cfg=cfg,
                         keys=KEYS)
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
        return f"{x:.3f}" if abs(x) < 100 else f"{x:.0f}"
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


def pad_table(subsets: dict) -> list[dict]:
    """omnibal's derived buffer on every data set: pads and balance across ranks and micro-batches, the floor
    within the samples tolerance beside them; a case missing 0.02 again at tolerance 0.4."""
    rows = []
    for name, stats in subsets.items():
        for dp, micro in ((8, 1), (32, 1), (128, 1), (32, 4)):
            for tol in (0.15, 0.4):
                sched, wall, cpu = timed_balance(stats, dp, BalanceConfig(samples_tolerance=tol), micro)
                if isinstance(sched, str):
                    raise RuntimeError(f"{name} dp {dp} x {micro}: {sched}")
                m = schedule_metrics(sched, stats)
                fl = pad_floor(stats.tiles, stats.tokens, slots_per_step=dp * micro, samples_tolerance=tol)
                rows.append({"subset": name, "rows": len(stats), "dp_size": dp, "num_microbatches": micro,
                             "samples_tolerance": tol, "floor_tiles": fl.tiles, "floor_tokens": fl.tokens,
                             "floor_both": fl.larger,
                             "wall_s": wall, "cpu_s": cpu, **{k: m[k] for k in PAD_KEYS}})
                print(f"pad {name:10s} dp={dp:4d} M={micro} tol {tol} pad {m['buffer_pad_tiles']:.3f}/"
                      f"{m['buffer_pad_tokens']:.3f} floor {fl.tiles:.3f}/{fl.tokens:.3f} both {fl.larger:.3f} "
                      f"llm {m['llm_max_mean_ranks']:.4f} {cpu:.2f}s cpu", file=sys.stderr)
                if max(m["buffer_pad_tiles"], m["buffer_pad_tokens"]) <= 0.02:
                    break
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
    """1.2M rows (real stats replicated; the synthetic default) in separate single-threaded processes."""
    scale = {}
    for dp in (8, 32, 128):
        scale[f"omnibal_1.2M_dp{dp}"] = run_child("real", 1_200_000, dp, "omnibal", paths, {}, timeout=900)
    scale["omnibal_1.2M_synthetic_dp32"] = run_child("synthetic", 1_200_000, 32, "omnibal", [], {}, timeout=900)
    scale["omnibal_1.2M_synthetic_dp32_tolerance0.4"] = run_child("synthetic", 1_200_000, 32, "omnibal", [],
                                                                  {"samples_tolerance": 0.4}, timeout=900)
    print("1.2M omnibal:", {k: (v.get("cpu_s"), v.get("error")) for k, v in scale.items()}, file=sys.stderr)
    scale["isf_1.2M_dp32"] = isf_timing(subsets["merged"].replicate(1_200_000), 32, 50)
    if not skip_10m:
        scale["omnibal_10M_synthetic_dp128"] = run_child("synthetic", 10_000_000, 128, "omnibal", [], {},
                                                         timeout=1800)
    return scale


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stats-dir", default=str(ROOT.parent / "shared" / "data" / "internvl-1.2m-stats"))
    ap.add_argument("--quick", action="store_true", help="fewer ISF iterations, no 1.2M / 10M runs")
    ap.add_argument("--skip-10m", action="store_true")
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
    iters = 10 if args.quick else 50
    result = {"load_before": os.getloadavg(), "cpu_count": os.cpu_count(), "scale": {}}
    t_start, c_start = time.time(), time.process_time()
    result["table"] = methods_table(subsets, iters)
    result["pads"] = pad_table(subsets)
    result["fixed_caps"] = fixed_caps_table(subsets, iters)
    if not args.quick:
        result["scale"] = scale_runs(subsets, paths, args.skip_10m)
    result["load_after"] = os.getloadavg()
    result["bench_minutes"] = (time.time() - t_start) / 60
    result["bench_cpu_minutes_main_process"] = (time.process_time() - c_start) / 60
    out = Path(args.out)
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
    lines += _md_methods(result["table"]) + _md_pads(result["pads"]) + _md_fixed(result["fixed_caps"])
    lines += _md_scale(result["scale"]) if result["scale"] else []
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


def _md_pads(table: list[dict]) -> list[str]:
    cols = ["subset", "rows", "dp_size", "num_microbatches", "samples_tolerance", "buffer_pad_tiles",
            "buffer_pad_tokens", "floor_tiles", "floor_tokens", "floor_both", "vision_max_mean_ranks",
            "llm_max_mean_ranks", "total_max_mean_ranks", "llm_max_mean_ranks_worst",
            "vision_max_mean_microbatches", "llm_max_mean_microbatches", "samples_per_microbatch_mean",
            "caps_tiles", "caps_tokens", "microbatches_over_caps", "coverage_ok", "cpu_s"]
    heads = ["data", "rows", "DP", "M", "samples tolerance", "tile pad", "token pad", "tile floor", "token floor",
             "floor of the larger pad", "vision ranks", "LLM ranks", "total ranks",
             "LLM worst step", "vision micro-batches", "LLM micro-batches", "samples/mb", "Q_v", "Q_t",
             "over caps", "exactly once", "CPU s"]
    note = ("mixture-3/5: two synthetic subsets, wide charts (mostly 3 tiles) and square documents (mostly 5), "
            "half and half; synthetic: the default InternVL-like mixture at the merged stats' size. Floors: "
            "`pad_floor`, each pad's lowest bound over the pack counts the samples tolerance allows (no packing "
            "pads less); the floor of the larger pad is the lowest the two pads can reach together, with the text "
            "coupling (text-heavy samples' packs hold fewer tiles). A case over 0.02 at tolerance 0.15 is run again "
            "at 0.4.")
    return ["", "## omnibal's derived buffer: pads and balance (max/mean across ranks and micro-batches)", "",
            note, ""] + _md_table(heads, [[row[c] for c in cols] for row in table])


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


def _md_scale(scale: dict) -> list[str]:
    lines = ["", "## Scale", "", "| run | rows | wall s | CPU s | peak RSS MiB | vision max/mean | LLM max/mean "
             "| tile pad | token pad | floor (tiles / tokens) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in scale.items():
        if "metrics" in r:
            m = r["metrics"]
            lines.append(f"| {name} | {r['rows']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                         f"{m['vision_max_mean_ranks']:.4f} | {m['llm_max_mean_ranks']:.4f} | "
                         f"{m['buffer_pad_tiles']:.4f} | {m['buffer_pad_tokens']:.4f} | "
                         f"{r.get('floor_tiles', float('nan')):.4f} / {r.get('floor_tokens', float('nan')):.4f} |")
        elif "one_run_cpu_s" in r:
            lines.append(f"| {name}: one ISF run (T=50) at its caps {r['caps']} | 1200000 | "
                         f"{r['one_run_wall_s']:.1f} | {r['one_run_cpu_s']:.1f} | - | - | - | - | - | - |")
            lines.append(f"| {name}: argument search, {r['search_candidates']} candidates x one run (estimate) | "
                         f"1200000 | - | {r['search_estimate_cpu_s']:.0f} | - | - | - | - | - | - |")
        else:
            lines.append(f"| {name} | - | {r.get('error')} | | | | | | | |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
