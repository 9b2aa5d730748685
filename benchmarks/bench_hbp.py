"""Predicted GPU days of HBP multi-level packing vs single-level packing vs the baseline.

Cases (all on 128 A100-80G, predicted by omnibal's cost model + step-time simulator, ``omnibal.hbp.planning``):

* ``6b+20b long``: InternViT-6B + InternLM2-20B (the default ``omnibal plan`` job: DP 32 x PP 4, ZeRO-1,
  8 micro-batches per step) on the synthetic long-context mixture (``omnibal.stats.long_context``: 80%
  InternVL-like short, 15% 8-32k documents, 5% 32-128k videos).
* ``7b-llm long``: an LLM-only 7B (the ``llava-1.5-7b`` preset's Vicuna-7B; the rows are the same sequence
  lengths as text: no tiles, so the CLIP encoder does no work) on DP 128 x PP 1, ZeRO-1, 8 micro-batches.
* ``6b+20b short``: the default job on its default data (the synthetic InternVL-like 1.2M mixture).

Rows: ``baseline`` (random micro-batches padded to the longest: 1 sample each on long data, 4 on short;
one SP degree that holds the longest, even partition, full recompute), ``single level, naive packing`` (HBP's
paper's baseline: the longest level packed by the reference ISF, random full-length packs dealt in contiguous
blocks, the attention cost not balanced; the fastest SP degree that fits, the fewest checkpointed layers that
fit), ``levels, naive packing`` (HBP's levels and SP degrees, each level packed the same naive way: the
paper's "+ hierarchical"), ``single level, full recompute``
(omnibal packing at one pack length = the longest level, the least SP degree that fits, full recompute),
``single level`` (the fastest single level: the longest level with the SP degree the simulator chose and
adaptive recompute, or the plain ``omnibal plan`` packing), ``hbp`` (levels, SP degrees and recompute per
level, each level's step holding the longest level's tokens per rank in as many micro-batches as that takes,
``HBPConfig.microbatches = "tokens"``; the fastest of the level sets and the single levels), ``hbp, one
micro-batch count`` (the same search with the job's 8 micro-batches on every level, ``"same"``), ``omnibal
plan`` (the plain plan: the
balancer's own caps, SP 1, adaptive recompute; only where one rank holds the longest sample). Per case
also: the SP degrees the simulator tried per level, the bounds on HBP's gain (``omnibal.hbp.bound``)
and the planning CPU seconds. A uniform random subset of ``--balance-samples`` rows is balanced and
simulated, the epoch scaled to ``--samples`` (as ``omnibal plan`` does). Writes
benchmarks/results/hbp.json and hbp.md.

    PYTHONPATH=src python -m benchmarks.bench_hbp [--samples 1200000] [--balance-samples 60000]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.common import RESULTS, write_result
from omnibal.cli.plan import add_arguments, job_config
from omnibal.hbp.bound import BREAKDOWN_PARTS, time_breakdown
from omnibal.hbp.planning import NAIVE
from omnibal.jobs.hbp import hbp_context, hbp_plan_config, run_hbp_job, sp_trials_lines
from omnibal.jobs.plan_config import PlanJobConfig
from omnibal.jobs.plan_phases import balance_subset
from omnibal.stats.long_context import llm_only, long_context_mixture
from omnibal.stats.synthetic import synthetic_internvl_mixture


def job(*flags: str) -> PlanJobConfig:
    """The plan job ``omnibal plan --hbp FLAGS`` runs (the CLI's own parsing, so its defaults hold here)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return job_config(parser.parse_args(list(flags)))


def cases(samples: int, balance_samples: int):
    long_mix = long_context_mixture(samples, 0)
    common = ("--samples", str(samples), "--balance-samples", str(balance_samples))
    yield "6b+20b long", job(*common, "--batch-size", "1"), long_mix
    yield ("7b-llm long", job(*common, "--batch-size", "1", "--model", "llava-1.5-7b", "--dp", "128", "--pp", "1"),
           llm_only(long_mix))
    yield "6b+20b short", job(*common), synthetic_internvl_mixture(samples, 0)


def run_case(name: str, config: PlanJobConfig, stats) -> dict:
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    hbp = hbp_plan_config(config)
    result = run_hbp_job(config, hbp, stats)
    wall, cpu = time.perf_counter() - t_wall, time.process_time() - t_cpu
    one = hbp_plan_config(config, microbatches="same")
    same = run_hbp_job(config, one, stats, bound=False)
    same_hbp = {**same.row("hbp").to_dict(), "name": "hbp, one micro-batch count"}
    balanced = balance_subset(stats, config)
    ctx = hbp_context(config, num_samples=len(stats), balanced_samples=len(balanced))
    breakdown = {label: time_breakdown(ctx, cfg, res.row(row), sched, balanced) for label, cfg, res, row, sched in (
        ("hbp", hbp, result, "hbp", result.schedule), ("hbp, one micro-batch count", one, same, "hbp", same.schedule),
        ("single level", hbp, result, "single level", result.single.schedule))}
    return {"case": name, "model": config.preset, "layout": f"DP {config.layout.dp_size} x PP {config.layout.pp_size}",
            "microbatches": config.layout.num_microbatches, "data": stats.source, **result.to_dict(),
            "hbp_one_count": same_hbp, "breakdown": breakdown, "sp_trials_lines": sp_trials_lines(result),
            "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def _kilo(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def _total(levels: list[dict]) -> dict:
    """The sum row of a breakdown."""
    return {"length": None, "sp": None, "microbatches": None, "steps": sum(lv["steps"] for lv in levels),
            "time_s": sum(lv["time_s"] for lv in levels),
            **{p: sum(lv[p] for lv in levels) for p in BREAKDOWN_PARTS}}


def markdown(results: list[dict], load: str) -> str:
    lines = ["# HBP: predicted GPU days per epoch (128 A100-80G)", "",
             "Predicted by omnibal's cost model + simulator (`omnibal.hbp.planning`); see docs/hbp.md. " + load, "",
             "| case | packing | levels (pack length x SP) | micro-batches per level | checkpointed layers per level "
             "| GPU days | vs single level | vs naive packing | vs baseline |", "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        rows = {r["name"]: r for r in res["rows"]}
        single, base = rows["single level"]["gpu_days"], rows["baseline"]["gpu_days"]
        naive = rows[NAIVE]["gpu_days"]
        at = [r["name"] for r in res["rows"]].index("hbp") + 1
        for r in [*res["rows"][:at], res["hbp_one_count"], *res["rows"][at:]]:
            levels = ", ".join(f"{lv['length']:,} x {lv['sp']}" for lv in r["levels"])
            mbs = ", ".join(str(lv["microbatches"]) for lv in r["levels"])
            ckpt = ", ".join(str(lv["checkpointed"]) for lv in r["levels"])
            origin = f" ({r['origin']})" if r["origin"] not in ("levels", r["name"]) else ""
            gains = " | ".join(f"{ref / r['gpu_days']:.2f}x" for ref in (single, naive, base))
            lines.append(f"| {res['case']} | {r['name']}{origin} | {levels} | {mbs} | {ckpt} | {r['gpu_days']:.1f} | "
                         f"{gains} |")
    lines += ["", "HBP's own ablation, in its paper's Table 6 steps: naive packing (ISF at the longest level, the "
              "fastest SP degree that fits, the fewest checkpointed layers that fit), + hierarchical (HBP's levels, "
              "each packed naively), + balance (HBP):", "",
              "| case | naive packing | + hierarchical | + balance | gain of hierarchical | gain of balance | total |",
              "|---|---|---|---|---|---|---|"]
    for res in results:
        naive, levels, hbp = (t["gpu_days"] for t in res["ablation"])
        lines.append(f"| {res['case']} | {naive:.1f} | {levels:.1f} | {hbp:.1f} | {naive / levels:.2f}x | "
                     f"{levels / hbp:.2f}x | {naive / hbp:.2f}x |")
    lines += ["", "Bounds on HBP's gain over the single level under this cost model (`omnibal.hbp.bound`): "
              "(a) the "
              "single level with recompute and all-to-all free (least over its own packing and the longest level at "
              "every SP degree, memory ignored), a bound only when every level has the job's micro-batch count; "
              "(c) the work alone (every sample's forward + backward on the min-max partition of the total, no "
              "pipeline idle, gradient sync, recompute or all-to-all), a bound for any counts; (b) Amdahl: the "
              "samples that need the longest level gain nothing, the rest at most (c).",
              "", "| case | single level | free single level (a) | gain bound (a) | work floor (c) | gain bound (c) "
              "| longest-level cost share | gain bound (b) | HBP gain | HBP gain, one count | planning CPU s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        b = res["bound"]
        one = b["single_gpu_days"] / res["hbp_one_count"]["gpu_days"]
        lines.append(f"| {res['case']} | {b['single_gpu_days']:.1f} | {b['free_gpu_days']:.1f} | "
                     f"{b['gain_bound_free']:.2f}x | {b['floor_gpu_days']:.1f} | {b['gain_bound_floor']:.2f}x | "
                     f"{b['long_share']:.1%} (over {b['long_length']:,} tokens) | "
                     f"{b['gain_bound_amdahl']:.2f}x | {b['hbp_gain']:.2f}x | {one:.2f}x | {res['cpu_s']} |")
    lines += ["", "Where the time goes (`omnibal.hbp.bound.time_breakdown`): each level's simulated time per "
              "device, hours of the scaled epoch; work includes the per-micro-batch fixed term, pipeline idle is "
              "fill/drain and stage imbalance.", "",
              "| case | packing | level (length x SP) | micro-batches | steps | " + " | ".join(
                  p.replace("_", " ") for p in BREAKDOWN_PARTS) + " | time (h) |", "|---|---|---|---|---|" +
              "---|" * (len(BREAKDOWN_PARTS) + 1)]
    for res in results:
        for label, levels in res["breakdown"].items():
            for lv in levels + ([_total(levels)] if len(levels) > 1 else []):
                where = "all levels" if lv["length"] is None else f"{lv['length']:,} x {lv['sp']}"
                cells = " | ".join(f"{round(lv[p] / 3600, 2) + 0.0:.2f}" for p in BREAKDOWN_PARTS)  # no -0.00
                lines.append(f"| {res['case']} | {label} | {where} | {lv['microbatches'] or ''} | {lv['steps']} | "
                             f"{cells} | {lv['time_s'] / 3600:.2f} |")
    lines += ["", "HBP levels (pack length, SP degree, steps, samples of the balanced subset, share of busy time "
              "in SP all-to-all), the level sets the simulator compared and the SP degrees it tried per level "
              "(degree: simulated hours of the level, the other levels fixed; * = kept):", ""]
    for res in results:
        hbp = next(r for r in res["rows"] if r["name"] == "hbp")
        desc = "; ".join(f"{lv['length']:,} x SP {lv['sp']}: {lv['steps']} steps of {lv['microbatches']} "
                         f"micro-batches, {lv['samples']:,} samples, "
                         f"a2a {lv['a2a_share']:.1%}" for lv in hbp["levels"])
        tried = "; ".join(f"{'/'.join(f'{_kilo(n)} x {d}' for n, d in zip(t['lengths'], t['sp']))}"
                          f"{'' if t['origin'] == 'levels' else ' (' + t['origin'] + ')'}: {t['gpu_days']:.1f}"
                          for t in res["level_sets_tried"])
        lines.append(f"- {res['case']}: {desc}. Compared (GPU days): {tried}. Planned in {res['cpu_s']} CPU s.")
        lines += [f"  {line}" for line in res["sp_trials_lines"]] + [f"  - note: {n}" for n in res["notes"]]
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
