"""Balance metrics of a `Schedule` on its stats.

Definitions (``S`` steps, ``N`` = dp_size ranks, ``M`` micro-batches per rank; a rank's load in a step is
the sum over its M micro-batches):

* ``pad_ratio_longest`` (the paper's Pad Ratio): per micro-batch padded to its longest sample,
  ``sum_i (t_max - t_i) / (t_max * B)``, averaged over non-empty micro-batches.
* ``buffer_pad_tiles`` / ``buffer_pad_tokens``: the share of the fixed (Q_v, Q_t) buffer left empty over
  all micro-batches, ``1 - sum(tiles) / (num_microbatches_total * Q_v)`` (tokens alike).
* ``dist_ratio_vision`` / ``dist_ratio_text`` (the paper's Dist Ratio): per step
  ``sum_k (T_max - T_k) / (T_max * N) = 1 - mean/max`` over ranks of tiles (tokens), averaged over steps.
* ``{vision,llm,total}_max_mean_ranks``: per step max/mean over ranks of the cost (the slowest rank's
  slowdown), averaged over steps; ``..._p95``/``..._worst`` give the 95th percentile and worst step.
  ``..._max_mean_microbatches``: the same over all N x M micro-batches of a step (what a pipeline sees).
  Steps with empty micro-batches (a baseline's partial last step) are left out of these averages and
  counted in ``steps_with_empty_microbatches``.
* **Which cost.** Every max/mean is of a cost priced on ``cost`` (a ``BalanceCost``; its name is
  ``cost_model`` in the result, by default the analytic training FLOPs of InternViT-6B + InternLM2-20B) and
  the micro-batch features as they run (``Schedule.features``: varlen packs sum ``tokens_sq`` per sample):
  ``vision = vision_coef . (one, tiles, tokens, tokens_sq)``; ``llm = llm_coef . (...)``, which is the sum
  of ``llm_linear`` (the ``one``, ``tiles`` and ``tokens`` terms: weights, embedding, head) and
  ``llm_attention`` (the ``tokens_sq`` term: causal attention over each sample's segment); ``total =
  vision + llm``. ``llm_linear_max_mean_ranks`` and ``llm_attention_max_mean_ranks`` are each part alone,
  so a reader pricing attention differently can see both (any positive mix of the two is at most the
  larger max/mean of its parts).
* ``buffer_pad_compute``: the fixed buffer's compute pad, ``1 - sum(total cost as packed, varlen) /
  sum(total cost padded to (Q_v, Q_t))``, the padding one extra attention segment per micro-batch
  (``Schedule.features(padding="fixed_buffer")``).
* ``useful_fraction``: real (varlen, unpadded) cost of all samples / (sum over steps of N x the slowest
  rank's cost as it runs, padding included): 1.0 means no padding and no waiting.
* ``samples_per_microbatch_*``: mean, std, min, max over micro-batches.
* ``coverage``: rows scheduled exactly once / never (missing) / more than once (repeated), and rows
  dropped on purpose.
"""

from __future__ import annotations

import numpy as np

from omnibal.data.balance.cost import DEFAULT_COST, BalanceCost
from omnibal.tables import markdown_table


def _max_mean(x: np.ndarray, axis, where: np.ndarray | None = None) -> np.ndarray:
    """max/mean along ``axis`` over the entries ``where`` is True (all when None; 1.0 where all are zero)."""
    if where is None:
        mean, mx = x.mean(axis=axis), x.max(axis=axis)
    else:
        mean = np.where(where, x, 0.0).sum(axis=axis) / np.maximum(where.sum(axis=axis), 1)
        mx = np.where(where, x, 0.0).max(axis=axis)
    return np.where(mean > 0, mx / np.where(mean > 0, mean, 1.0), 1.0)


def _summary(prefix: str, per_step: np.ndarray) -> dict:
    if per_step.size == 0:
        return {prefix: 1.0, f"{prefix}_p95": 1.0, f"{prefix}_worst": 1.0}
    return {prefix: float(per_step.mean()), f"{prefix}_p95": float(np.percentile(per_step, 95)),
            f"{prefix}_worst": float(per_step.max())}


