"""Measured throughput of `omnibal train` on a Hugging Face InternVL checkpoint and real images + text:
baseline vs offline mode (omnibal's balanced packs), DP2xPP1 and DP1xPP2, on CPU.

    python -m benchmarks.bench_train_hf [--records 400] [--repeats 3]

Data: `omnibal example` (rendered charts and document pages, several sizes, 1-3 question-answer turns; the
InternVL tile rule gives 1-14 tiles per sample). Model: a random-init `InternVLForConditionalGeneration`
(InternViT-style encoder + Qwen2 decoder) built with the example's own builder at a size where the vision
encoder takes about half the compute, as in InternViT-6B + InternLM2-20B, saved as an HF folder and loaded
by `omnibal train --hf-model`. Same model, data and world for both modes, one torch thread per rank:

- baseline: random micro-batches of 4 samples padded to their longest, even layer split, every block
  recomputed (InternVL's defaults);
- offline: the balancer's packs, the min-max partition of this CPU's measured per-layer forward+backward
  times of the chain, no recompute.

Each mode trains its whole epoch (every sample once); the runs go through the real CLI (local gloo ranks),
modes and layouts interleaved in every round so a drift of the machine's speed hits all alike. Reported: the
median over rounds of real (unpadded) samples per second (first step excluded) and the speed-up. Writes
benchmarks/results/train_hf.json and train_hf.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import write_result
from benchmarks.trainer_runs import MICROBATCHES, data_args, prepare, run_train
from omnibal.cli.train import add_arguments, train_config
from omnibal.data.collate import collate
from omnibal.plan.partition import min_max_partition
from omnibal.plan.plan import measured_plan
from omnibal.train import run

LAYOUTS = ((2, 1), (1, 2))
MODES = ("baseline", "offline")


def profile_chain(root: Path, model: Path) -> tuple[list[str], np.ndarray, object, object]:
    """Forward+backward seconds of every chain layer on balanced packs of the example (one thread, each
    layer run alone on the carry the layers before it produced), and the run's stats and schedule."""
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = train_config(parser.parse_args(data_args(root, model) + ["--microbatches", str(MICROBATCHES)]))
    chain = run.build_model(cfg)
    stats, dataset = run.build_data(cfg, chain)
    schedule = run.build_schedule(cfg, stats)
    layers = chain.chain()
    times = np.zeros(len(layers))
    base = chain.collate_config(num_tiles=1, num_tokens=1)
    packs = [schedule.microbatch(s, 0, k) for s in range(min(3, schedule.num_steps)) for k in range(MICROBATCHES)]
    for mb in packs:
        cfg_mb = replace(base, num_tiles=int(stats.tiles[mb].sum()), num_tokens=int(stats.tokens[mb].sum()))
        carry = collate([dataset[int(i)] for i in mb], cfg_mb).carry()
        for li, (_, module) in enumerate(layers):
            inp = tuple(t.detach().requires_grad_(t.is_floating_point() and li > 0) for t in carry)
            best = float("inf")
            for _ in range(2):
                module.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                out = module(*inp)
                out[0].float().sum().backward()
                best = min(best, time.perf_counter() - t0)
            times[li] += best
            with torch.no_grad():
                carry = module(*carry)
    return [spec.name for spec, _ in layers], times / len(packs), chain.spec, stats


def write_plan(path: Path, model_name: str, names: list[str], layer_times: np.ndarray, pp: int,
               num_samples: int) -> list[int]:
    """The min-max cut of the measured layer times, as a real Plan (what `omnibal train --plan` reads)."""
    part = min_max_partition(layer_times, pp)
    parts = [int(x) for x in part.parts]
    measured_plan(model=model_name, layer_names=names, parts=parts, stage_times_s=part.stage_costs,
                  num_samples=num_samples, num_microbatches=MICROBATCHES,
                  source="bench_train_hf: measured per-layer times").save(path)
    return parts


