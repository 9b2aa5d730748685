"""The one step-time prediction path: model + hardware (or a measured profile) + statistics -> the cost table,
the statistics in the model's units, the balancer's cost and the micro-batch features the simulator runs.

``omnibal plan`` (``jobs.plan_job``), ``omnibal simulate`` and ``omnibal balance`` all call these functions, so the
same inputs give the same prediction: two paths drift apart (one re-counting the LLM tokens of each tile
for the model, the other taking the statistics' tokens per tile as they are), and the commands would then
disagree by a multiple for the same job.

The statistics are put in the model's units by :func:`omnibal.cost.units.model_stats`, the one owner of
that conversion (the trainer calls it too).
"""

from __future__ import annotations

import numpy as np

from omnibal.cost.hardware import HardwareSpec
from omnibal.cost.spec import ModelSpec
from omnibal.cost.stack import DEFAULT_STACK
from omnibal.cost.table import LayerCostTable
from omnibal.cost.units import convention_label, model_stats
from omnibal.data.balance.cost import BalanceCost
from omnibal.errors import InputError
from omnibal.stats.table import SampleStats
from omnibal.validate import is_int

SYNTHETIC_SAMPLES = 1_200_000
"""Rows of the synthetic InternVL-like mixture when no size is given (InternVL-1.2M's)."""


def job_stats(spec: ModelSpec, *, stats_path: str | None = None, num_samples: int | None = None, seed: int = 0,
              convert: bool = False) -> tuple[SampleStats, str]:
    """The statistics a job runs, in ``spec``'s units (:func:`model_stats`), and how their convention was read
    (:func:`convention_label`): a stats file (``num_samples``: replicate its rows up to that many; None: as
    they are) or the synthetic InternVL-like mixture of ``num_samples`` rows (default
    :data:`SYNTHETIC_SAMPLES`) drawn with ``seed``, always converted (it stands in for any model's data).
    ``omnibal plan`` and ``omnibal simulate`` read their data here, so the same inputs give the same rows."""
    if num_samples is not None and (not is_int(num_samples)
                                    or num_samples < 1):
        raise InputError(f"must be a positive integer, got {num_samples!r}", source="--samples", field="samples")
    if stats_path:
        from omnibal.stats.io import load_stats

        raw = load_stats(stats_path)
        if num_samples is not None:
            raw = raw.replicate(num_samples)
        return model_stats(raw, spec, convert=convert), convention_label(raw, spec)
    from omnibal.stats.synthetic import synthetic_internvl_mixture

    raw = synthetic_internvl_mixture(SYNTHETIC_SAMPLES if num_samples is None else num_samples, seed=seed)
    return model_stats(raw, spec, convert=True), convention_label(raw, spec)


def balance_subset(stats: SampleStats, balance_samples: int | None, seed: int) -> SampleStats:
    """The uniform random ``balance_samples`` rows of ``stats`` a job balances and simulates, scaled to the
    whole epoch (all of them when that is None or not fewer). Seeded by ``seed``: ``omnibal plan`` and
    ``omnibal simulate --plan`` draw the same rows."""
    if balance_samples is None or balance_samples >= len(stats):
        return stats
    rows = np.random.default_rng(seed).choice(len(stats), balance_samples, replace=False)
    return stats.take(np.sort(rows))


def cost_table(spec: ModelSpec, hardware: HardwareSpec, *, profile_path: str | None = None, tp_size: int = 1,
               dtype: str = "bf16", stack: str = DEFAULT_STACK) -> LayerCostTable:
    """The per-TP-rank cost table: the analytic model on ``hardware`` or a measured profile (``profile_path``),
    with the static bytes of the software ``stack`` (``omnibal.cost.stack``).

    A vision encoder whose heads or MLP width do not divide by ``tp_size`` (InternViT-6B's 25 heads) is
    replicated on every TP rank instead of split."""
    tp_vision = spec.vision.num_heads % tp_size == 0 and spec.vision.mlp_hidden % tp_size == 0
    if profile_path is None:
        from omnibal.cost.analytic import analytic_cost_table

        return analytic_cost_table(spec, hardware, tp_size=tp_size, dtype=dtype, tp_vision=tp_vision, stack=stack)
    from omnibal.cost.profile import cost_table_from_profile, load_profile

    return cost_table_from_profile(spec, load_profile(profile_path, spec), hardware=hardware, tp_size=tp_size,
                                   tp_vision=tp_vision, stack=stack)


def balance_cost(table: LayerCostTable, spec: ModelSpec, hardware: HardwareSpec | None = None,
                 profile_path: str | None = None):
    """The balancer's cost (vision and LLM seconds per sample) from the same table the simulator runs."""
    where = f"profile:{profile_path}" if profile_path else f"analytic:{spec.name}@{getattr(hardware, 'name', '?')}"
    return BalanceCost.from_cost_table(table, name=where)


def schedule_features(schedule, stats: SampleStats, *, padding: str, p2p_padding: str | None = None,
                      pp_size: int = 1) -> tuple[np.ndarray, np.ndarray | None]:
    """``(features [S, D, M, 4], buffer features or None)`` of ``schedule`` as it runs: compute with
    ``padding``; with ``pp_size > 1`` and ``p2p_padding`` set (e.g. ``fixed_buffer``: the reference trainer
    sends the caps' shape between stages) the p2p bytes follow that padding instead."""
    features = schedule.features(stats, padding=padding)
    if pp_size > 1 and p2p_padding is not None and p2p_padding != padding:
        return features, schedule.features(stats, padding=p2p_padding)
    return features, None
