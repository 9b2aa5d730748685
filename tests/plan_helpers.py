"""Cost tables built by hand for the planner's tests (no dependency on the cost model's presets)."""

from __future__ import annotations

import numpy as np

from omnibal.cost.table import LayerCostTable


def kind_table(kinds: list[str], coef: dict[str, dict[str, np.ndarray | float]]) -> LayerCostTable:
    """A table whose layers of one kind share coefficients. ``coef[kind]`` holds ``fwd``, ``bwd``, ``act``,
    ``ckpt``, ``out`` (``[4]`` rows) and ``param``, ``grad``, ``optim`` (scalars)."""
    rows = lambda key: np.array([np.asarray(coef[k][key], dtype=float) for k in kinds])  # noqa: E731
    sel = all("sel_act" in coef[k] for k in kinds)
    return LayerCostTable(
        names=tuple(f"{k}.{i}" for i, k in enumerate(kinds)), kinds=tuple(kinds),
        fwd_time=rows("fwd"), bwd_time=rows("bwd"), act_bytes=rows("act"), ckpt_bytes=rows("ckpt"),
        out_bytes=rows("out"), param_bytes=rows("param"), grad_bytes=rows("grad"), optim_bytes=rows("optim"),
        sel_act_bytes=rows("sel_act") if sel else None, sel_fwd_time=rows("sel_fwd") if sel else None,
    )


def random_kind_coef(rng: np.random.Generator, kinds: list[str], *, selective: bool = False) -> dict[str, dict]:
    """Random coefficients per kind; with ``selective`` also what selective recompute keeps (between the
    checkpointed and the full activations) and the time it adds (a fraction of the forward)."""
    out = {}
    for k in sorted(set(kinds)):
        fwd = rng.uniform(0, 1, 4) * np.array([1e-3, 1e-3, 1e-4, 1e-8])
        act = rng.uniform(0, 1, 4) * np.array([1e6, 1e7, 1e6, 1e2])
        ckpt = act * rng.uniform(0.0, 0.5)
        out[k] = dict(fwd=fwd, bwd=2 * fwd * rng.uniform(0.5, 1.5), act=act, ckpt=ckpt,
                      out=rng.uniform(0, 1, 4) * np.array([0, 1e6, 1e5, 0]), param=float(rng.uniform(1e7, 1e9)),
                      grad=float(rng.uniform(0, 1e9)), optim=float(rng.uniform(0, 6e9)))
        if selective:
            out[k].update(sel_act=ckpt + (act - ckpt) * rng.uniform(0.2, 1.0), sel_fwd=fwd * rng.uniform(0.0, 0.6))
    return out


def random_layer_table(rng: np.random.Generator, num_layers: int, num_kinds: int = 3) -> LayerCostTable:
    kinds = [f"k{int(x)}" for x in rng.integers(0, num_kinds, num_layers)]
    return kind_table(kinds, random_kind_coef(rng, kinds))


def vlm_like_table(num_vision: int = 6, num_llm: int = 8, vision_scale: float = 1.0) -> LayerCostTable:
    """A small VLM-shaped chain: embed, ViT blocks, projector, LLM embed, LLM blocks, head."""
    kinds = (["vision_embed"] + ["vision_block"] * num_vision + ["projector", "llm_embed"]
             + ["llm_block"] * num_llm + ["lm_head"])
    z = np.zeros(4)
    coef = {
        "vision_embed": dict(fwd=np.array([1e-4, 2e-4, 0, 0]), bwd=np.array([1e-4, 2e-4, 0, 0]),
                             act=np.array([0, 6e6, 0, 0]), ckpt=np.array([0, 6e6, 0, 0]),
                             out=np.array([0, 6e6, 0, 0]), param=1e7, grad=1e7, optim=6e7),
        "vision_block": dict(fwd=np.array([1e-4, 4e-3 * vision_scale, 0, 0]),
                             bwd=np.array([2e-4, 8e-3 * vision_scale, 0, 0]),
                             act=np.array([0, 8e7, 0, 0]), ckpt=np.array([0, 6e6, 0, 0]),
                             out=np.array([0, 6e6, 0, 0]), param=4e8, grad=4e8, optim=2.4e9),
        "projector": dict(fwd=np.array([1e-4, 1e-3, 0, 0]), bwd=np.array([1e-4, 2e-3, 0, 0]),
                          act=np.array([0, 1e7, 0, 0]), ckpt=np.array([0, 6e6, 0, 0]),
                          out=np.array([0, 3e6, 0, 0]), param=1e8, grad=1e8, optim=6e8),
        "llm_embed": dict(fwd=np.array([1e-4, 0, 1e-7, 0]), bwd=np.array([1e-4, 0, 1e-7, 0]),
                          act=np.array([0, 0, 1.2e4, 0]), ckpt=np.array([0, 0, 1.2e4, 0]),
                          out=np.array([0, 0, 1.2e4, 0]), param=1e9, grad=1e9, optim=6e9),
        "llm_block": dict(fwd=np.array([1e-4, 0, 3e-6, 1e-10]), bwd=np.array([2e-4, 0, 6e-6, 2e-10]),
                          act=np.array([0, 0, 2e5, 0]), ckpt=np.array([0, 0, 1.2e4, 0]),
                          out=np.array([0, 0, 1.2e4, 0]), param=1e9, grad=1e9, optim=6e9),
        "lm_head": dict(fwd=np.array([1e-4, 0, 2e-6, 0]), bwd=np.array([1e-4, 0, 4e-6, 0]),
                        act=np.array([0, 0, 4e5, 0]), ckpt=np.array([0, 0, 1.2e4, 0]), out=z,
                        param=1e9, grad=1e9, optim=6e9),
    }
    return kind_table(kinds, coef)


def uniform_features(tiles: float = 10.0, tokens: float = 4000.0, num: int = 16) -> np.ndarray:
    """``num`` micro-batches with the given sizes (tokens_sq as one sequence per micro-batch)."""
    return np.tile([1.0, tiles, tokens, tokens**2], (num, 1))
