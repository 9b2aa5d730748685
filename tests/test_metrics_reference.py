"""Issue 35 item 4: every printed max/mean says what it measures, and this recomputes each one from the schedule's
JSON with a plain reference (Python loops over steps, ranks, micro-batches and samples; no numpy, nothing of
``omnibal.data.metrics``), from the cost's definition:

    vision(mb)        = cv0 + cv1 tiles + cv2 tokens + cv3 sum(t**2)
    llm_linear(mb)    = cl0 + cl1 tiles + cl2 tokens
    llm_attention(mb) = cl3 sum over the micro-batch's samples of t**2   (causal attention per sample)
    llm = llm_linear + llm_attention, total = vision + llm

and a rank's step load the sum over its micro-batches; max/mean over ranks per step, averaged over steps.
"""

from __future__ import annotations

import json

import pytest

from balance_helpers import real_stats
from omnibal.data.balance import DEFAULT_COST, BalanceCost, balance
from omnibal.data.metrics import cost_legend, schedule_metrics
from omnibal.stats.synthetic import synthetic_internvl_mixture

SECONDS = BalanceCost(vision_coef=(1e-3, 2.1e-2, 0.0, 0.0), llm_coef=(2e-3, 0.0, 7e-5, 4e-8), name="seconds")


def _reference(doc: dict, tiles: list[int], tokens: list[int], cost: BalanceCost) -> dict:
    cv, cl = cost.vision_coef, cost.llm_coef
    parts = {"vision": [], "llm_linear": [], "llm_attention": []}
    real = padded = 0.0
    q_v, q_t = doc["caps"]["tiles"], doc["caps"]["tokens"]
    for step in doc["steps"]:
        loads = {name: [] for name in parts}
        for rank in step:
            load = dict.fromkeys(parts, 0.0)
            for mb in rank:
                v = sum(tiles[i] for i in mb)
                t = sum(tokens[i] for i in mb)
                sq = sum(tokens[i] ** 2 for i in mb)
                load["vision"] += cv[0] + cv[1] * v + cv[2] * t + cv[3] * sq
                load["llm_linear"] += cl[0] + cl[1] * v + cl[2] * t
                load["llm_attention"] += cl[3] * sq
                real += cv[0] + cl[0] + (cv[1] + cl[1]) * v + (cv[2] + cl[2]) * t + (cv[3] + cl[3]) * sq
                pad = max(q_t - t, 0)
                padded += (cv[0] + cl[0] + (cv[1] + cl[1]) * max(v, q_v) + (cv[2] + cl[2]) * (t + pad)
                           + (cv[3] + cl[3]) * (sq + pad * pad))
            for name in parts:
                loads[name].append(load[name])
        loads["llm"] = [a + b for a, b in zip(loads["llm_linear"], loads["llm_attention"])]
        loads["total"] = [a + b for a, b in zip(loads["vision"], loads["llm"])]
        for name, values in loads.items():
            mean = sum(values) / len(values)
            parts.setdefault(name, []).append(max(values) / mean if mean > 0 else 1.0)
    out = {f"{name}_max_mean_ranks": sum(v) / len(v) for name, v in parts.items()}
    out["buffer_pad_compute"] = 1 - real / padded
    return out


@pytest.mark.parametrize("cost", [DEFAULT_COST, SECONDS], ids=["analytic", "seconds"])
@pytest.mark.parametrize(("which", "dp", "micro"), [("ai2d", 8, 1), ("chartqa", 32, 2), ("synthetic", 16, 4)])
def test_every_max_mean_is_its_cost_recomputed_from_the_schedule(shared_stats_dir, cost, which, dp, micro):
    if which == "synthetic":
        stats = synthetic_internvl_mixture(6000, seed=2)
    else:
        stats = real_stats(str(shared_stats_dir), which)
    sched = balance(stats, dp_size=dp, num_microbatches=micro)
    got = schedule_metrics(sched, stats, cost)
    want = _reference(json.loads(sched.to_json()), stats.tiles.tolist(), stats.tokens.tolist(), cost)
    assert got["cost_model"] == cost.name
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key


def test_the_printed_legend_names_the_cost_and_its_parts():
    legend = cost_legend(DEFAULT_COST)
    assert DEFAULT_COST.name in legend
    for part in ("vision", "linear", "attention", "total"):
        assert part in legend
