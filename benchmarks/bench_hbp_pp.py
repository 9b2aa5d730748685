"""Measured throughput of HBP levels inside a pipeline (SP x PP x DP) in the reference trainer, on CPU.

    PYTHONPATH=src python -m benchmarks.bench_hbp_pp [--mixture-samples 96] [--repeats 1]

Four gloo ranks (dp 2 x pp 2, one torch thread each; this host has 2 cores, so the ranks share them), the
``tiny`` preset (4 LLM heads) split evenly into 2 stages, 1F1B, synthetic pixels/tokens shaped like the data
helper's scaled-down long mixture (``cpu_long_context_mixture``: 80% short, 15% documents, 5% videos, sizes
/ 16). Every step of the epoch after the first (warm-up) is counted:

- ``hbp pp2``: :func:`omnibal.hbp.balance.balance_hbp`'s level lengths (SP degrees (1, 2), a 4096-token
  per-rank budget), each level at the least SP degree whose per-rank share fits the budget, 2 micro-batches
  per step (one fixed pipeline buffer serves every level: a per-level count of 32 short micro-batches would
  hold 32 buffers of the longest level's size), the SP 2 levels running Ulysses inside both pipeline stages;
- ``one level pp2``: everything packed at the longest level's length with the SP degree that length needs
  under the same budget (what one packing length forces), 2 micro-batches.

Both keep every activation (no recompute), so the rows compare packing and SP, not recompute. Reported per
configuration: real samples/s (wall), samples per CPU-second (all ranks' process CPU time), samples per
compute-second (forward + backward only), steps, and the largest LLM token share one rank held in a
micro-batch. Writes benchmarks/results/hbp_pp.json and hbp_pp.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from benchmarks.common import write_result

DP, PP, MICRO = 2, 2, 2
BUDGET = 4096


def schedules(stats):
    """(hbp with its levels' own counts, one level) schedules of the mixture for DP 2."""
    from omnibal.hbp.balance import balance_hbp
    from omnibal.hbp.levels import HBPConfig, LevelCostModel

    model = LevelCostModel(sp_degrees=(1, 2), a2a_per_token=(0.0, 0.0), max_tokens_per_rank=BUDGET)
    lengths = balance_hbp(stats, dp_size=DP, num_microbatches=MICRO, seed=0,
                          config=HBPConfig(model=model)).meta["hbp"]["level_lengths"]

    def least(length: int) -> int:
        return next(d for d in model.sp_degrees if -(-int(length) // d) <= BUDGET)

    hbp = balance_hbp(stats, dp_size=DP, num_microbatches=MICRO, seed=0, config=HBPConfig(
        model=model, pack_lengths=tuple(lengths), level_sp=tuple(least(n) for n in lengths)))
    one = balance_hbp(stats, dp_size=DP, num_microbatches=MICRO, seed=0,
                      config=HBPConfig(model=model, pack_lengths=(lengths[-1],), level_sp=(least(lengths[-1]),)))
    return hbp, one


def rank_run(schedule, stats):
    """One rank of a whole-epoch dp 2 x pp 2 run; global rank 0 returns the per-step records."""
    torch.set_num_threads(1)
    from omnibal.cost.presets import get_model_preset
    from omnibal.data.dataset import SyntheticSampleConfig, SyntheticVLMDataset
    from omnibal.train.distributed import destroy_world, init_world
    from omnibal.train.feed import fixed_buffer
    from omnibal.train.loop import Trainer
    from omnibal.train.model import VLM
    from omnibal.train.stage_layout import resolve_layout

    world = init_world(dp_size=DP, pp_size=PP, timeout_s=600)
    spec = get_model_preset("tiny")
    model = VLM(spec, seed=0)
    cfg = SyntheticSampleConfig(image_size=spec.vision.image_size, tokens_per_tile=spec.llm_tokens_per_tile,
                                vocab_size=spec.llm.vocab_size, image_token_id=spec.llm.vocab_size - 1, seed=0)
    layout = resolve_layout([s.name for s, _ in model.chain()], pp_size=PP, mode="offline")
    trainer = Trainer(world=world, model=model, layout=layout, schedule=schedule,
                      dataset=SyntheticVLMDataset(stats, cfg), mode="offline",
                      num_microbatches=schedule.num_microbatches,
                      buffer=fixed_buffer(schedule, stats, mode="offline"))
    trainer.run(0)
    records = [{"samples": r.samples, "step_s": r.step_s, "cpu_s": sum(rk["cpu_s"] for rk in r.ranks),
                "compute_s": sum(rk["compute_s"] for rk in r.ranks), "loss": r.loss}
               for r in trainer.log.records] if world.rank == 0 else None
    destroy_world()
    return {"records": records}


def max_rank_tokens(schedule, step_sp, stats) -> int:
    """The most LLM tokens one rank holds in one micro-batch (its pack / its step's SP degree)."""
    from omnibal.train.feed import step_microbatches

    tokens, counts = stats.tokens, step_microbatches(schedule)
    return max(-(-int(tokens[schedule.microbatch(s, r, k)].sum()) // int(step_sp[s]))
               for s in range(schedule.num_steps) for r in range(schedule.dp_size) for k in range(int(counts[s])))


def measure(name: str, schedule, stats) -> dict:
    from omnibal.train.distributed import spawn_local
    from omnibal.train.sp import step_degrees

    load_before = os.getloadavg()[0]
    results = spawn_local(rank_run, DP * PP, args=(schedule, stats), deadline_s=1200, start_method="fork")
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"{name}: " + "\n".join(errors))
    records = results[0].value["records"]
    use = records[1:] or records
    wall, cpu = sum(r["step_s"] for r in use), sum(r["cpu_s"] for r in use)
    compute, samples = sum(r["compute_s"] for r in use), sum(r["samples"] for r in use)
    row = {"config": name, "steps": len(records), "steps_timed": len(use), "samples_timed": samples,
           "samples_per_s": samples / wall, "samples_per_cpu_s": samples / cpu,
           "samples_per_compute_s": samples / compute, "wall_s": wall, "cpu_s": cpu,
           "level_sp": list(schedule.level_sp),
           "level_microbatches": list(schedule.level_microbatches or [schedule.num_microbatches]),
           "max_rank_tokens": max_rank_tokens(schedule, step_degrees(schedule), stats),
           "final_loss": records[-1]["loss"], "load_before": load_before, "load_after": os.getloadavg()[0]}
    print(f"{name}: {row['samples_per_s']:.3f} samples/s, {row['samples_per_cpu_s']:.3f} samples/cpu-s, "
          f"{row['steps']} steps", file=sys.stderr)
    return row


def render(doc: dict) -> str:
    from omnibal.tables import markdown_table

    rows = doc["rows"]
    base = next(r for r in rows if r["config"] == "one level pp2")
    head = ["config", "SP per level", "micro-batches per level", "steps", "samples/s (range)",
            "samples/CPU-s (range)", "samples/compute-s", "vs one level (CPU-s)", "max tokens/rank"]

    def spread(r, key):
        got = [g[key] for g in doc["repeat_rows"][r["config"]]]
        return f"{r[key]:.3f} ({min(got):.2f}-{max(got):.2f})"

    body = [[r["config"], r["level_sp"], r["level_microbatches"], r["steps"], spread(r, "samples_per_s"),
             spread(r, "samples_per_cpu_s"), f"{r['samples_per_compute_s']:.3f}",
             f"{r['samples_per_cpu_s'] / base['samples_per_cpu_s']:.2f}x", r["max_rank_tokens"]] for r in rows]
    return "\n".join([
        "# HBP inside a pipeline on CPU (dp 2 x pp 2, 4 gloo ranks on 2 cores)", "",
        f"`tiny` preset, {doc['samples']} samples of the scaled-down long mixture, no recompute, 1F1B; medians of "
        f"{doc['repeats']} repeat(s), the first step of each run not timed. The SP 2 steps run Ulysses inside both "
        "pipeline stages. Four ranks share two cores, so wall time includes waiting for a core; the CPU-second "
        "figure is the steadier one. What HBP saves on GPUs (all-to-alls over the interconnect, recompute for "
        "memory) costs next to nothing here: the rows measure that the plan runs, not its GPU gain.", "",
        markdown_table([head] + body), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mixture-samples", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    from omnibal.stats.long_context import cpu_long_context_mixture

    stats = cpu_long_context_mixture(args.mixture_samples, seed=0)
    hbp, one = schedules(stats)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for name, sched in (("hbp pp2", hbp), ("one level pp2", one)):
            runs.setdefault(name, []).append(measure(name, sched, stats))
    rows = []
    for got in runs.values():
        row = dict(got[0])
        for key in ("samples_per_s", "samples_per_cpu_s", "samples_per_compute_s"):
            row[key] = statistics.median(g[key] for g in got)
        rows.append(row)
    doc = {"samples": args.mixture_samples, "repeats": args.repeats, "world": {"dp": DP, "pp": PP}, "rows": rows,
           "repeat_rows": runs}
    write_result("hbp_pp", doc, render(doc))


if __name__ == "__main__":
    main()
