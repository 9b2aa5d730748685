"""Analytic FLOPs of every preset against the 6 N D + attention rule, and the analytic forward+backward time of a
typical micro-batch on each GPU preset. Pure arithmetic (no timing); writes benchmarks/results/cost_flops.{json,md}.

The comparison (also a test, tests/test_cost_analytic.py): one sample of 3 tiles and 1000 LLM tokens (one
causal segment); analytic training FLOPs = 3 x analytic forward (GEMMs + attention); the rule = 6 x published
parameters of each part x the tokens that part sees (ViT: tiles x tokens per tile; LLM without its input
embedding table: LLM tokens; projector: tiles x LLM tokens per tile) + PaLM's attention term (ViT 12 L D T per
token, causal LLM half of it).
"""

from __future__ import annotations

import json
from pathlib import Path

from omnibal.cost.analytic import analytic_cost_table, total_flops_per_sample
from omnibal.cost.hardware import get_hardware
from omnibal.cost.params import llm_embed_params, param_counts
from omnibal.cost.presets import PUBLISHED_PARAMS, get_model_preset, preset_names
from omnibal.cost.table import microbatch_features

OUT = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def rule_flops(spec, tiles, tokens, pub) -> float:
    v, llm = spec.vision, spec.llm
    counts = param_counts(spec)
    n_vision = pub.get("vision", counts["vision"])
    n_llm = pub.get("llm", counts["llm"]) - llm_embed_params(llm)
    vit_tokens = tiles * v.tokens_per_tile
    flops = 6 * (n_vision * vit_tokens + counts["projector"] * tiles * spec.llm_tokens_per_tile + n_llm * tokens)
    return flops + 12 * v.num_layers * v.hidden * v.tokens_per_tile * vit_tokens + 6 * llm.num_layers * llm.hidden * tokens**2


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
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cost_flops.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# Analytic FLOPs vs 6 N D + attention; analytic micro-batch time", "",
             "One sample = 3 tiles + 1000 LLM tokens. Micro-batch = 4 such samples packed (12 tiles, 4000 tokens), "
             "bf16, default efficiencies (matmul 0.6, attention 0.45, memory 0.7), no recomputation, TP 1.", "",
             "| preset | params | train TFLOP / sample | 6ND + attn TFLOP | ratio | fwd+bwd A100 (s) | vision share | "
             "fwd+bwd H100 (s) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['params'] / 1e9:.3f}B | {r['train_flops'] / 1e12:.2f} | "
                     f"{r['rule_flops'] / 1e12:.2f} | {r['ratio']:.3f} | {r['step_s_a100-80g']:.3f} | "
                     f"{r['vision_share_a100-80g']:.0%} | {r['step_s_h100']:.3f} |")
    (OUT / "cost_flops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
