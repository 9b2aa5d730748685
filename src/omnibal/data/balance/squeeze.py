"""Token squeeze (the packer's last phase with derived caps): the token buffer is the largest pack, so lower
the largest pack's tokens towards the mean while the tile cap holds.

The levelling phases aim at the searched token cap: once every pack is under it, nothing pulls the top packs
further down, and a tail of packs a percent or so over the mean sets the derived Q_t. A round runs the LLM
levelling (``exchange.level_llm``) against a lower token target -- first ``mean + SHARE (max - mean)``; when
that does not lower the largest pack, the ``TOP_SHARE`` quantile, which only a few packs are over, so the
targeted repair serves each of them -- and then the layers again; a round is kept only when the largest pack
came down (and no pack went over the tile cap), else it is undone and the squeeze ends. Samples only change
packs: exactly-once holds.
"""

from __future__ import annotations

import numpy as np

from omnibal.data.balance.exchange import Packs, Targets, level_llm
from omnibal.data.balance.layers import level_tokens
from omnibal.data.balance.phases import WorkBudget

SHARE = 0.6
"""First target of a round: this share of the way from the mean pack to the largest."""
TOP_SHARE = 0.99
"""Second target of a round: the pack tokens' quantile (few packs over it)."""
ROUNDS = 3
"""Rounds at most (each kept one lowers the largest pack)."""
WORK_PER_ROW = 300
"""Candidate exchanges per row all the rounds together may weigh (a ``WorkBudget``)."""


def squeeze_tokens(packs: Packs, v, t, lc, *, max_tiles: float, llm_tol, rng, max_passes: int,
                   rounds: int = ROUNDS) -> int:
    """Lower the largest pack's tokens (module docstring); returns the rounds kept."""
    p = len(packs.pv)
    if p < 2:
        return 0
    mean = float(packs.pt.sum()) / p
    budget = WorkBudget.per_row(packs.n, WORK_PER_ROW, floor=0.0)
    kept = 0
    for _ in range(rounds):
        top = float(packs.pt.max())
        for cap in (mean + SHARE * (top - mean), float(np.sort(packs.pt)[int(p * TOP_SHARE)])):
            if not mean < cap < top:
                continue
            snapshot = packs.slots.copy(), packs.pv.copy(), packs.pt.copy(), packs.pl.copy()
            level_llm(packs, Targets.of(v, t, lc, p, max_tiles, cap, llm_tol), rng, max_passes, budget)
            level_tokens(packs, rng)
            if float(packs.pt.max()) < top and float(packs.pv.max()) <= max_tiles:
                kept += 1
                break
            packs.slots, packs.pv, packs.pt, packs.pl = snapshot
        else:
            return kept
    return kept
