"""Are the paper's ablation rows consistent with its own published balance metrics? (issue 17, row 2)

The paper's ablation (6B+20B, Megatron-DeepSpeed, 128 A100) goes 61.8 -> 51.9 (+ data balance) -> 29.0 ->
21.3 GPU days, and it reports on InternVL-1.2M a baseline pad ratio of 0.31 and a vision dist ratio of
0.34, 0.02 after ISF, and "text 0.14" (the baseline's or ISF's text dist ratio: the summary does not say;
both readings are tabulated). Any step time of the form

    step = (work-proportional part: every stage's compute, its pipeline fill/drain and stage imbalance, the
            wait for the DP rank of most work, p2p) + (a per-step fixed part F: gradient sync, optimizer)

bounds what data balance can gain. Over an epoch the baseline's LLM stages run at least the padded tokens
of the mean rank, ``1 / (1 - pad)`` times the real ones, and the balanced run at most ``k`` times the mean
rank's real tokens (``k`` = the balanced LLM max/mean over ranks); the vision stage at least
``1 / (1 - 0.34)`` times the mean rank's tiles before and ``1 / (1 - 0.02)`` after. So every
work-proportional part shrinks by at least ``r = min(r_llm, r_vision)`` and

    51.9 - F2 <= (61.8 - F1) / r,    F2 = alpha F1    (alpha: balanced steps / baseline steps)

gives a least fixed part ``F2`` of the balanced run. Partition and recompute do not change the data, so row 4
(21.3) pays the same ``F2`` and leaves ``21.3 - F2`` GPU days for its work, which is at least the model's
dense training FLOPs (6 x parameters x tokens, the ViT trained as in InternVL-1.5's fine-tuning, attention
and recompute left out) at the A100's bf16 peak: the implied MFU of row 4 is at least
``FLOPs / peak / (21.3 - F2)``. Assumed: the same micro-batches per step in rows 1 and 2 (so the pipeline's
fill and drain stay the same share of the step), the pad ratio as the share of padded LLM tokens. Tokens per
sample are the fitted default mixture's (``omnibal.stats.synthetic``) and, as a check, the two published subsets'.

    PYTHONPATH=src python -m benchmarks.bench_paper_rows
"""

from __future__ import annotations

import numpy as np

from benchmarks.common import SHARED_STATS, STATS_FILES, write_result
from omnibal.cost.hardware import get_hardware
from omnibal.cost.presets import PUBLISHED_PARAMS, get_model_preset
from omnibal.stats.synthetic import synthetic_internvl_mixture

ROWS = (61.8, 51.9, 29.0, 21.3)
"""The paper's ablation, GPU days: baseline, + data balance, + partition, + recompute."""
PAD, VISION_DR, VISION_DR_ISF, TEXT_DR = 0.31, 0.34, 0.02, 0.14
SAMPLES = 1_200_000
ISF_LLM_MAX_MEAN = 1.12
"""The public ISF's per-step LLM max/mean over 32 ranks, measured here (``../shared/docs/background.md``)."""


def readings() -> list[tuple[str, float]]:
    """(reading of "text 0.14", bound on baseline-LLM-over-balanced-LLM per mean rank's real tokens)."""
    padded = 1.0 / (1.0 - PAD)
    return [("0.14 is the baseline's; ISF's LLM max/mean 1.12 as measured here", padded / (1 - TEXT_DR) /
             ISF_LLM_MAX_MEAN),
            ("0.14 is ISF's (max/mean 1.16); the baseline's LLM at least its mean", padded * (1 - TEXT_DR))]


def flops_gpu_days(tiles: float, tokens: float) -> float:
    """Dense training FLOPs of one epoch of the 6B+20B at the A100's bf16 peak, GPU days."""
    spec, params = get_model_preset("internvl-chat-1.5"), PUBLISHED_PARAMS["internvl-chat-1.5"]
    vision_tokens = tiles * spec.vision.tokens_per_tile
    flops = 6.0 * SAMPLES * (params["vision"] * vision_tokens + params["llm"] * tokens)
    return flops / get_hardware("a100-80g").peak_flops("bf16") / 86400.0


