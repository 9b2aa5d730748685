"""baseline vs online vs offline through `omnibal train --hf-model` at DP2 (the HF InternVL checkpoint and the
real example of bench_train_hf: rendered charts/pages, vision encoder ~half the time).

Each mode over its whole epoch (`--steps 0`), modes interleaved in rounds, one torch thread per rank; real
samples/s and samples per CPU-second (load-robust), median of the rounds.

    python -m benchmarks.bench_online_hf --records 400 --repeats 3

Writes benchmarks/results/online_hf.{json,md}.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.common import write_result
from benchmarks.trainer_runs import MICROBATCHES, data_args, prepare, run_train

MODES = ("baseline", "online", "offline")


def main(argv=None) -> int:
    args, log, work, model = prepare(argv, name="bench_online_hf", description=__doc__.splitlines()[0])
    runs: dict[str, list] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES:
            extra = ["--mode", mode, "--dp", "2", "--pp", "1", "--microbatches", str(MICROBATCHES), "--steps", "0",
                     "--batch-size", "4"]
            doc = run_train(data_args(work, model) + extra, work, f"{mode}_{r}")
            runs[mode].append(doc)
            log(f"round {r} {mode}: {doc['summary']['samples_per_s']:.2f} samples/s")
    res = {"records": args.records, "repeats": args.repeats, "layout": "DP2xPP1", "runs": {}}
    for mode, docs in runs.items():
        sps = [d["summary"]["samples_per_s"] for d in docs]
        per_cpu = [d["summary"]["samples_per_s"] * d["summary"]["mean_step_s"]
                   / sum(x["cpu_s"] for x in d["summary"]["per_rank"]) for d in docs]
        res["runs"][mode] = {"samples_per_s_runs": sps, "samples_per_s_median": statistics.median(sps),
                             "samples_per_cpu_s_median": statistics.median(per_cpu),
                             "steps": docs[0]["summary"]["steps"],
                             "token_pad_ratio": docs[0]["summary"]["token_pad_ratio"],
                             "load": [d["load"] for d in docs]}
    base = res["runs"]["baseline"]
    lines = ["# baseline vs online vs offline, `omnibal train --hf-model` (HF InternVL, real example), DP2", "",
             f"`python -m benchmarks.bench_online_hf`: {args.records} example records, whole epoch per run, median of "
             f"{args.repeats} interleaved rounds, one torch thread per rank.", "",
             "| mode | steps | samples/s | vs baseline | samples per CPU-s | vs baseline | token pad "
             "| load (before, after) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, r in res["runs"].items():
        lines.append(f"| {mode} | {r['steps']} | {r['samples_per_s_median']:.2f} | "
                     f"{r['samples_per_s_median'] / base['samples_per_s_median']:.2f}x | "
                     f"{r['samples_per_cpu_s_median']:.2f} | "
                     f"{r['samples_per_cpu_s_median'] / base['samples_per_cpu_s_median']:.2f}x | "
                     f"{100 * (r['token_pad_ratio'] or 0):.0f}% | "
                     f"{'; '.join(f'{a:.1f}, {b:.1f}' for a, b in r['load'])} |")
    md = "\n".join(lines) + "\n"
    write_result("online_hf", res, md, out=Path(args.out))
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
