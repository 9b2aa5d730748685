"""Benchmark the stats layer: load time of 1.2M rows per format, and `omnibal stats` throughput.

1. The real InternVL-1.2M subsets (ai2d + chartqa, ~30.7k rows from ../shared) replicated to 1.2M rows
   with ``SampleStats.replicate``; each format is written, then loaded by ``load_stats`` in a fresh process
   (repeats; min and median; the first load of a process includes importing pyarrow; peak RSS of that
   process and of a process that only imports).
2. ``omnibal stats`` on the project's example annotations scaled up (a generated JSONL of N records
   that cycle over the example records and reference the example images), with and without the example
   tokenizer, 1 and 2 workers; samples/s from the run's own timer (file read to table, interpreter start
   excluded) and the wall time of the whole command.
3. The synthetic mixture (1.2M rows) generation time.

Usage: ``python -m benchmarks.bench_stats [--rows 1200000] [--samples 20000] [--repeats 3]``.
Writes benchmarks/results/stats.json and stats.md. The machine is shared: the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, SHARED_STATS, STATS_FILES, write_result
from omnibal.examples import ANNOTATIONS, EXAMPLES_DIR, TOKENIZER
from omnibal.stats.io import FORMATS, load_stats, save_stats
from omnibal.stats.table import SampleStats

SRC = ROOT / "src"
REAL = list(STATS_FILES)
EXT = {"jsonl": "jsonl", "json": "json", "parquet": "parquet", "token-lengths": "json"}

# Peak RSS from VmHWM: ru_maxrss would carry over the parent's resident size across fork + exec.
LOAD_CHILD = """
import sys, time, json
sys.path.insert(0, {src!r})
from omnibal.stats.io import load_stats
times = []
for _ in range({repeats}):
    t = time.perf_counter(); s = load_stats({path!r}); times.append(time.perf_counter() - t)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({{"times": times, "rows": len(s), "peak_rss_mb": int(hwm) / 1024}}))
