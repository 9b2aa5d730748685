"""Time the default `omnibal plan` (the README's main command) and record its ablation, and the same job on
the real AI2D + ChartQA statistics in ../shared.

Runs the CLI in a subprocess exactly as a user would (no arguments but --out; then ``--stats`` with the two
real subsets merged), REPEATS times for the default, once for the real statistics, and records wall time,
CPU time and the machine load. Writes benchmarks/results/plan_default.json and .md. Run:
    PYTHONPATH=src:. python -m benchmarks.bench_plan_default
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPEATS = int(os.environ.get("REPEATS", "3"))
ROOT = Path(__file__).resolve().parents[1]


def run_once(out: Path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "omnibal", "plan", "--out", str(out), *args], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"omnibal plan failed ({proc.returncode}):\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "load_1min_before": load, "load_1min_after": os.getloadavg()[0],
            "stdout": proc.stdout}


def pack_lines(plan: dict) -> list[str]:
    """The pack-size search of ``plan`` as a markdown table (empty when the search did not run)."""
    pack = plan["data"]["settings"].get("pack_search")
    if not pack:
        return []
    lines = ["", "Pack-size search (each candidate balanced, jointly planned and simulated on a subset; the chosen one "
             "then balanced and searched in full):", "",
             "| micro-batches | target samples | samples / micro-batch | Q_v | Q_t | recomputed (whole + selective) "
             "| GPU days "
             "| chosen |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    chosen = (pack["chosen"] or {}).get("num_microbatches")
    for c in pack["candidates"]:
        note = "OOM" if c["oom"] else "global batch off" if c["off_batch"] else ""
        days = "-" if c["gpu_days"] is None else f"{c['gpu_days']:.1f}"
        lines.append(f"| {c['num_microbatches']} | {c['target_samples']:.2f} | {c['samples_per_microbatch']:.2f} | "
                     f"{c['max_tiles']} | {c['max_tokens']} | {c['num_checkpointed']} + {c.get('num_selective', 0)} | "
                     f"{days} | "
                     f"{'**yes**' if c['num_microbatches'] == chosen else note} |")
    return lines


def real_stats_file(tmp: Path) -> Path | None:
    """The AI2D and ChartQA statistics of ../shared as one file (None when ../shared is absent)."""
    from benchmarks.common import SHARED_STATS, STATS_FILES
    from omnibal.stats.io import load_stats, save_stats
    from omnibal.stats.table import SampleStats

    paths = [SHARED_STATS / name for name in STATS_FILES]
    if not all(p.is_file() for p in paths):
        return None
    merged = SampleStats.concat([load_stats(p) for p in paths], source="ai2d + chartqa (../shared)")
    return save_stats(merged, tmp / "ai2d_chartqa.parquet")


def ablation_lines(rows: list[dict]) -> list[str]:
    lines = ["| step | cut points | recomputed (whole + selective) | step (s) | GPU days | speed-up | paper GPU days "
             "| paper speed-up |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        paper = "" if r["paper_speedup"] is None else f"{r['paper_speedup']:.2f}x"
        recomputed = f"{r['num_checkpointed']} + {r.get('num_selective', 0)}"
        lines.append(f"| {r['name']} | {r['parts']} | {recomputed} | {r['step_time_s']:.2f} | "
                     f"{r['gpu_days']:.1f}{' (OOM)' if r['oom'] else ''} | {r['speedup']:.2f}x | "
                     f"{r['paper_gpu_days'] or ''} | {paper} |")
    return lines


def main() -> None:
    runs, real = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(REPEATS):
            out = Path(tmp) / f"run{i}"
            r = run_once(out)
            r["ablation"] = json.loads((out / "ablation.json").read_text())
            r["plan"] = json.loads((out / "plan.json").read_text())
            runs.append(r)
            print(f"run {i}: wall {r['wall_s']:.1f} s, cpu {r['cpu_s']:.1f} s, load {r['load_1min_before']:.1f}",
                  flush=True)
        stats = real_stats_file(Path(tmp))
        if stats is not None:
            out = Path(tmp) / "real"
            real = run_once(out, "--stats", str(stats))
            real["ablation"] = json.loads((out / "ablation.json").read_text())
            print(f"real stats: wall {real['wall_s']:.1f} s, cpu {real['cpu_s']:.1f} s", flush=True)
    best = min(runs, key=lambda r: r["wall_s"])
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / "plan_default.json").write_text(json.dumps(
        {"runs": [{k: v for k, v in r.items() if k not in ("stdout", "plan")} for r in runs],
         "pack_search": best["plan"]["data"]["settings"].get("pack_search"),
         "real_stats": None if real is None else {k: v for k, v in real.items() if k != "stdout"}}, indent=2) + "\n")
    rows = best["ablation"]["rows"]
    lines = ["# `omnibal plan` (default job) wall time and ablation", "",
             "| run | wall (s) | CPU (s) | load before / after (1 min, 2 cores) |", "| --- | --- | --- | --- |"]
    for i, r in enumerate(runs):
        lines.append(f"| {i} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['load_1min_before']:.1f} / "
                     f"{r['load_1min_after']:.1f} |")
    lines += ["", "Phase times of the fastest run (s): " + ", ".join(
        f"{k} {v:.1f}" for k, v in best["ablation"]["timings"].items()), ""]
    lines += ablation_lines(rows)
    last = rows[-1]
    lines += ["", f"End to end: **{last['speedup']:.2f}x** over the baseline ({rows[0]['gpu_days']:.1f} -> "
              f"{last['gpu_days']:.1f} GPU days); the paper: {61.8 / 21.3:.2f}x (61.8 -> 21.3)."]
    lines += pack_lines(best["plan"])
    if real is not None:
        rrows = real["ablation"]["rows"]
        lines += ["", "## The same job on the real AI2D + ChartQA statistics (../shared, 30k samples)", "",
                  f"wall {real['wall_s']:.1f} s, CPU {real['cpu_s']:.1f} s", ""] + ablation_lines(rrows)
        lines += ["", f"End to end: **{rrows[-1]['speedup']:.2f}x** over the baseline."]
    (results / "plan_default.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