def main(argv=None) -> int:
    args, log, work, model = prepare(argv, name="bench_train_hf", description=__doc__.splitlines()[0])
    names, layer_times, spec, stats = profile_chain(work, model)
    vision_share = float(layer_times[: names.index("llm.embed")].sum() / layer_times.sum())
    plan = work / "plan_pp2.json"
    parts = write_plan(plan, spec.name, names, layer_times, 2, len(stats))
    log(f"{len(stats)} samples, vision share {vision_share:.0%} of the measured time, PP2 cut {parts}")
    runs: dict[str, list] = {}
    for r in range(args.repeats):
        for dp, pp in LAYOUTS:
            for mode in MODES:
                tag = f"{mode}_dp{dp}_pp{pp}"
                extra = ["--mode", mode, "--dp", str(dp), "--pp", str(pp), "--microbatches", str(MICROBATCHES),
                         "--steps", "0"]  # the whole epoch of each mode
                if mode == "offline" and pp > 1:
                    extra += ["--plan", str(plan)]
                doc = run_train(data_args(work, model) + extra, work, f"{tag}_{r}")
                runs.setdefault(tag, []).append(doc)
                log(f"round {r} {tag}: {doc['summary']['samples_per_s']:.2f} samples/s")
    result = {"records": args.records, "repeats": args.repeats, "vision_share": vision_share, "pp2_cut": parts,
              "runs": {}}
    for tag, docs in runs.items():
        sps = [d["summary"]["samples_per_s"] for d in docs]
        med = sorted(docs, key=lambda d: d["summary"]["samples_per_s"])[len(docs) // 2]
        # work, not time: real samples per CPU-second of all ranks (insensitive to other load on the host;
        # blind to pipeline bubbles, which cost wall time but no CPU)
        per_cpu = [d["summary"]["samples_per_s"] * d["summary"]["mean_step_s"]
                   / sum(r["cpu_s"] for r in d["summary"]["per_rank"]) for d in docs]
        result["runs"][tag] = {"samples_per_s_runs": sps, "samples_per_s_median": statistics.median(sps),
                               "samples_per_cpu_s_median": statistics.median(per_cpu),
                               "token_pad_ratio": med["summary"].get("token_pad_ratio"),
                               "steps": med["summary"].get("steps"), "stage_layers": med["stage_layers"],
                               "recompute_layers": sum(len(x) for x in med["recompute"]),
                               "load": [d["load"] for d in docs]}
    for dp, pp in LAYOUTS:
        base = result["runs"][f"baseline_dp{dp}_pp{pp}"]["samples_per_s_median"]
        omni = result["runs"][f"offline_dp{dp}_pp{pp}"]["samples_per_s_median"]
        result[f"speedup_dp{dp}_pp{pp}"] = omni / base
        runs = result["runs"]
        result[f"cpu_work_ratio_dp{dp}_pp{pp}"] = (runs[f"offline_dp{dp}_pp{pp}"]["samples_per_cpu_s_median"]
                                                   / runs[f"baseline_dp{dp}_pp{pp}"]["samples_per_cpu_s_median"])
    write_result("train_hf", result, render_markdown(result), out=Path(args.out))
    print(render_markdown(result))
    return 0


def render_markdown(res: dict) -> str:
    lines = ["# omnibal train on an HF InternVL checkpoint and real images (python -m benchmarks.bench_train_hf)", "",
             f"{res['records']} example records, whole epoch per run, median of {res['repeats']} interleaved rounds, "
             f"one torch thread per rank; vision encoder "
             f"{res['vision_share']:.0%} of the measured layer time; omnibal PP2 cut at layer {res['pp2_cut'][1]}.",
             "",
             "| layout | baseline samples/s | omnibal samples/s | speed-up "
             "| samples per CPU-s, baseline / omnibal (ratio) |",
             "| --- | --- | --- | --- | --- |"]
    for key in [k for k in res if k.startswith("speedup_")]:
        lay = key.removeprefix("speedup_")
        b, o = res["runs"][f"baseline_{lay}"], res["runs"][f"offline_{lay}"]
        lines.append(f"| {lay.upper().replace('_', 'x')} | {b['samples_per_s_median']:.2f} | "
                     f"{o['samples_per_s_median']:.2f} | **{res[key]:.2f}x** | {b['samples_per_cpu_s_median']:.1f} / "
                     f"{o['samples_per_cpu_s_median']:.1f} ({res['cpu_work_ratio_' + lay]:.2f}x) |")
    lines += ["", "| run | samples/s per round | token pad | stages | recompute layers | load (1-min) |",
              "| --- | --- | --- | --- | --- | --- |"]
    for tag, e in res["runs"].items():
        pad = "-" if e["token_pad_ratio"] is None else f"{e['token_pad_ratio']:.1%}"
        lines.append(f"| {tag} | {', '.join(f'{x:.2f}' for x in e['samples_per_s_runs'])} | {pad} | "
                     f"{e['stage_layers']} | {e['recompute_layers']} | "
                     f"{', '.join(f'{a:.1f}-{b:.1f}' for a, b in e['load'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
