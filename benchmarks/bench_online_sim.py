"""Online mode (OrchMLLM-style post-balancing) predicted for a cluster, with the control baseline.

The simulator (:func:`omnibal.sim.online.compare_online_offline`) runs, on the same random draws of the
synthetic InternVL-like mixture: the baseline (padded rows), the control (the draws packed without padding
where they were drawn: no re-deal), online (re-dealt per phase, placed to move the fewest bytes, plus its
collectives), online with the owner-blind placement, and omnibal's offline packs; even partition and full
recompute for all. control vs baseline is the padding; online vs control is the balance.

A second table measures the dispatch itself (no simulation): per global batch of the same mixture, the share
of samples and the bytes (bf16 pixels and features, int64 ids and labels) the owner-aware and the
owner-blind placements move, and their per-phase max/mean (equal by construction).

    python -m benchmarks.bench_online_sim            # the 128-GPU default (DP32 x PP4), 20,000 samples

Writes benchmarks/results/online_sim.{json,md}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, write_result
from omnibal.cost.presets import get_model_preset
from omnibal.data.online import balance_phases
from omnibal.data.online_owners import TransferBytes, moved_bytes
from omnibal.sim.online import compare_online_offline, comparison_markdown
from omnibal.stats.synthetic import synthetic_internvl_mixture


def dispatch_moves(model: str, dp_sizes, per_rank: int, batches: int, seed: int) -> list[dict]:
    """Owner-aware vs owner-blind placement of the same balanced work, mean over random global batches."""
    spec = get_model_preset(model)
    raw = synthetic_internvl_mixture(max(dp_sizes) * per_rank * batches, seed=seed)
    tokens = spec.sample_tokens(raw.tiles, raw.tokens, images=raw.images)
    transfer = TransferBytes.of(image_size=spec.vision.image_size, tokens_per_tile=spec.llm_tokens_per_tile,
                                hidden=spec.llm.hidden, element_bytes=2)
    rng = np.random.default_rng(seed)
    rows = []
    for dp in dp_sizes:
        owner = np.repeat(np.arange(dp), per_rank)
        acc = {k: [] for k in ("blind", "aware")}
        for _ in range(batches):
            pick = rng.choice(len(tokens), dp * per_rank, replace=False)
            t, k = raw.tiles[pick], tokens[pick]
            for name, own in (("blind", None), ("aware", owner)):
                a = balance_phases(t, k, dp_size=dp, owner=own, transfer=transfer)
                m = moved_bytes(owner, a.vision_tiles, a.llm_owner, t, k, transfer)
                acc[name].append((m["samples"] / len(t), m["total"] / 1e9, a.vision_max_mean, a.llm_max_mean))
        row = {"dp": dp, "samples_per_step": dp * per_rank}
        for name, vals in acc.items():
            mean = np.mean(np.array(vals), axis=0)
            row[name] = {"moved_sample_share": float(mean[0]), "moved_gb": float(mean[1]),
                         "vision_max_mean": float(mean[2]), "llm_max_mean": float(mean[3])}
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="internvl-chat-1.5")
    ap.add_argument("--hardware", default="a100-80g")
    ap.add_argument("--dp", type=int, default=32)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    pred = compare_online_offline(model=args.model, hardware=args.hardware, dp_size=args.dp, pp_size=args.pp,
                                  num_microbatches=args.microbatches, batch_size=args.batch_size,
                                  num_samples=args.samples, seed=args.seed)
    moves = dispatch_moves(args.model, (2, 8, args.dp), args.microbatches * args.batch_size, 10, args.seed)
    res = {"predicted": pred, "dispatch_moves": moves}
    text = render(res)
    write_result("online_sim", res, text, out=Path(args.out))
    print(text)
    return 0


def render(res: dict) -> str:
    lines = ["# Online mode predicted, with the control baseline (`python -m benchmarks.bench_online_sim`)", "",
             comparison_markdown(res["predicted"]).rstrip("\n"), "",
             "control = the baseline's draws packed without padding where they were drawn (no re-deal, no "
             "collectives): control vs baseline is the padding, online vs control the balance.", "",
             "Dispatch placement, per global batch of the same mixture (mean of 10 batches; bf16 pixels and "
             "features, int64 ids and labels):", "",
             "| DP | samples per step | placement | samples moved | GB moved | vision max/mean | LLM max/mean |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in res["dispatch_moves"]:
        for name in ("blind", "aware"):
            r = row[name]
            lines.append(f"| {row['dp']} | {row['samples_per_step']} | owner-{name} | "
                         f"{100 * r['moved_sample_share']:.0f}% | {r['moved_gb']:.2f} | {r['vision_max_mean']:.4f} | "
                         f"{r['llm_max_mean']:.4f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
