"""``omnibal balance`` as a library call: statistics, a layout and the balancer's settings in, a schedule out.

Phases (each a call into the layer that owns it):

1. per-sample stats: a file (``omnibal.stats.io.load_stats``) or the synthetic InternVL-like mixture;
2. with a model, the cost ``omnibal plan`` balances by (``jobs.predict.balance_cost``) and the stats in the
   model's units (``omnibal.cost.units.model_stats``); without one, the balancer's own cost and the stats as
   given;
3. ``data.balance.balance`` for the layout's DP ranks and micro-batches, and the schedule's metrics
   (``data.metrics.schedule_metrics``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from omnibal.cost.hardware import HardwareSpec, get_hardware
from omnibal.data.balance import BalanceConfig, Schedule
from omnibal.data.balance.cost import BalanceCost
from omnibal.errors import InputError
from omnibal.layout import Layout
from omnibal.stats.table import SampleStats

BALANCE_LAYOUT = Layout(num_microbatches=4)
"""The command line's layout before its flags: 4 micro-batches per DP rank per step (``omnibal train``'s
default too, so the schedule runs there as written); ``--dp`` has no default."""


@dataclass(frozen=True, kw_only=True)
class BalanceJobConfig:
    """Everything ``omnibal balance`` needs: the data, the layout it is balanced for, the balancer and the
    cost it balances by."""

    stats_path: str | None = field(default=None, metadata={"option": "stats"})
    """Per-sample statistics file (json/jsonl/parquet/OmniBal token-length); None: the synthetic default
    mixture of ``samples`` rows."""
    samples: int = 1_200_000
    """Rows of the synthetic default mixture used when no statistics file is given."""
    layout: Layout = field(metadata={
        "fields": {"dp_size": "data-parallel ranks (required)",
                   "num_microbatches": "micro-batches per DP rank per step (default 4: omnibal train's default "
                                       "too, so the schedule runs there as written)"},
        "cli_default": BALANCE_LAYOUT})
    """Data-parallel ranks and micro-batches per DP rank per step the schedule is for (its PP, TP and ZeRO do
    not change the schedule: the command line offers only the two)."""
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    """The balancer's settings; with ``model`` its cost is the model's."""
    seed: int = 0
    """Seed of data, shuffles and sampling."""
    epoch: int = 0
    """Epoch to balance."""
    model: str | None = None
    """Model preset: balance by its cost on ``hardware`` (or ``profile_path``), stats in its units; None: the
    balancer's own cost, stats as given."""
    hardware: str | HardwareSpec = field(default="a100-80g", metadata={"parse": str})
    """Hardware preset of the model's analytic cost (``cpu``: measured here; the command line measures it and
    passes the :class:`HardwareSpec`)."""
    profile_path: str | None = field(default=None, metadata={"option": "profile"})
    """Measured layer profile (omnibal profile) of the model."""
    convert_stats: bool = False
    """Convert stats of another image convention to the model's."""


@dataclass(frozen=True, eq=False)
class BalanceJobResult:
    """What ``omnibal balance`` prints and writes."""

    schedule: Schedule
    """The balanced epoch (``Schedule.to_json`` writes the schedule file)."""
    stats: SampleStats
    """The statistics balanced (in the model's units with a model): what the schedule's rows index."""
    metrics: dict
    """``omnibal.data.metrics.schedule_metrics`` of the schedule (JSON-serialisable)."""
    cost: BalanceCost
    """The cost the schedule was balanced and its metrics priced by."""
    seconds: float
    """Wall time of the balancing itself."""


def run_balance_job(config: BalanceJobConfig) -> BalanceJobResult:
    """Balance one epoch (see the module docstring)."""
    from omnibal.data.balance import balance
    from omnibal.data.metrics import schedule_metrics

    stats = _load(config)
    cost, stats = _model_cost(config, stats)
    check_target_samples(config.balance.target_samples,
                         slots=config.layout.dp_size * config.layout.num_microbatches)
    bconfig = config.balance if cost is None else replace(config.balance, cost=cost)
    t0 = time.perf_counter()
    schedule = balance(stats, dp_size=config.layout.dp_size, num_microbatches=config.layout.num_microbatches,
                       seed=config.seed, epoch=config.epoch, config=bconfig)
    seconds = time.perf_counter() - t0
    return BalanceJobResult(schedule=schedule, stats=stats, metrics=schedule_metrics(schedule, stats, bconfig.cost),
                            cost=bconfig.cost, seconds=seconds)


def _load(config: BalanceJobConfig):
    if config.stats_path is None:
        from omnibal.stats.synthetic import synthetic_internvl_mixture

        return synthetic_internvl_mixture(config.samples, seed=0)
    from omnibal.stats.io import load_stats

    return load_stats(config.stats_path)


def _model_cost(config: BalanceJobConfig, stats: SampleStats) -> tuple[BalanceCost | None, SampleStats]:
    """``(balancer cost, stats)``: with a model, the cost ``omnibal plan`` balances by and the stats in the
    model's units; without one None (the balancer's own cost) and the stats as given."""
    if config.model is None:
        if config.profile_path:
            raise InputError("a profile describes one model: give its model too", field="profile_path")
        return None, stats
    from omnibal.cost.presets import get_model_preset
    from omnibal.cost.units import model_stats
    from omnibal.jobs.predict import balance_cost, cost_table

    spec = get_model_preset(config.model)
    hardware = config.hardware if isinstance(config.hardware, HardwareSpec) else get_hardware(config.hardware)
    stats = model_stats(stats, spec, convert=config.convert_stats or config.stats_path is None)
    table = cost_table(spec, hardware, profile_path=config.profile_path)
    return balance_cost(table, spec, hardware, config.profile_path), stats


def check_target_samples(target: float, *, slots: int) -> None:
    """A target of ``T`` samples per micro-batch asks for about N / T micro-batches of N samples. A
    micro-batch holds at least one sample, so a target below one sample per step's micro-batches
    (``1 / slots``) asks for more steps than the samples can fill: refused by name, before the cap search
    tries step counts no schedule can have."""
    if not math.isfinite(target) or target <= 0:
        raise InputError(f"must be a finite number > 0, got {target}", field="target_samples")
    if target * slots < 1:
        raise InputError(f"{target:g} samples per micro-batch asks for more micro-batches than there are samples "
                         f"(each holds at least one); give at least 1 / (dp x microbatches) = {1 / slots:g}",
                         field="target_samples")