"""
IMPORT_CHILD = """
import sys, json
sys.path.insert(0, {src!r})
import omnibal.stats.io, pyarrow.json, pyarrow.parquet
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print(json.dumps({{"peak_rss_mb": int(hwm) / 1024}}))
"""


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def child(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_load(rows: int, repeats: int, work: Path) -> dict:
    real = SampleStats.concat([load_stats(SHARED_STATS / f) for f in REAL])
    big = real.replicate(rows)
    base = child(IMPORT_CHILD.format(src=str(SRC)))["peak_rss_mb"]
    results = []
    for fmt in FORMATS:
        path = work / f"stats_{fmt}.{EXT[fmt]}"
        t = time.perf_counter()
        save_stats(big, path, format=fmt)
        write_s = time.perf_counter() - t
        load_before = load_avg()
        r = child(LOAD_CHILD.format(src=str(SRC), repeats=repeats, path=str(path)))
        assert r["rows"] == rows
        back = load_stats(path)
        same = back.equals(big) if fmt != "token-lengths" else bool(
            (back.tiles == big.tiles).all() and (back.tokens == big.tokens).all() and (back.images == big.images).all()
        )
        results.append({
            "format": fmt, "rows": rows, "file_mb": round(path.stat().st_size / 2**20, 1),
            "write_s": round(write_s, 2), "load_s_min": round(min(r["times"]), 3),
            "load_s_median": round(statistics.median(r["times"]), 3),
            "peak_rss_mb": round(r["peak_rss_mb"], 0), "import_rss_mb": round(base, 0),
            "round_trip_equal": same, "load_avg": [load_before, load_avg()],
        })  # fmt: skip
        print(results[-1], flush=True)
        path.unlink()
    return {"source_rows": len(real), "formats": results}


def scaled_annotations(num_samples: int, path: Path, image_root: Path) -> None:
    """N records cycling over the examples; every record gets its own image files (hard links to the
    example images under distinct names), so no header is read twice through the same path."""
    records = [json.loads(line) for line in ANNOTATIONS.read_text().splitlines()]
    folder = image_root / "images"
    folder.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(num_samples):
            rec = dict(records[i % len(records)])
            rec["id"] = f"{rec['id']}-{i}"
            if "image" in rec and "width" not in rec:
                images = [rec["image"]] if isinstance(rec["image"], str) else rec["image"]
                renamed = []
                for img in images:
                    name = f"images/{i}_{Path(img).name}"
                    try:
                        os.link(EXAMPLES_DIR / img, image_root / name)
                    except OSError:
                        (image_root / name).write_bytes((EXAMPLES_DIR / img).read_bytes())
                    renamed.append(name)
                rec["image"] = renamed[0] if isinstance(rec["image"], str) else renamed
            f.write(json.dumps(rec) + "\n")


def bench_throughput(num_samples: int, repeats: int, work: Path) -> list[dict]:
    ann = work / "scaled.jsonl"
    image_root = work / "root"
    scaled_annotations(num_samples, ann, image_root)
    out = []
    for tokenizer in (None, TOKENIZER):
        for workers in (1, 2):
            runs = []
            for _ in range(repeats):
                report = work / "report.json"
                cmd = [sys.executable, "-m", "omnibal", "stats", str(ann), "--image-root", str(image_root),
                       "--workers", str(workers), "--out", str(work / "o.parquet"), "--report", str(report), "--quiet"]
                if tokenizer:
                    cmd += ["--tokenizer", str(tokenizer)]
                before = load_avg()
                t = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(SRC)})
                wall = time.perf_counter() - t
                run = json.loads(report.read_text())["run"]
                runs.append({"seconds": run["seconds"], "cpu": run["cpu_seconds"], "wall": wall,
                             "load_avg": [before, load_avg()]})  # fmt: skip
            best = min(runs, key=lambda r: r["seconds"])
            out.append({
                "samples": num_samples, "tokens": "tokenizer" if tokenizer else "estimate", "workers": workers,
                "seconds_min": round(best["seconds"], 2),
                "seconds_median": round(statistics.median(r["seconds"] for r in runs), 2),
                "samples_per_s": round(num_samples / best["seconds"]),
                "cpu_s_min": round(min(r["cpu"] for r in runs), 2),
                "samples_per_cpu_s": round(num_samples / min(r["cpu"] for r in runs)),
                "wall_s_min": round(min(r["wall"] for r in runs), 2),
                "headers_read": run["num_headers_read"], "load_avg": [r["load_avg"] for r in runs],
            })  # fmt: skip
            print(out[-1], flush=True)
    return out


def bench_synthetic(repeats: int) -> dict:
    from omnibal.stats.summary import summarize
    from omnibal.stats.synthetic import synthetic_internvl_mixture

    times, sum_times = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        s = synthetic_internvl_mixture(1_200_000, seed=0)
        times.append(time.perf_counter() - t)
        t = time.perf_counter()
        summarize(s)
        sum_times.append(time.perf_counter() - t)
    return {"rows": 1_200_000, "generate_s_min": round(min(times), 3),
            "generate_s_median": round(statistics.median(times), 3),
            "summarize_s_min": round(min(sum_times), 3), "load_avg": load_avg()}  # fmt: skip


def markdown(res: dict) -> str:
    lines = [
        "# Stats benchmarks",
        "",
        f"Machine: {res['machine']}; {res['cores']} cores shared with other jobs; load average at start "
        f"{res['load_avg_start']}, at end {res['load_avg_end']} (the figures are disturbed accordingly: "
        "min of repeats is the best estimate of the undisturbed time).",
        "",
        f"## Load time of {res['load']['formats'][0]['rows']:,} rows",
        "",
        f"The real ai2d + chartqa statistics ({res['load']['source_rows']:,} rows) replicated with "
        "`SampleStats.replicate`; `load_stats` in a fresh process, "
        f"{res['repeats']} loads each. Peak RSS is that process's maximum (an import-only process peaks at "
        f"{res['load']['formats'][0]['import_rss_mb']:.0f} MB).",
        "",
        "| format | file MB | write s | load s (min) | load s (median) | peak RSS MB | round trip equal | load avg |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in res["load"]["formats"]:
        lines.append(
            f"| {r['format']} | {r['file_mb']} | {r['write_s']} | {r['load_s_min']} | {r['load_s_median']} | "
            f"{r['peak_rss_mb']:.0f} | {r['round_trip_equal']} | {r['load_avg'][0]}-{r['load_avg'][1]} |"
        )
    t = res["throughput"]
    lines += [
        "",
        f"## `omnibal stats` throughput ({t[0]['samples']:,} annotation records)",
        "",
        "The example annotations cycled to N records (single-image, multi-image, text-only and one with a "
        "given size; 16 images per 15 records); every record has its own image files (hard links to the "
        "example PNG/JPEGs under distinct names), whose headers are read. "
        "samples/s = records / the run's own time (file to table); wall includes interpreter start and "
        "writing the parquet output. CPU s = CPU time of the run in the main process and its workers "
        "(independent of the machine's load): with W workers, wall time on an idle machine with W free "
        "cores approaches CPU s / W plus the main process's share.",
        "",
        "| tokens | workers | samples/s | run s (min) | run s (median) | CPU s (min) | samples per CPU s "
        "| wall s (min) | headers read | load avg (start-end of each run) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in t:
        loads = ", ".join(f"{a}-{b}" for a, b in r["load_avg"])
        lines.append(
            f"| {r['tokens']} | {r['workers']} | {r['samples_per_s']:,} | {r['seconds_min']} | "
            f"{r['seconds_median']} | {r['cpu_s_min']} | {r['samples_per_cpu_s']:,} | {r['wall_s_min']} | "
            f"{r['headers_read']:,} | {loads} |"
        )
    s = res["synthetic"]
    lines += [
        "",
        "## Synthetic mixture",
        "",
        f"`synthetic_internvl_mixture(1_200_000)`: {s['generate_s_min']} s (min), {s['generate_s_median']} s "
        f"(median); `summarize` of it: {s['summarize_s_min']} s.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_200_000)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    res = {"machine": f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
           "cores": os.cpu_count(), "repeats": args.repeats, "load_avg_start": load_avg()}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="omnibal-bench-stats-") as tmp:
        work = Path(tmp)
        res["load"] = bench_load(args.rows, args.repeats, work)
        res["throughput"] = bench_throughput(args.samples, args.repeats, work)
    res["synthetic"] = bench_synthetic(args.repeats)
    res["load_avg_end"] = load_avg()
    write_result("stats", res, markdown(res), out=args.out)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
