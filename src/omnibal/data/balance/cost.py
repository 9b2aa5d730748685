"""Per-sample costs the balancer equalises: vision cost and LLM cost, each linear in the cost features.

The cost contract (:mod:`omnibal.cost.table`) says every per-layer cost of a micro-batch is linear in
``(one, tiles, tokens, tokens_sq)``. With variable-length attention a pack's ``tiles``, ``tokens`` and
``tokens_sq`` are sums over its samples, so a pack's cost is the sum of per-sample costs plus one fixed
per-micro-batch term. The balancer therefore works on two additive per-sample weights:

    vision_i = vision_coef . (0, tiles_i, tokens_i, tokens_i**2)
    llm_i    = llm_coef    . (0, tiles_i, tokens_i, tokens_i**2)

Vision and LLM costs are balanced separately because under pipeline parallelism they run on different
stages (and even without it, the ViT and the LLM are separate kernels with different efficiency).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from omnibal.errors import InputError

VISION_KINDS = ("vision_embed", "vision_block", "projector")
LLM_KINDS = ("llm_embed", "llm_block", "lm_head")


def _internvl_6b_20b_coefficients() -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Analytic training FLOPs (forward + backward) of InternViT-6B + InternLM2-20B, per cost feature.

    Derivation (a matmul of an ``n x k`` input with a ``k x m`` weight is ``2 n k m`` FLOPs forward; the
    backward costs twice the forward, input and weight gradients; so training = 3 x forward):

    Vision, per 448px tile (InternViT-6B: 45 blocks, width 3200, MLP 12800, 1025 tokens per tile):
      * block weights: attention 4 * 3200**2 = 40.96M, MLP 2 * 3200 * 12800 = 81.92M -> 122.88M per block,
        x 45 = 5.53G parameters; forward 2 * 5.53G * 1025 tokens = 11.34 TFLOP per tile;
      * attention inside the tile (bidirectional): QK^T and AV, 2 * 2 * 1025**2 * 3200 per block = 13.45 G,
        x 45 = 0.605 TFLOP per tile;
      * patch embedding 14*14*3 * 3200 * 1024 patches * 2 = 3.9 GFLOP;
      * projector (pixel shuffle 0.5 -> 256 tokens of 12800, MLP 12800->6144->6144):
        (12800*6144 + 6144**2) * 256 * 2 = 59.6 GFLOP.
      Forward ~ 12.01 TFLOP per tile; training 3x -> 3.60e13 FLOP per tile.
    LLM, per token (InternLM2-20B: 48 blocks, width 6144, 48 query / 8 KV heads of 128, MLP 16384,
    vocab 92544):
      * block weights: q and o 2 * 6144**2, k and v 2 * 6144 * 1024, SwiGLU 3 * 6144 * 16384
        -> 390.1M per block, x 48 = 18.72G; LM head 6144 * 92544 = 0.569G; 19.29G in all:
        forward 2 * 19.29G = 38.6 GFLOP per token; training 1.157e11 per token;
      * causal attention of a segment of length t: QK^T and AV over the lower triangle,
        2 * 2 * t**2 / 2 * 6144 per block = 12288 t**2, x 48 = 589,824 t**2; training 1.77e6 * t**2.
    At t = 1300 the quadratic term is ~2% of the LLM cost; at 4096 tokens ~6%.
    The fixed per-micro-batch terms are set to 0 (unknown without a profile; they do not affect balance
    because every rank runs the same number of micro-batches).
    """
    vision_fwd_per_tile = 45 * (4 * 3200**2 + 2 * 3200 * 12800) * 2 * 1025 + 45 * 4 * 1025**2 * 3200
    vision_fwd_per_tile += 14 * 14 * 3 * 3200 * 1024 * 2 + (12800 * 6144 + 6144**2) * 256 * 2
    llm_params = 48 * (2 * 6144**2 + 2 * 6144 * 1024 + 3 * 6144 * 16384) + 6144 * 92544
    llm_fwd_per_token = 2 * llm_params
    llm_fwd_per_token_sq = 48 * 2 * 6144
    vision = (0.0, 3.0 * vision_fwd_per_tile, 0.0, 0.0)
    llm = (0.0, 0.0, 3.0 * llm_fwd_per_token, 3.0 * llm_fwd_per_token_sq)
    return vision, llm