def schedule_metrics(schedule, stats, cost: BalanceCost | None = None) -> dict:
    """All metrics of the module docstring as a flat dict of floats/ints."""
    cost = cost or DEFAULT_COST
    feats = schedule.features(stats)  # as it runs (padding included)
    real = schedule.features(stats, padding="varlen")
    vis, llm = cost.evaluate(feats)  # [S, N, M]
    llm_attention = feats[..., 3] * cost.llm_coef[3]
    llm_linear = llm - llm_attention
    total = vis + llm
    rank_tot = total.sum(2)  # [S, N]
    out: dict = {"method": schedule.method, "dp_size": schedule.dp_size,
                 "num_microbatches": schedule.num_microbatches, "num_steps": schedule.num_steps,
                 "caps_tiles": schedule.caps.tiles, "caps_tokens": schedule.caps.tokens,
                 "padding": schedule.padding, "cost_model": cost.name}
    # a step with empty micro-batches (a baseline's partial last step) would dominate the averages with
    # one huge ratio; it is counted apart and left out of the per-step averages. Slots a step does not run
    # (an HBP level with fewer micro-batches than the largest count) are no micro-batches at all.
    runs = np.broadcast_to(schedule.slot_mask()[:, None, :], schedule.pack_ids.shape)  # [S, N, M]
    sizes_mb = schedule.pack_sizes()[schedule.pack_ids]
    full = ((sizes_mb > 0) | ~runs).all(axis=(1, 2))
    out["steps_with_empty_microbatches"] = int((~full).sum())
    width = schedule.dp_size * schedule.num_microbatches
    for name, per_mb in (("vision", vis), ("llm", llm), ("llm_linear", llm_linear),
                         ("llm_attention", llm_attention), ("total", total)):
        out.update(_summary(f"{name}_max_mean_ranks", _max_mean(per_mb.sum(2)[full], 1)))
        flat, mask = per_mb[full].reshape(-1, width), runs[full].reshape(-1, width)
        out.update(_summary(f"{name}_max_mean_microbatches", _max_mean(flat, 1, mask)))
    # dist ratios on raw tiles / tokens per rank (as the reference computes them)
    tiles_rank, tokens_rank = real[..., 1].sum(2), real[..., 2].sum(2)
    for name, x in (("vision", tiles_rank[full]), ("text", tokens_rank[full])):
        mx = x.max(1)
        dr = np.where(mx > 0, 1 - x.mean(1) / np.where(mx > 0, mx, 1), 0.0)
        out[f"dist_ratio_{name}"] = float(dr.mean()) if dr.size else 0.0
    # padding
    sizes = schedule.pack_sizes()
    used = schedule.pack_ids[runs]
    mb_sizes = sizes[used]
    tokens = stats.tokens[schedule.pack_samples].astype(np.float64)
    offsets = schedule.pack_offsets
    nonempty = sizes > 0
    t_max = np.zeros(len(sizes))
    if len(tokens):
        t_max[nonempty] = np.maximum.reduceat(tokens, offsets[:-1][nonempty])
    t_sum = np.zeros(len(sizes))
    if len(tokens):
        t_sum[nonempty] = np.add.reduceat(tokens, offsets[:-1][nonempty])
    pad_longest = np.where(nonempty, 1 - t_sum / np.where(nonempty, t_max * np.maximum(sizes, 1), 1), 0.0)
    ne_used = nonempty[used]
    out["pad_ratio_longest"] = float(pad_longest[used][ne_used].mean()) if ne_used.any() else 0.0
    num_mb = used.size
    out["buffer_pad_tiles"] = float(1 - real[..., 1].sum() / (num_mb * schedule.caps.tiles)) if num_mb else 0.0
    out["buffer_pad_tokens"] = float(1 - real[..., 2].sum() / (num_mb * schedule.caps.tokens)) if num_mb else 0.0
    padded = sum(c.sum() for c in cost.evaluate(schedule.features(stats, padding="fixed_buffer")))
    out["buffer_pad_compute"] = float(1 - sum(c.sum() for c in cost.evaluate(real)) / padded) if padded > 0 else 0.0
    over = (real[..., 1] > schedule.caps.tiles) | (real[..., 2] > schedule.caps.tokens)
    out["microbatches_over_caps"] = int(over.sum())
    # useful compute
    real_v, real_l = cost.evaluate(real)
    slowest = rank_tot.max(1).sum() * schedule.dp_size
    out["useful_fraction"] = float((real_v + real_l).sum() / slowest) if slowest > 0 else 1.0
    out["samples_per_microbatch_mean"] = float(mb_sizes.mean()) if num_mb else 0.0
    out["samples_per_microbatch_std"] = float(mb_sizes.std()) if num_mb else 0.0
    out["samples_per_microbatch_min"] = int(mb_sizes.min()) if num_mb else 0
    out["samples_per_microbatch_max"] = int(mb_sizes.max()) if num_mb else 0
    out["empty_microbatches"] = int((mb_sizes == 0).sum())
    out.update(coverage(schedule))
    return out


def coverage(schedule) -> dict:
    """Rows scheduled exactly once / missing / repeated, and rows dropped on purpose."""
    counts = schedule.sample_counts()
    dropped = np.zeros(schedule.num_samples, bool)
    dropped[schedule.dropped] = True
    return {
        "coverage_exactly_once": int(((counts == 1) & ~dropped).sum()),
        "coverage_missing": int(((counts == 0) & ~dropped).sum()),
        "coverage_repeated": int((counts > 1).sum()),
        "coverage_dropped": int(dropped.sum()),
        "coverage_ok": bool(((counts == 1) | dropped).all() and not (counts[dropped] > 0).any()),
    }


def cost_legend(cost: BalanceCost | None = None) -> str:
    """One line saying what every printed max/mean measures (the cost, its parts, the model it is priced on)."""
    cost = cost or DEFAULT_COST
    return ("max/mean: per step, the most loaded rank's cost over the ranks' mean, averaged over steps; costs "
            f"priced on {cost.name}: vision = encoder + projector; LLM = linear (weights, per token) + attention "
            "(causal, per sample's tokens**2; llm_attention alone beside); total = vision + LLM")


def metrics_table(rows: list[dict], keys: list[str] | None = None) -> str:
    """A markdown table of selected metrics, one row per schedule."""
    keys = keys or ["method", "dp_size", "num_steps", "caps_tiles", "caps_tokens", "samples_per_microbatch_mean",
                    "vision_max_mean_ranks", "llm_max_mean_ranks", "llm_attention_max_mean_ranks",
                    "total_max_mean_ranks", "llm_max_mean_ranks_worst", "buffer_pad_tiles", "buffer_pad_tokens",
                    "buffer_pad_compute", "pad_ratio_longest", "dist_ratio_vision",
                    "dist_ratio_text", "useful_fraction", "coverage_ok"]
    return markdown_table([keys] + [[r.get(k, "") for k in keys] for r in rows]) + "\n"
