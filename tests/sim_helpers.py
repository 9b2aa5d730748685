"""Cost tables built by hand for the simulator's tests (independent of the cost model's presets)."""

from __future__ import annotations

import numpy as np

from omnibal.cost.table import LayerCostTable


def random_table(num_layers: int = 10, seed: int = 0, tp: bool = False) -> LayerCostTable:
    """A small chain with distinct, positive per-layer coefficients: vision-like layers first (cost in
    tiles), LLM-like layers after (cost in tokens and tokens^2)."""
    rng = np.random.default_rng(seed)
    num_vision = num_layers // 3
    kinds = tuple(["vision_block"] * num_vision + ["llm_block"] * (num_layers - num_vision))
    names = tuple(f"layer.{i}" for i in range(num_layers))

    def coef(scale):
        c = np.zeros((num_layers, 4))
        c[:, 0] = rng.uniform(0.5, 1.0, num_layers) * scale * 1e-3
        c[:num_vision, 1] = rng.uniform(0.5, 1.5, num_vision) * scale
        c[num_vision:, 2] = rng.uniform(0.5, 1.5, num_layers - num_vision) * scale * 1e-3
        c[num_vision:, 3] = rng.uniform(0.5, 1.5, num_layers - num_vision) * scale * 1e-7
        return c

    act = coef(1e6)
    return LayerCostTable(
        names=names, kinds=kinds, fwd_time=coef(1e-2), bwd_time=2 * coef(1e-2), act_bytes=act,
        ckpt_bytes=act * 0.1, out_bytes=coef(1e5),
        param_bytes=rng.uniform(1e6, 2e6, num_layers), grad_bytes=rng.uniform(1e6, 2e6, num_layers),
        optim_bytes=rng.uniform(4e6, 8e6, num_layers),
        tp_comm_time=coef(1e-3) if tp else None,
    )


def random_features(num_steps: int, dp: int, num_mb: int, seed: int = 0) -> np.ndarray:
    """``[S, D, M, 4]`` micro-batch features of packs with 1-18 tiles and 500-6000 tokens."""
    rng = np.random.default_rng(seed)
    shape = (num_steps, dp, num_mb)
    tiles = rng.integers(1, 19, shape).astype(float)
    tokens = rng.integers(500, 6000, shape).astype(float)
    return np.stack([np.ones(shape), tiles, tokens, tokens**2 / 3], axis=-1)