def least_fixed(r: float, alpha: float) -> float:
    """Least F2 with ``51.9 - F2 <= (61.8 - F2 / alpha) / r`` (inf when no F2 satisfies it with F2 <= 51.9)."""
    base, data = ROWS[0], ROWS[1]
    slope = 1.0 - 1.0 / (r * alpha)
    need = data - base / r
    if need <= 0:
        return 0.0
    return need / slope if slope > 0 else float("inf")


def main() -> None:
    mix = synthetic_internvl_mixture(200_000, 0)
    work = {"fitted default mixture": (float(np.mean(mix.tiles)), float(np.mean(mix.tokens)))}
    if all((SHARED_STATS / f).exists() for f in STATS_FILES):
        from omnibal.stats.io import load_stats

        real = [load_stats(SHARED_STATS / f) for f in STATS_FILES]
        work["AI2D + ChartQA (published subsets)"] = tuple(
            float(np.concatenate([getattr(s, k) for s in real]).mean()) for k in ("tiles", "tokens"))
    r_vision = (1 - VISION_DR_ISF) / (1 - VISION_DR)
    out, lines = [], ["# The paper's ablation rows against its published balance metrics", "",
                      "With step time = a work-proportional part + a per-step fixed part F, data balance shrinks the "
                      "first by at least r (the published pad ratio 0.31 -> 0 and vision dist ratio 0.34 -> 0.02; "
                      "the LLM's rank imbalance per reading), so row 2 (51.9) needs a fixed part of at least F2 of "
                      "its 51.9 GPU days, which row 4 (21.3, the same data and steps) pays too; what is left for "
                      "row 4's work must hold the epoch's dense training FLOPs (6 x parameters x tokens, ViT "
                      "trained, attention and recompute left out) at the implied MFU of the A100's bf16 peak. "
                      "Derivation: `benchmarks/bench_paper_rows.py`; Megatron-LM's best whole-step rate on A100 is "
                      "52% (Narayanan et al., SC'21).", "",
                      "| data | tiles / LLM tokens per sample | FLOPs at peak (GPU days) | reading | r | alpha "
                      "| least fixed part F2 | row 4 left for work | implied row-4 MFU |",
                      "|---|---|---|---|---|---|---|---|---|"]
    for name, (tiles, tokens) in work.items():
        floor = flops_gpu_days(tiles, tokens)
        for reading, r_llm in readings():
            r = min(r_llm, r_vision)
            for alpha in (0.9, 1.0, 1.11):
                fixed = least_fixed(r, alpha)
                left = ROWS[3] - fixed
                mfu = floor / left if left > 0 else float("inf")
                out.append({"data": name, "tiles": tiles, "tokens": tokens, "flops_gpu_days": floor,
                            "reading": reading, "r": r, "alpha": alpha, "least_fixed": fixed, "left": left,
                            "mfu": mfu})
                shown = "impossible (> 100%)" if mfu > 1 else f"{mfu:.0%}"
                lines.append(f"| {name} | {tiles:.2f} / {tokens:.0f} | {floor:.2f} | {reading} | {r:.3f} | "
                             f"{alpha} | {fixed:.1f} | {round(left, 1) + 0.0:.1f} | {shown} |")
    lines += ["", "alpha 1.11: ISF at its code's default caps holds 3.6 samples per pack against the baseline's 4 "
              "per micro-batch (more, shorter steps); 0.9: omnibal's 4.5-sample packs (fewer steps)."]
    md = "\n".join(lines) + "\n"
    write_result("paper_rows", {"rows": ROWS, "pad": PAD, "vision_dr": [VISION_DR, VISION_DR_ISF],
                                "text_dr": TEXT_DR, "samples": SAMPLES, "results": out}, md)
    print(md)


if __name__ == "__main__":
    main()
