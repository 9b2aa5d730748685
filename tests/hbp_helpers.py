"""What the HBP data tests share: a level cost model at the CPU scale of ``cpu_long_context_mixture``."""

from __future__ import annotations

from omnibal.hbp.levels import LevelCostModel

# FLOP units as the default BalanceCost (~1.2e11 per LLM token): SP all-to-all ~5-8% of a token's work
MODEL = LevelCostModel(sp_degrees=(1, 2, 4), a2a_per_token=(0.0, 6e9, 9e9), max_tokens_per_rank=2048,
                       recompute_tokens=(512, 1024, 2048), recompute_ratio=(0.0, 0.1, 0.3))
CANDIDATES = (1024, 2048, 4096, 8192)
"""Level lengths the tests' level search may use."""
