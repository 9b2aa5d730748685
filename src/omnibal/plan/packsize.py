"""Pack-size search: samples per micro-batch and micro-batches per step, jointly with partition and recompute.

A balanced pack's size is a memory-for-time trade the planner has to make itself. Larger packs amortise the
per-micro-batch costs (p2p latency, layer overheads) and fill a pipeline with fewer micro-batches, but
every in-flight micro-batch holds its activations: on InternViT-6B + InternLM2-20B a 40-tile, 14k-token
pack keeps ~5 GB per ViT block, so stage 0 (4 micro-batches in flight under 1F1B) has to checkpoint most of
its layers. Smaller packs with more micro-batches per step keep less per micro-batch (less recompute) and
shrink the pipeline bubble (``(P - 1) / (M + P - 1)``) at the same samples per step.

So, for every candidate micro-batch count ``M`` (the samples per optimizer step held fixed: ``M x
target_samples = samples_per_rank_step``), the search

1. balances a uniform random subset of the data with that pack target (the cap search picks Q_v, Q_t);
2. solves the exact joint partition + least recompute under the memory budget (``JointPlanner``);
3. simulates that plan over the subset's epoch and scales it to the whole dataset.

A candidate whose packs miss the samples per step by more than ``batch_tolerance`` (packs cannot shrink
below the largest sample) is reported unplanned. Candidates that no plan fits, or that the simulator sees
run out of memory, are kept in the report but never chosen; the fastest remaining one wins (ties: the larger
pack, fewer micro-batches). The chosen ``(M, target)`` then goes through the full balance and the neighbour
search like any other job.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from omnibal.cost.table import RECOMPUTE_FULL, RECOMPUTE_SELECTIVE
from omnibal.data.balance.api import balance
from omnibal.errors import InputError
from omnibal.plan.joint import JointPlanner
from omnibal.plan.stages import layer_quantities
from omnibal.sim.epoch import simulate_epoch
from omnibal.validate import is_int


@dataclass(frozen=True, kw_only=True)
class PackSearchConfig:
    """Which pack sizes the planner tries."""

    microbatches: tuple[int, ...] = (8, 12, 16, 24, 32)
    """Candidate micro-batches per step per DP rank; empty: no search (the job's own M and target)."""
    screen_samples: int = 20_000
    """Samples of the subset each candidate is balanced and simulated on (the full balance follows only for
    the chosen one)."""
    min_gain: float = 0.02
    """Another pack replaces the job's own (``incumbent``) only when its screened epoch is at least this
    fraction shorter: the screen runs on a subset, and a near tie is not worth a different pack."""
    batch_tolerance: float = 0.15
    """A candidate whose balanced packs hold more than this fraction more or fewer samples per step than
    asked is not chosen: it would change the global batch (packs cannot shrink below the largest sample,
    so very small targets overshoot), not only how the step is cut."""

    def validate(self) -> None:
        if any(not is_int(m) or m < 1 for m in self.microbatches):
            raise InputError(f"must be positive integers, got {self.microbatches!r}", source="--pack-microbatches",
                             field="microbatches")
        if not 0 <= self.batch_tolerance:
            raise InputError(f"must be >= 0, got {self.batch_tolerance}", source="pack batch_tolerance",
                             field="batch_tolerance")
        if not 0 <= self.min_gain < 1:
            raise InputError(f"must be in [0, 1), got {self.min_gain}", source="pack min_gain", field="min_gain")
        if self.screen_samples < 1:
            raise InputError(f"must be >= 1, got {self.screen_samples}", source="pack screen_samples",
                             field="screen_samples")


@dataclass(frozen=True, kw_only=True)
class PackCandidate:
    """One pack size as the search saw it."""

    num_microbatches: int
    """Micro-batches per step per DP rank."""
    target_samples: float
    """Mean samples per micro-batch the cap search aimed at."""
    samples_per_microbatch: float
    """Mean samples per micro-batch of the balanced subset."""
    max_tiles: int
    """Q_v the cap search chose on the subset."""
    max_tokens: int
    """Q_t the cap search chose on the subset."""
    parts: tuple[int, ...]
    """Cut points of the joint plan (empty when nothing fits)."""
    num_checkpointed: int
    """Layers the joint plan recomputes whole."""
    gpu_days: float
    """Simulated epoch of the subset, scaled to the dataset (inf when nothing fits)."""
    oom: bool
    """No plan fits the budget, or the simulator saw a device above it."""
    off_batch: bool = False
    """Its packs miss the samples per step by more than ``batch_tolerance`` (not chosen)."""
    num_selective: int = 0
    """Blocks the joint plan recomputes selectively."""

    def to_dict(self) -> dict:
        return {"off_batch": self.off_batch, "num_microbatches": self.num_microbatches,
                "target_samples": self.target_samples,
                "samples_per_microbatch": self.samples_per_microbatch, "max_tiles": self.max_tiles,
                "max_tokens": self.max_tokens, "parts": list(self.parts), "num_checkpointed": self.num_checkpointed,
                "num_selective": self.num_selective,
                "gpu_days": self.gpu_days if np.isfinite(self.gpu_days) else None, "oom": self.oom}


def screen_pack_size(stats, table, stage_config, sim_config, *, balance_config, samples_per_rank_step: float,
                     num_microbatches: int, num_total_samples: int, seed: int,
                     batch_tolerance: float = float("inf"), padding: str = "varlen") -> PackCandidate:
    """Balance ``stats`` (the screening subset) with ``num_microbatches`` packs of ``samples_per_rank_step /
    num_microbatches`` samples, plan it jointly and simulate it (see the module docstring). Packs that miss
    the samples per step by more than ``batch_tolerance`` are reported without planning them. ``padding``:
    how the packs run (``varlen``, or ``fixed_buffer``: padded to the caps), as in the job."""
    target = samples_per_rank_step / num_microbatches
    dp = stage_config.dp_size
    sched = balance(stats, dp_size=dp, num_microbatches=num_microbatches, seed=seed,
                    config=replace(balance_config, target_samples=target))
    features = sched.features(stats, padding=padding)
    cfg = replace(stage_config, num_microbatches=num_microbatches)
    mb_samples = len(stats) / max(features.shape[0] * dp * num_microbatches, 1)
    common = dict(num_microbatches=num_microbatches, target_samples=round(target, 4),
                  samples_per_microbatch=round(mb_samples, 3), max_tiles=int(sched.caps.tiles),
                  max_tokens=int(sched.caps.tokens))
    if abs(mb_samples / target - 1) > batch_tolerance:
        return PackCandidate(**common, parts=(), num_checkpointed=0, gpu_days=float("inf"), oom=False, off_batch=True)
    try:
        sp = JointPlanner(layer_quantities(table, features, cfg), cfg).plan()
    except InputError:  # no partition fits the budget with these packs
        return PackCandidate(**common, parts=(), num_checkpointed=0, gpu_days=float("inf"), oom=True)
    mask = sp.recompute_mask(table.num_layers)
    res = simulate_epoch(table, sp.parts, mask, features, sim_config)
    gpu_days = res.total_time * (num_total_samples / len(stats)) * res.num_gpus / 86400.0
    return PackCandidate(**common, parts=tuple(sp.parts), num_checkpointed=int((mask == RECOMPUTE_FULL).sum()),
                         num_selective=int((mask == RECOMPUTE_SELECTIVE).sum()), gpu_days=gpu_days,
                         oom=bool(res.oom.any()) if res.oom is not None else False)


def search_pack_size(stats, table, stage_config, sim_config, *, balance_config, samples_per_rank_step: float,
                     config: PackSearchConfig, num_total_samples: int, seed: int, padding: str = "varlen",
                     incumbent: int | None = None) -> tuple[PackCandidate | None, list[PackCandidate]]:
    """Screen every candidate of ``config`` on a ``config.screen_samples`` subset of ``stats``; returns the
    chosen one (None: nothing fits) and all of them, in ``config.microbatches`` order. ``incumbent``: the
    job's own micro-batch count, kept unless another candidate is ``config.min_gain`` faster."""
    config.validate()
    if len(stats) > config.screen_samples:
        rows = np.sort(np.random.default_rng([seed, 0x9AC]).choice(len(stats), config.screen_samples, replace=False))
        stats = stats.take(rows)
    cands = []
    for m in config.microbatches:
        if len(stats) < stage_config.dp_size * m:
            continue
        cands.append(screen_pack_size(stats, table, stage_config, sim_config, balance_config=balance_config,
                                      samples_per_rank_step=samples_per_rank_step, num_microbatches=m,
                                      num_total_samples=num_total_samples, seed=seed,
                                      batch_tolerance=config.batch_tolerance, padding=padding))
    fitting = [c for c in cands if not c.oom and not c.off_batch]
    chosen = min(fitting, key=lambda c: (round(c.gpu_days, 6), c.num_microbatches)) if fitting else None
    own = next((c for c in fitting if c.num_microbatches == incumbent), None)
    if chosen is not None and own is not None and chosen.gpu_days > (1 - config.min_gain) * own.gpu_days:
        chosen = own
    return chosen, cands
