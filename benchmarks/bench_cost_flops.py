"""Analytic FLOPs of every preset against the 6 N D + attention rule, and the analytic forward+backward time of a
typical micro-batch on each GPU preset. Pure arithmetic (no timing); writes benchmarks/results/cost_flops.{json,md}.

The comparison (also a test, tests/test_cost_analytic.py): one sample of 3 tiles and 1000 LLM tokens (one
causal segment); analytic training FLOPs = 3 x analytic forward (GEMMs + attention); the rule = 6 x published
parameters of each part x the tokens that part sees (ViT: tiles x tokens per tile; LLM without its input
embedding table: LLM tokens; projector: tiles x LLM tokens per tile) + PaLM's attention term (ViT 12 L D T per
token, causal LLM half of it).

    python -m benchmarks.bench_cost_flops
"""

from __future__ import annotations

from benchmarks.common import SHARED_STATS, STATS_FILES, write_result
from omnibal.cost.analytic import analytic_cost_table, forward_flops, total_flops_per_sample
from omnibal.cost.hardware import get_hardware
from omnibal.cost.params import llm_embed_params, param_counts
from omnibal.cost.presets import PUBLISHED_PARAMS, get_model_preset, preset_names
from omnibal.cost.table import microbatch_features
from omnibal.stats.io import load_stats
from omnibal.stats.table import SampleStats

PAPER_GPU_DAYS = {"internvl-chat-1.5": "21.3 (Megatron-DeepSpeed) - 25.3 (DeepSpeed)",
                  "internvl-chat-1.5-plus": "30.5 - 35.5"}


def epoch_estimates() -> list[str]:
    """Training FLOPs of a 1.2M-sample epoch whose samples look like the real AI2D + ChartQA statistics, and
    the A100 GPU-days they take at 40% / 50% MFU, beside the OmniBal paper's measured GPU-days."""
    if not SHARED_STATS.is_dir():
        return []
    stats = SampleStats.concat([load_stats(SHARED_STATS / f) for f in STATS_FILES])
    lines = ["", f"Epoch of 1.2M samples shaped like the real AI2D + ChartQA statistics (mean {stats.tiles.mean():.2f} "
             f"tiles, {stats.tokens.mean():.0f} tokens; the rest of the 1.2M mixture may differ), training FLOPs = "
             "3x forward (4x with full recomputation), on A100 (312 TFLOP/s bf16):", "",
             "| preset | epoch PFLOP | GPU-days at 40% MFU | at 50% MFU | with full recompute, 50% | paper (OmniBal) |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for name, paper in PAPER_GPU_DAYS.items():
        spec = get_model_preset(name)
        fwd = forward_flops(spec, stats.tiles, stats.tokens, stats.tokens.astype(float) ** 2).sum()
        fwd *= 1.2e6 / len(stats.tiles)
        days = lambda flops, mfu: flops / (312e12 * mfu) / 86400  # noqa: E731
        lines.append(f"| {name} | {3 * fwd / 1e15:,.0f} | {days(3 * fwd, 0.4):.1f} | {days(3 * fwd, 0.5):.1f} | "
                     f"{days(4 * fwd, 0.5):.1f} | {paper} |")
    return lines


def rule_flops(spec, tiles, tokens, pub) -> float:
    v, llm = spec.vision, spec.llm
    counts = param_counts(spec)
    n_vision = pub.get("vision", counts["vision"])
    n_llm = pub.get("llm", counts["llm"]) - llm_embed_params(llm)
    vit_tokens = tiles * v.tokens_per_tile
    flops = 6 * (n_vision * vit_tokens + counts["projector"] * tiles * spec.llm_tokens_per_tile + n_llm * tokens)
    return (flops + 12 * v.num_layers * v.hidden * v.tokens_per_tile * vit_tokens
            + 6 * llm.num_layers * llm.hidden * tokens**2)


def main() -> int:
    rows = []
    for name in preset_names():
        spec = get_model_preset(name)
        analytic = float(total_flops_per_sample(spec, 3, 1000))
        rule = rule_flops(spec, 3, 1000, PUBLISHED_PARAMS.get(name, {}))
        row = {"preset": name, "params": param_counts(spec)["total"], "train_flops": analytic, "rule_flops": rule,
               "ratio": analytic / rule}
        # A micro-batch of 4 such samples packed: 12 tiles, 4000 tokens, 4 segments of 1000.
        feats = microbatch_features(12, 4000, 4 * 1000**2)
        for hw in ("a100-80g", "h100"):
            table = analytic_cost_table(spec, get_hardware(hw))
            row[f"step_s_{hw}"] = float((table.evaluate("fwd_time", feats) + table.evaluate("bwd_time", feats)).sum())
            vision = [k in ("vision_embed", "vision_block") for k in table.kinds]
            t = table.evaluate("fwd_time", feats) + table.evaluate("bwd_time", feats)
            row[f"vision_share_{hw}"] = float(t[vision].sum() / t.sum())
        rows.append(row)
    lines = ["# Analytic FLOPs vs 6 N D + attention; analytic micro-batch time", "",
             "One sample = 3 tiles + 1000 LLM tokens. Micro-batch = 4 such samples packed (12 tiles, 4000 tokens), "
             "bf16, default efficiencies (matmul 0.6, attention 0.45, memory 0.7), no recomputation, TP 1.", "",
             "| preset | params | train TFLOP / sample | 6ND + attn TFLOP | ratio | fwd+bwd A100 (s) | vision share | "
             "fwd+bwd H100 (s) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['params'] / 1e9:.3f}B | {r['train_flops'] / 1e12:.2f} | "
                     f"{r['rule_flops'] / 1e12:.2f} | {r['ratio']:.3f} | {r['step_s_a100-80g']:.3f} | "
                     f"{r['vision_share_a100-80g']:.0%} | {r['step_s_h100']:.3f} |")
    lines += epoch_estimates()
    write_result("cost_flops", {"rows": rows}, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
