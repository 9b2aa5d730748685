"""The cost of sequence parallelism (Ulysses) for one HBP level, from the cost table, the model and the links:
pure functions of those, which :mod:`omnibal.hbp.planning` turns into the level estimate's inputs and prices
with the simulator.

* **Ulysses all-to-all** (:func:`ulysses_a2a_time`): an SP group of ``d`` DP ranks splits a pack along the
  sequence; each LLM block exchanges q, k, v before attention and the attention output after it (four
  all-to-alls forward, four backward), each moving a rank's ``(d-1)/d`` share of its ``tokens/d`` rows
  (``2 hidden + 2 kv_dim`` values per token in all), over NVLink when ``d <= gpus_per_node``. The time enters
  the cost table's ``tp_comm_time`` (:func:`sp_table`).
* **Per-rank work** (:func:`per_rank_features`): a rank runs ``1/d`` of the pack's tiles, tokens and attention.
* **Memory** (:func:`max_tokens_per_rank`) and the **recompute price** (:func:`recompute_ratio`) of a per-rank
  length, from the planner.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from omnibal.cost.table import LayerCostTable
from omnibal.errors import InputError
from omnibal.plan.joint import JointPlanner
from omnibal.plan.stages import StageModelConfig, layer_quantities

LLM_ATTENTION_KINDS = ("llm_block",)
"""Layer kinds whose attention the SP group splits (and so exchange activations by all-to-all)."""


def ulysses_a2a_time(table: LayerCostTable, spec, hardware, degree: int, *, tp_size: int = 1,
                     dtype_bytes: int = 2) -> np.ndarray:
    """``[L, 4]`` all-to-all seconds (forward + backward) per layer of one rank in an SP group of ``degree``."""
    out = np.zeros((table.num_layers, 4))
    if degree <= 1:
        return out
    llm = spec.llm
    kv_dim = llm.num_kv_heads * (llm.hidden // llm.num_heads)
    values = (2 * llm.hidden + 2 * kv_dim) / tp_size  # q, k, v in; attention output back
    bandwidth, latency = hardware.link(inter_node=degree * tp_size > hardware.gpus_per_node)
    per_token = values * dtype_bytes * (degree - 1) / degree / bandwidth
    rows = np.isin(np.asarray(table.kinds), LLM_ATTENTION_KINDS)
    out[rows, 2] = 2.0 * per_token  # forward and backward
    out[rows, 0] = 2.0 * 4 * (degree - 1) * latency
    return out


def sp_table(table: LayerCostTable, a2a: np.ndarray) -> LayerCostTable:
    """The table with the all-to-all time added to its per-layer collectives."""
    base = np.zeros_like(a2a) if table.tp_comm_time is None else table.tp_comm_time
    return replace(table, tp_comm_time=base + a2a)


def per_rank_features(features: np.ndarray, degree: int) -> np.ndarray:
    """Features of one rank's share of micro-batches split over an SP group of ``degree``."""
    out = np.array(features, dtype=np.float64, copy=True)
    out[..., 1:] /= degree
    return out


def max_tokens_per_rank(table: LayerCostTable, stage_config: StageModelConfig, tiles_per_token: float) -> int:
    """Most LLM tokens per rank's micro-batch (with ``tiles_per_token`` tiles each) that some partition fits
    in the budget with every layer checkpointed; 2**30 without a budget."""
    budget = stage_config.memory_budget_bytes
    if budget is None:
        return 1 << 30

    def fits(tokens: int) -> bool:
        feats = np.array([[1.0, tokens * tiles_per_token, tokens, float(tokens) ** 2]])
        planner = JointPlanner(layer_quantities(table, feats, stage_config), stage_config)
        return planner.min_memory_partition().bottleneck <= budget

    if not fits(1):
        raise InputError("not even a one-token micro-batch fits the memory budget", source="--memory-budget",
                         field="memory_budget_gib")
    lo, hi = 1, 1 << 30
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def recompute_ratio(table: LayerCostTable, stage_config: StageModelConfig, tokens: int,
                    tiles_per_token: float) -> float:
    """Extra time share of the least recompute that fits micro-batches of ``tokens`` per rank: the joint
    optimum's bottleneck over the min-max bottleneck without recompute, less one."""
    feats = np.array([[1.0, tokens * tiles_per_token, tokens, float(tokens) ** 2]])
    planner = JointPlanner(layer_quantities(table, feats, stage_config), stage_config)
    return max(planner.plan().bottleneck / planner.plan_fixed_recompute("none").bottleneck - 1.0, 0.0)