@dataclass(frozen=True, kw_only=True)
class BalanceCost:
    """Coefficients of the vision cost and the LLM cost over the features ``(one, tiles, tokens, tokens_sq)``.

    Units are arbitrary but shared (FLOPs for the analytic default, seconds for a calibrated table):
    only ratios matter to the balancer; the metrics report them as given.
    """

    vision_coef: tuple[float, float, float, float]
    """Vision encoder + projector cost per (micro-batch, tile, token, token**2)."""
    llm_coef: tuple[float, float, float, float]
    """LLM (embedding, blocks, head) cost per (micro-batch, tile, token, token**2 of each attention segment)."""
    name: str = "custom"
    """Where the coefficients come from (recorded in schedules and reports)."""

    def __post_init__(self) -> None:
        for field in ("vision_coef", "llm_coef"):
            coef = tuple(float(c) for c in getattr(self, field))
            if len(coef) != 4 or not all(np.isfinite(coef)) or min(coef) < 0:
                raise InputError(f"must be 4 finite non-negative numbers, got {getattr(self, field)!r}",
                                 source="BalanceCost", field=field)
            object.__setattr__(self, field, coef)
        if sum(self.vision_coef[1:]) + sum(self.llm_coef[1:]) <= 0:
            raise InputError("all per-sample coefficients are zero: nothing to balance",
                             source="BalanceCost", field="llm_coef")

    @classmethod
    def internvl_6b_20b(cls) -> BalanceCost:
        """Analytic default for InternViT-6B + InternLM2-20B (training FLOPs; see the derivation)."""
        vision, llm = _internvl_6b_20b_coefficients()
        return cls(vision_coef=vision, llm_coef=llm, name="analytic:internvit-6b+internlm2-20b")

    @classmethod
    def from_cost_table(cls, table, *, name: str | None = None) -> BalanceCost:
        """Sum the forward + backward time coefficients of the vision-kind layers (vision_embed,
        vision_block, projector) and of the LLM-kind layers (llm_embed, llm_block, lm_head) of a
        :class:`omnibal.cost.table.LayerCostTable` (analytic or calibrated)."""
        kinds = np.asarray(table.kinds)
        total = np.asarray(table.fwd_time, np.float64) + np.asarray(table.bwd_time, np.float64)
        vision_rows = np.isin(kinds, VISION_KINDS)
        llm_rows = np.isin(kinds, LLM_KINDS)
        unknown = sorted(set(kinds[~(vision_rows | llm_rows)].tolist()))
        if unknown:
            raise InputError(f"layer kinds {unknown} are neither vision nor LLM kinds",
                             source="LayerCostTable", field="kinds")
        return cls(
            vision_coef=tuple(np.clip(total[vision_rows].sum(axis=0), 0, None)),
            llm_coef=tuple(np.clip(total[llm_rows].sum(axis=0), 0, None)),
            name=name or "cost-table",
        )

    # -- evaluation ---------------------------------------------------------------------------------
    def sample_costs(self, tiles: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-sample (vision, llm) costs without the per-micro-batch constant (float64 arrays)."""
        v = np.asarray(tiles, np.float64)
        t = np.asarray(tokens, np.float64)
        tsq = t * t
        cv, cl = self.vision_coef, self.llm_coef
        return cv[1] * v + cv[2] * t + cv[3] * tsq, cl[1] * v + cl[2] * t + cl[3] * tsq

    def grid_costs(self, tiles: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`sample_costs` on an integer grid (:func:`to_grid`): what the balancer sums and compares,
        so that no decision turns on the order a float sum was added in."""
        vision, llm = self.sample_costs(tiles, tokens)
        return to_grid(vision), to_grid(llm)

    def evaluate(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Micro-batch features ``[..., 4]`` -> (vision cost, llm cost), each ``[...]``."""
        f = np.asarray(features, np.float64)
        return f @ np.asarray(self.vision_coef), f @ np.asarray(self.llm_coef)

    def to_dict(self) -> dict:
        return {"name": self.name, "vision_coef": list(self.vision_coef), "llm_coef": list(self.llm_coef)}

    @classmethod
    def from_dict(cls, d: dict) -> BalanceCost:
        return cls(vision_coef=tuple(d["vision_coef"]), llm_coef=tuple(d["llm_coef"]), name=d.get("name", "custom"))


def to_grid(costs: np.ndarray) -> np.ndarray:
    """Non-negative per-sample costs as integers (held in float64) in units of ``2**-k`` of the largest,
    with ``k = 52 - bits(n)`` for ``n`` costs: every sum of them is then below ``2**52`` and exact, the same
    whatever order it is added in (a float sum's last bit depends on it: numpy's blocking, the CPU's
    vector width). Only ratios matter to the balancer; the rounding is at most ``2**-k`` of the largest
    cost (``2**-31`` for a million rows). The unit is a power of two, so the scaling itself is exact."""
    costs = np.asarray(costs, np.float64)
    top = float(costs.max()) if len(costs) else 0.0
    if not top > 0:
        return np.zeros_like(costs)
    bits = 52 - max(len(costs).bit_length(), 1)
    return np.rint(costs * math.ldexp(1.0, bits - math.frexp(top)[1]))


DEFAULT_COST = BalanceCost.internvl_6b_20b()
