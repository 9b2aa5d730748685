"""Measured throughput of Ulysses sequence parallelism and of HBP levels in the reference trainer, on CPU.

    PYTHONPATH=src python benchmarks/bench_sp.py [--long-samples 32] [--mixture-samples 200] [--repeats 1]
        [--only "hbp (estimate's SP, own counts)" --only "one level sp2" ...]

Two gloo ranks (this host has 2 cores), one torch thread each, the ``tiny`` preset (4 LLM heads), synthetic
pixels/tokens of the given sizes, every step of the epoch after the first (warm-up) counted:

A. **SP vs DP on long packs.** Samples of 2-6k LLM tokens and 1-4 tiles, two per pack (~8k-token packs).
   ``sp1``: two DP ranks, each its own packs; ``sp2``: one SP group of both ranks splitting every pack
   (``--sp-degree 2``). The same packs in the same order, so the same samples and FLOPs.
B. **HBP vs one level** on the data helper's scaled-down long mixture (``cpu_long_context_mixture``:
   80% short, 15% documents, 5% videos, sizes / 16): ``hbp (estimate's SP)`` is
   :func:`omnibal.hbp.balance.balance_hbp` with SP degrees (1, 2) and a 4096-token per-rank budget (it picks the
   levels and their degrees by its estimate, here with no all-to-all price); ``hbp (least SP)`` the same
   level lengths, each with the least SP degree whose per-rank share fits the budget; ``one level
   sp2`` packs everything at the longest level's length with the SP degree that length needs under the same
   budget (what one packing length forces); ``one level sp1`` the same packs without SP (over the memory
   budget; on this host it runs, so it shows what SP itself costs); ``hbp (estimate's SP, own counts)`` the
   estimate's levels and SP degrees with a micro-batch count per level (``HBPConfig(microbatches='tokens')``:
   a short level's step holds about the long level's tokens per rank, so it runs fewer, fuller steps).

``--only CONFIG`` (repeatable) runs just those configurations and merges them into the existing ``sp.json``
(the other rows stay as measured before, and the markdown says which rows came from which run and load).

Reported per configuration: real samples/s (wall), samples per CPU-second (all ranks' process CPU time:
less sensitive to the other jobs on this host), samples per compute-second (forward + backward only, the
per-step optimizer / all-reduce / data costs left out), the per-rank peak RSS, and the largest LLM token share one
rank held in a micro-batch (what activation memory follows). Writes benchmarks/results/sp.json and sp.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import RESULTS, write_result

DP = 2
MICRO = 2


def long_stats(num_samples: int, seed: int = 0):
    from omnibal.stats.table import SampleStats

    rng = np.random.default_rng(seed)
    tiles = rng.integers(1, 5, num_samples)
    tokens = tiles * 16 + rng.integers(2048, 6144, num_samples)  # tiny: 16 LLM tokens per tile
    return SampleStats.from_arrays(tiles=tiles, tokens=tokens, source=f"long packs ({num_samples} samples)")


def pair_schedules(stats):
    """(DP schedule for 2 ranks, the same packs for 1 SP group): packs of two samples, in one order."""
    from omnibal.train.feed import IndexSchedule

    perm = np.random.default_rng(1).permutation(len(stats))
    packs = [perm[i:i + 2] for i in range(0, len(perm) - 1, 2)]
    per_dp = DP * MICRO
    n = len(packs) // per_dp * per_dp
    dp_steps = tuple(tuple(tuple(packs[s + r * MICRO + k] for k in range(MICRO)) for r in range(DP))
                     for s in range(0, n, per_dp))
    sp_steps = tuple(((packs[s], packs[s + 1]),) for s in range(0, n, MICRO))
    return (IndexSchedule(DP, MICRO, dp_steps, None, "long pairs, dp 2"),
            IndexSchedule(1, MICRO, sp_steps, None, "long pairs, 1 SP group"))


def hbp_schedules(stats):
    """(hbp with its estimate's SP degrees, hbp with the least SP degree that fits each level, one level, hbp with
    the estimate's SP degrees and a micro-batch count per level) schedules of the mixture for 2 ranks (the level
    lengths: ``balance_hbp``'s choice)."""
    from omnibal.hbp.balance import balance_hbp
    from omnibal.hbp.levels import HBPConfig, LevelCostModel

    model = LevelCostModel(sp_degrees=(1, 2), a2a_per_token=(0.0, 0.0), max_tokens_per_rank=4096)
    hbp = balance_hbp(stats, dp_size=DP, num_microbatches=MICRO, seed=0, config=HBPConfig(model=model))
    lengths = tuple(int(x) for x in hbp.meta["hbp"]["level_lengths"])

    def least(length: int) -> int:
        return next(d for d in model.sp_degrees if -(-length // d) <= model.max_tokens_per_rank)

    least_sp = balance_hbp(stats, dp_size=DP, num_microbatches=MICRO, seed=0, config=HBPConfig(
        model=model, pack_lengths=lengths, level_sp=tuple(least(n) for n in lengths)))
    one = balance_hbp(stats, dp_size=DP, num_microbatches=MICRO, seed=0,
                      config=HBPConfig(model=model, pack_lengths=lengths[-1:], level_sp=(least(lengths[-1]),)))
    own = balance_hbp(stats, dp_size=DP, num_microbatches=MICRO, seed=0, config=HBPConfig(
        model=model, pack_lengths=lengths, level_sp=hbp.level_sp, microbatches="tokens"))
    return hbp, least_sp, one, own


def rank_run(schedule, stats, sp_degree: int):
    """One rank of a whole-epoch run; rank 0 returns the per-step records, every rank its peak RSS."""
    torch.set_num_threads(1)
    from omnibal.cost.presets import get_model_preset
    from omnibal.data.dataset import SyntheticSampleConfig, SyntheticVLMDataset
    from omnibal.train.distributed import destroy_world, init_world
    from omnibal.train.loop import Trainer
    from omnibal.train.model import VLM
    from omnibal.train.stage_layout import resolve_layout

    world = init_world(dp_size=DP, pp_size=1, timeout_s=600)
    spec = get_model_preset("tiny")
    model = VLM(spec, seed=0)
    cfg = SyntheticSampleConfig(image_size=spec.vision.image_size, tokens_per_tile=spec.llm_tokens_per_tile,
                                vocab_size=spec.llm.vocab_size, image_token_id=spec.llm.vocab_size - 1, seed=0)
    layout = resolve_layout([s.name for s, _ in model.chain()], pp_size=1, mode="offline")
    trainer = Trainer(world=world, model=model, layout=layout, schedule=schedule,
                      dataset=SyntheticVLMDataset(stats, cfg), mode="offline",
                      num_microbatches=schedule.num_microbatches, sp_degree=sp_degree)
    trainer.run(0)
    records = [{"samples": r.samples, "step_s": r.step_s, "cpu_s": sum(rk["cpu_s"] for rk in r.ranks),
                "compute_s": sum(rk["compute_s"] for rk in r.ranks), "loss": r.loss}
               for r in trainer.log.records] if world.rank == 0 else None
    rss = torch.tensor([resource_peak()], dtype=torch.float64)
    gathered = [torch.zeros_like(rss) for _ in range(DP)]
    torch.distributed.all_gather(gathered, rss)
    destroy_world()
    return {"records": records, "peak_rss": [float(g) for g in gathered],
            "max_rank_tokens": max_rank_tokens(trainer.schedule, trainer.step_sp, stats)}


def resource_peak() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def max_rank_tokens(schedule, step_sp, stats) -> int:
    """The most LLM tokens one rank holds in one micro-batch (its pack / its step's SP degree)."""
    from omnibal.train.feed import step_microbatches

    tokens = np.asarray(stats.tokens)
    counts = step_microbatches(schedule)
    return max(-(-int(tokens[schedule.microbatch(s, r, k)].sum()) // int(step_sp[s]))
               for s in range(schedule.num_steps) for r in range(schedule.dp_size) for k in range(int(counts[s])))


def measure(name: str, schedule, stats, sp_degree: int = 1) -> dict:
    from omnibal.train.distributed import spawn_local

    load_before = os.getloadavg()[0]
    results = spawn_local(rank_run, DP, args=(schedule, stats, sp_degree), deadline_s=3000, start_method="fork")
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"{name}: " + "\n".join(errors))
    out = results[0].value
    use = out["records"][1:] or out["records"]
    wall = sum(r["step_s"] for r in use)
    cpu = sum(r["cpu_s"] for r in use)
    compute = sum(r["compute_s"] for r in use)
    samples = sum(r["samples"] for r in use)
    levels = getattr(schedule, "level_sp", None)
    row = {"config": name, "steps": len(out["records"]), "steps_timed": len(use), "samples_timed": samples,
           "samples_per_s": samples / wall, "samples_per_cpu_s": samples / cpu, "wall_s": wall, "cpu_s": cpu,
           "samples_per_compute_s": samples / compute, "compute_share_of_cpu": compute / cpu,
           "peak_rss_mib": [round(x / 2**20) for x in out["peak_rss"]], "max_rank_tokens": out["max_rank_tokens"],
           "level_sp": list(levels) if levels else [sp_degree], "final_loss": out["records"][-1]["loss"],
           "level_microbatches": list(getattr(schedule, "level_microbatches", None) or [schedule.num_microbatches]),
           "load_before": load_before, "load_after": os.getloadavg()[0]}
    print(f"{name}: {row['samples_per_s']:.3f} samples/s, {row['samples_per_cpu_s']:.3f} samples/cpu-s, "
          f"rss {row['peak_rss_mib']} MiB, max rank tokens {row['max_rank_tokens']}", file=sys.stderr)
    return row


def median_rows(rows: list[dict]) -> dict:
    """Median of the repeats' rates (the other fields of the median-throughput repeat)."""
    rows = sorted(rows, key=lambda r: r["samples_per_s"])
    mid = dict(rows[len(rows) // 2])
    for key in ("samples_per_s", "samples_per_cpu_s", "samples_per_compute_s"):
        mid[key] = statistics.median(r[key] for r in rows)
    mid["repeats_samples_per_s"] = [round(r["samples_per_s"], 4) for r in rows]
    return mid


def table(rows: list[dict], base: str) -> list[str]:
    ref = next(r for r in rows if r["config"] == base)
    lines = ["| config | SP degree(s) | steps | samples/s | vs " + base + " | samples / CPU-s | vs " + base +
             " | samples / compute-s | vs " + base + " | peak RSS per rank (MiB) | max LLM tokens per rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r.get("earlier_base", ref)  # a row kept from an earlier run: against that run's base row
        lines.append(f"| {r['config']}{' *' if r.get('earlier_run') else ''} | {r['level_sp']} | {r['steps']} | "
                     f"{r['samples_per_s']:.3f} | "
                     f"{r['samples_per_s'] / b['samples_per_s']:.2f}x | {r['samples_per_cpu_s']:.3f} | "
                     f"{r['samples_per_cpu_s'] / b['samples_per_cpu_s']:.2f}x | {r['samples_per_compute_s']:.3f} | "
                     f"{r['samples_per_compute_s'] / b['samples_per_compute_s']:.2f}x | {r['peak_rss_mib']} | "
                     f"{r['max_rank_tokens']} |")
    return lines


LONG = ("sp1", "sp2")
BASE = {"long_packs": "sp1", "hbp_mixture": "one level sp2"}
"""The row each part's ratios are taken against."""
MIXTURE = ("hbp (estimate's SP)", "hbp (estimate's SP, own counts)", "hbp (least SP)", "one level sp2", "one level sp1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-samples", type=int, default=32)
    parser.add_argument("--mixture-samples", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--only", action="append", choices=LONG + MIXTURE, metavar="CONFIG",
                        help="run only this configuration (repeat for several; one of: " + "; ".join(LONG + MIXTURE)
                             + ") and merge it into the existing results")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    from omnibal.stats.long_context import cpu_long_context_mixture

    load_before = os.getloadavg()
    t0 = time.time()
    stats = long_stats(args.long_samples)
    dp_sched, sp_sched = pair_schedules(stats)
    mix = cpu_long_context_mixture(args.mixture_samples, seed=0)
    hbp, least_sp, one, own = hbp_schedules(mix)
    runs = {"sp1": (dp_sched, stats, 1), "sp2": (sp_sched, stats, 2), "hbp (estimate's SP)": (hbp, mix, 1),
            "hbp (estimate's SP, own counts)": (own, mix, 1), "hbp (least SP)": (least_sp, mix, 1),
            "one level sp2": (one, mix, 1), "one level sp1": (_without_sp(one), mix, 1)}
    chosen = [name for name in LONG + MIXTURE if args.only is None or name in args.only]
    measured: dict[str, list] = {name: [] for name in chosen}
    for _ in range(args.repeats):  # configurations alternate, so machine drift hits all alike
        for name in chosen:
            schedule, data, sp_degree = runs[name]
            measured[name].append(measure(name, schedule, data, sp_degree=sp_degree))
    rows = {name: median_rows(v) for name, v in measured.items()}
    host = {"cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
            "torch_threads_per_rank": 1, "ranks": DP, "microbatches": MICRO, "model": "tiny",
            "repeats": args.repeats, "elapsed_s": time.time() - t0}
    doc = {"host": host,
           "long_packs": {"samples": args.long_samples, "tokens_per_sample": [int(stats.tokens.min()),
                                                                             int(stats.tokens.max())]},
           "hbp_mixture": {"samples": args.mixture_samples, "level_lengths": hbp.meta["hbp"]["level_lengths"],
                           "level_sp": list(hbp.level_sp), "least_level_sp": list(least_sp.level_sp),
                           "level_steps": hbp.meta["hbp"]["level_steps"],
                           "own_counts": {"level_microbatches": list(own.level_microbatches or ()),
                                          "level_steps": own.meta["hbp"]["level_steps"]}}}
    earlier = _earlier(Path(args.out) / "sp.json") if args.only is not None else None
    for part, names in (("long_packs", LONG), ("hbp_mixture", MIXTURE)):
        doc[part]["rows"] = [rows[n] if n in rows else _kept(earlier, part, n) for n in names
                             if n in rows or _kept(earlier, part, n) is not None]
    if earlier is not None:
        doc["host"]["only"] = sorted(rows)
        doc["earlier_run"] = {"host": earlier["host"], "provenance": earlier.get("provenance", {})}
    write_result("sp", doc, render(doc), out=Path(args.out))
    print(render(doc))


def _earlier(path: Path) -> dict:
    """The results an ``--only`` run merges into (the other rows keep their measurement)."""
    if not path.is_file():
        raise SystemExit(f"--only merges into {path}, which does not exist: run the whole benchmark first")
    return json.loads(path.read_text())


def _kept(earlier: dict | None, part: str, name: str) -> dict | None:
    """Row ``name`` of an earlier run, marked as such (None when there is none)."""
    if earlier is None:
        return None
    rows = earlier.get(part, {}).get("rows", ())
    row = next((r for r in rows if r["config"] == name), None)
    if row is None:
        return None
    base = next((r for r in rows if r["config"] == BASE[part]), row)
    rates = ("samples_per_s", "samples_per_cpu_s", "samples_per_compute_s")
    return {**row, "earlier_run": True, "earlier_base": {k: base[k] for k in rates}}


def _without_sp(schedule):
    """The same packs with every level's SP degree 1 (each rank of a former group runs its own copy would
    double the data, so the groups' packs are dealt to distinct ranks instead)."""
    from dataclasses import replace

    d = schedule.level_sp[0]
    ids = schedule.pack_ids[:, ::d]  # one rank per group: [steps, groups, M]
    flat = ids.reshape(-1, MICRO)
    n = len(flat) // DP * DP
    steps = flat[:n].reshape(-1, DP, MICRO)
    return replace(schedule, pack_ids=steps, levels=(0,) * len(steps), level_sp=(1,))


def _repeat_spread(doc: dict) -> str:
    """How far the repeats of one configuration were apart, as measured in this run."""
    rows = [r for part in ("long_packs", "hbp_mixture") for r in doc[part]["rows"]
            if len(r.get("repeats_samples_per_s", ())) > 1]
    if not rows:
        return "One repeat per configuration: no spread between repeats was measured."
    worst = max(rows, key=lambda r: max(r["repeats_samples_per_s"]) / min(r["repeats_samples_per_s"]))
    rates = worst["repeats_samples_per_s"]
    return (f"Repeats of one configuration differed by up to {max(rates) / min(rates):.2f}x in samples/s "
            f"({worst['config']}: {min(rates)} vs {max(rates)}).")


def render(doc: dict) -> str:
    h = doc["host"]
    lines = ["# Sequence parallelism and HBP levels in the reference trainer (CPU)", "",
             f"`benchmarks/bench_sp.py`: {h['ranks']} gloo ranks, {h['torch_threads_per_rank']} torch thread each, "
             f"`{h['model']}` preset, {h['microbatches']} micro-batches per rank, median of {h['repeats']} "
             f"repeat(s), first step of each run excluded. Host: {h['cpus']} CPUs shared with other jobs, load "
             f"{h['load_before'][0]:.1f} before / {h['load_after'][0]:.1f} after: compare samples per CPU-second "
             "(all ranks' process CPU time) beside wall-clock samples/s; samples / compute-s counts only the "
             "ranks' forward + backward seconds (no optimizer, gradient all-reduce, data or metrics: the per-step "
             "costs that a schedule of more, smaller steps pays more often) -- wall seconds, so as load-sensitive "
             f"as samples/s. {_repeat_spread(doc)}", "",
             f"## A. Long packs: SP 2 vs DP 2 ({doc['long_packs']['samples']} samples of "
             f"{doc['long_packs']['tokens_per_sample'][0]}-{doc['long_packs']['tokens_per_sample'][1]} tokens, "
             "2 per pack)", "", *table(doc["long_packs"]["rows"], BASE["long_packs"]), "",
             f"## B. HBP vs one level ({doc['hbp_mixture']['samples']} samples of `cpu_long_context_mixture`)", "",
             f"HBP levels: lengths {doc['hbp_mixture']['level_lengths']}, SP degrees {doc['hbp_mixture']['level_sp']}, "
             f"steps {doc['hbp_mixture']['level_steps']} (per-rank budget 4096 tokens; the estimate's SP degrees, "
             f"least-SP variant: {doc['hbp_mixture']['least_level_sp']}; own counts: "
             f"{doc['hbp_mixture']['own_counts']['level_microbatches']} micro-batches per rank per step, steps "
             f"{doc['hbp_mixture']['own_counts']['level_steps']}).", "",
             *table(doc["hbp_mixture"]["rows"], BASE["hbp_mixture"]), *_earlier_note(doc)]
    return "\n".join(lines)


def _earlier_note(doc: dict) -> list[str]:
    """Which rows an ``--only`` run measured, and when and at what load the kept (*) rows were measured."""
    if "earlier_run" not in doc:
        return []
    old, prov = doc["earlier_run"]["host"], doc["earlier_run"]["provenance"]
    fresh = [r for part in ("long_packs", "hbp_mixture") for r in doc[part]["rows"] if not r.get("earlier_run")]
    loads = ", ".join(f"{r['config']} {r['load_before']:.1f} -> {r['load_after']:.1f}" for r in fresh)
    return ["", f"Rows marked * are kept from an earlier run (git {str(prov.get('git_commit', '?'))[:10]}, "
            f"{prov.get('date', '?')}, {old['repeats']} repeat(s), load {old['load_before'][0]:.1f} before / "
            f"{old['load_after'][0]:.1f} after), their ratios against that run's {' / '.join(BASE.values())} row; "
            f"this run (`--only`, {doc['host']['repeats']} repeat(s)) measured the others, load per configuration "
            f"before -> after: {loads}."]


if __name__ == "__main__":
    main()
