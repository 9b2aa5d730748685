"""Predicted GPU days of HBP multi-level packing vs single-level packing vs the baseline.

    PYTHONPATH=src python benchmarks/bench_hbp.py [--samples 1200000] [--balance-samples 60000]

Cases (all on 128 A100-80G, predicted by omnibal's cost model + step-time simulator, ``omnibal.plan.hbp``):

* ``6b+20b long``: InternViT-6B + InternLM2-20B (the default ``omnibal plan`` job: DP 32 x PP 4, ZeRO-1,
  8 micro-batches per step) on the synthetic long-context mixture (``omnibal.stats.long_context``: 80%
  InternVL-like short, 15% 8-32k documents, 5% 32-128k videos).
* ``7b-llm long``: an LLM-only 7B (the ``llava-1.5-7b`` preset's Vicuna-7B; the rows are the same sequence
  lengths as text: no tiles, so the CLIP encoder does no work) on DP 128 x PP 1, ZeRO-1, 8 micro-batches.
* ``6b+20b short``: the default job on its default data (the synthetic InternVL-like 1.2M mixture); here also
  the ``omnibal plan`` prediction (single level, no SP, its own caps, partition search) for reference.

Rows: ``baseline`` (random micro-batches padded to the longest: 1 sample each on long data, 4 on short;
one SP degree that holds the longest, even partition, full recompute), ``single level, full recompute``
(omnibal packing at one pack length = the longest level, the least SP degree that fits, full recompute),
``single level`` (the same length with the SP degree and adaptive recompute of least predicted time: the
strongest single level), ``hbp`` (levels, SP degrees and recompute per level). A uniform random subset
of ``--balance-samples`` rows is balanced and simulated, the epoch scaled to ``--samples`` (as ``omnibal
plan`` does). Writes benchmarks/results/hbp.json and hbp.md.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.common import RESULTS, write_result
from omnibal.plan.hbp import HBPPlanConfig
from omnibal.plan.hbp_job import run_hbp_job
from omnibal.plan.job import PlanJobConfig, run_plan_job
from omnibal.stats.long_context import llm_only, long_context_mixture
from omnibal.stats.synthetic import synthetic_internvl_mixture


def cases(samples: int, balance_samples: int):
    long_mix = long_context_mixture(samples, 0)
    job = dict(balance_samples=balance_samples, num_samples=samples)
    yield ("6b+20b long", PlanJobConfig(**job), long_mix, 1)
    yield ("7b-llm long", PlanJobConfig(preset="llava-1.5-7b", dp_size=128, pp_size=1, **job), llm_only(long_mix), 1)
    yield ("6b+20b short", PlanJobConfig(**job), synthetic_internvl_mixture(samples, 0), 4)


def run_case(name: str, config: PlanJobConfig, stats, batch: int) -> dict:
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    result = run_hbp_job(config, HBPPlanConfig(baseline_batch_size=batch), stats)
    out = {"case": name, "model": config.preset, "layout": f"DP {config.dp_size} x PP {config.pp_size}",
           "data": stats.source, **result.to_dict(),
           "wall_s": round(time.perf_counter() - t_wall, 2), "cpu_s": round(time.process_time() - t_cpu, 2)}
    if name.endswith("short"):  # the plain omnibal plan on the same job and data, for reference
        job = run_plan_job(config, stats=stats)
        out["omnibal_plan_gpu_days"] = job.ablation[-1].gpu_days
    return out


def markdown(results: list[dict], load: str) -> str:
    lines = ["# HBP: predicted GPU days per epoch (128 A100-80G)", "",
             "Predicted by omnibal's cost model + simulator (`omnibal.plan.hbp`); see docs/hbp.md. " + load, "",
             "| case | packing | levels (pack length x SP) | checkpointed layers per level | GPU days "
             "| vs single level | vs baseline |", "|---|---|---|---|---|---|---|"]
    for res in results:
        rows = {r["name"]: r for r in res["rows"]}
        single, base = rows["single level"]["gpu_days"], rows["baseline"]["gpu_days"]
        for r in res["rows"]:
            levels = ", ".join(f"{lv['length']:,} x {lv['sp']}" for lv in r["levels"])
            ckpt = ", ".join(str(lv["checkpointed"]) for lv in r["levels"])
            lines.append(f"| {res['case']} | {r['name']} | {levels} | {ckpt} | {r['gpu_days']:.1f} | "
                         f"{single / r['gpu_days']:.2f}x | {base / r['gpu_days']:.2f}x |")
        if "omnibal_plan_gpu_days" in res:
            lines.append(f"| {res['case']} | omnibal plan (one level, no SP) | its own caps | adaptive | "
                         f"{res['omnibal_plan_gpu_days']:.1f} | {single / res['omnibal_plan_gpu_days']:.2f}x | "
                         f"{base / res['omnibal_plan_gpu_days']:.2f}x |")
    lines += ["", "HBP levels (pack length, SP degree, steps, samples of the balanced subset, share of busy time "
              "in SP all-to-all):", ""]
    for res in results:
        hbp = next(r for r in res["rows"] if r["name"] == "hbp")
        desc = "; ".join(f"{lv['length']:,} x SP {lv['sp']}: {lv['steps']} steps, {lv['samples']:,} samples, "
                         f"a2a {lv['a2a_share']:.1%}" for lv in hbp["levels"])
        tried = "; ".join(f"{'/'.join(f'{n // 1024}k' for n in t['lengths'])}: {t['gpu_days']:.1f}"
                          for t in res["level_sets_tried"])
        lines.append(f"- {res['case']}: {desc}. Level sets the simulator compared (GPU days): {tried}. "
                     f"Planned in {res['cpu_s']} CPU s.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_200_000)
    parser.add_argument("--balance-samples", type=int, default=60_000)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    load = f"Host load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (planning times only)."
    results = [run_case(*case) for case in cases(args.samples, args.balance_samples)]
    write_result("hbp", {"samples": args.samples, "balance_samples": args.balance_samples, "results": results},
                 markdown(results, load), out=Path(args.out))
    print(markdown(results, load))


if __name__ == "__main__":
    main()
