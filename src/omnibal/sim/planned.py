"""What ``omnibal simulate --plan`` takes from a plan, so that it predicts what ``omnibal plan`` predicted.

A plan's prediction depends on more than its partition and recompute set: the model spec it was made for (a
``--hf-model`` checkpoint has no preset), the measured profile, the memory budget, the pipeline schedule, the
statistics and the uniform sample of them that was balanced (and the epoch scale that sample stands for), the
balancer's settings (the pack size the pack-size search chose, fixed caps, the oversize policy) and the seed.
``omnibal plan`` records each of them in ``plan.json``; :meth:`PlannedRun.of` reads them back and the
functions here turn them into the simulator's inputs with the same calls ``omnibal plan`` made
(``omnibal.sim.predict``). A setting given explicitly to ``simulate`` wins over the plan's.

A plan from an older omnibal may lack some of these fields: the simulation then falls back to the flags and
defaults for them, and :meth:`PlannedRun.missing` names the fields (``omnibal simulate`` prints them).
The plan arrives duck-typed so that ``sim`` does not import ``plan`` (the layer above it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from omnibal.errors import InputError
from omnibal.layout import Layout

RECORDED = ("model_spec", "schedule", "balance", "seed", "balance_samples", "synthetic_stats", "convert_stats",
            "caps")
"""Fields an older plan may lack (``missing`` names them by their place in plan.json)."""
PLACES = {"model_spec": "inputs.model_spec", "schedule": "search.schedule", "balance": "data.settings.config",
          "seed": "data.settings.seed", "balance_samples": "data.settings.balanced_samples",
          "synthetic_stats": "data.settings.synthetic_stats", "convert_stats": "data.settings.convert_stats",
          "caps": "data.settings.caps"}


@dataclass(frozen=True, kw_only=True)
class PlannedRun:
    """What ``simulate`` takes from a plan: its cluster, partition and recompute set, and everything its
    prediction was computed from (None: not recorded by the omnibal that made the plan)."""

    source: str
    """Where the plan came from (errors name it)."""
    model: str
    """Model preset (or spec name) the plan is for."""
    hardware: str
    """Hardware preset the plan is for."""
    layout: Layout
    """The plan's cluster layout (its micro-batch count is the pack the plan runs)."""
    parts: tuple[int, ...]
    """Cut points ``[P + 1]`` of its partition."""
    recompute: frozenset[str]
    """Names of the layers it recomputes whole."""
    selective: frozenset[str] = frozenset()
    """Names of the layers it recomputes selectively."""
    num_layers: int
    """Layers of the model it was made for."""
    stack: str | None = None
    """Software stack its memory model counted."""
    padding: str | None = None
    """How its balanced packs run (the padding ``omnibal plan`` scored it with)."""
    model_spec: dict | None = None
    """The model spec (``ModelSpec.to_dict``): a ``--hf-model`` plan has no preset to look up."""
    profile: str | None = None
    """Measured layer profile the cost table came from (None: the analytic model)."""
    budget_recorded: bool = False
    """Whether ``memory_budget_bytes`` is the plan's (False: use ``--memory-fraction``)."""
    memory_budget_bytes: float | None = None
    """Bytes per device the plan fits (None with ``budget_recorded``: unlimited)."""
    schedule: str | None = None
    """Pipeline schedule the plan was scored with."""
    num_chunks: int = 1
    """Model chunks per pipeline device (interleaved 1F1B: > 1; its cut points describe P x chunks stages)."""
    balance_method: str | None = None
    """Balancer of the plan's schedule."""
    balance: dict | None = None
    """Its ``BalanceConfig.to_dict()``: pack target, fixed caps, oversize policy, batch size."""
    seed: int | None = None
    """Seed of the synthetic data, the balanced sample and the balancer."""
    balance_samples: int | None = None
    """Rows of the uniform sample that was balanced (the epoch is scaled from it)."""
    num_samples: int | None = None
    """Rows of the whole epoch."""
    synthetic_stats: bool | None = None
    """Whether the statistics were the synthetic mixture (else a file or a caller's table)."""
    stats_path: str | None = None
    """The statistics file the plan read (None: synthetic or handed over in memory)."""
    convert_stats: bool | None = None
    """Whether statistics of another image convention were converted (``--convert-stats``)."""
    stats_fingerprint: str | None = None
    """``SampleStats.fingerprint()`` of the balanced sample."""
    caps: dict | None = None
    """``{"tiles", "tokens"}``: the caps of the plan's schedule (simulate checks its own against them)."""

    @classmethod
    def of(cls, plan, source: str) -> PlannedRun:
        """From an ``omnibal.plan.Plan`` (duck-typed: ``sim`` sits below ``plan``)."""
        i, settings = plan.inputs, plan.data.settings
        return cls(source=str(source), model=i.model, hardware=i.hardware, layout=i.layout,
                   parts=tuple(int(c) for c in plan.parts), recompute=frozenset(plan.recompute_modules()),
                   selective=frozenset(plan.selective_modules()),
                   num_layers=plan.num_layers, stack=settings.get("stack"), padding=settings.get("padding"),
                   model_spec=i.model_spec or None, profile=i.profile, budget_recorded=True,
                   memory_budget_bytes=i.memory_budget_bytes, schedule=plan.search.get("schedule"),
                   num_chunks=getattr(i, "num_chunks", 1),
                   balance_method=plan.data.method, balance=settings.get("config"), seed=settings.get("seed"),
                   balance_samples=settings.get("balanced_samples"), num_samples=i.num_samples,
                   synthetic_stats=settings.get("synthetic_stats"), stats_path=settings.get("stats_path"),
                   convert_stats=settings.get("convert_stats"), stats_fingerprint=i.stats_fingerprint or None,
                   caps=settings.get("caps"))

    def missing(self) -> list[str]:
        """Where in plan.json the fields this plan lacks would be (the simulation uses flags or defaults)."""
        return [PLACES[name] for name in RECORDED if getattr(self, name) is None]


def planned_spec(name: str, plan: PlannedRun | None):
    """The :class:`omnibal.cost.spec.ModelSpec` to simulate: the plan's recorded spec, else preset ``name``."""
    from omnibal.cost.spec import ModelSpec

    if plan is not None and plan.model_spec and name == plan.model:
        return ModelSpec.from_dict(plan.model_spec, source=f"{plan.source}: inputs.model_spec")
    from omnibal.cost.presets import get_model_preset

    return get_model_preset(name)


def planned_data(plan: PlannedRun | None, *, stats_path: str | None, samples: int | None, seed: int | None,
                 convert: bool) -> dict:
    """Keyword arguments of ``omnibal.sim.predict.job_stats`` (``stats_path``, ``num_samples``, ``seed``,
    ``convert``) and ``balance_samples``: the given ones, else the plan's data, else the defaults."""
    seed = seed if seed is not None else (plan.seed if plan is not None and plan.seed is not None else 0)
    out = {"stats_path": stats_path, "num_samples": samples, "seed": seed, "convert": convert,
           "balance_samples": None}
    if plan is None:
        return out
    if stats_path is None and plan.synthetic_stats is False:
        if plan.stats_path is None:
            raise InputError("the plan was made from statistics handed over in memory: give them with --stats",
                             source=plan.source, field="data.settings.stats_path")
        out["stats_path"] = plan.stats_path
    if out["stats_path"] is None and samples is None:
        out["num_samples"] = plan.num_samples  # the synthetic mixture the plan drew (older plans: assumed)
    if plan.convert_stats:
        out["convert"] = True
    out["balance_samples"] = plan.balance_samples
    return out


def planned_balance_config(plan: PlannedRun | None, *, method: str | None, batch_size: int | None, cost):
    """The :class:`omnibal.data.balance.BalanceConfig` to balance with: the plan's (its pack target, caps and
    oversize policy; the cost from this simulation's own cost table, as ``omnibal plan`` made it) unless
    ``method`` names another balancer or the plan records none; ``batch_size`` given wins."""
    from omnibal.data.balance import BalanceConfig

    if plan is None or plan.balance is None or (method is not None and method != plan.balance_method):
        return BalanceConfig(method=method or "omnibal", batch_size=4 if batch_size is None else batch_size,
                             cost=cost)
    known = {f.name for f in fields(BalanceConfig)}
    values = {k: v for k, v in plan.balance.items() if k != "cost"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise InputError(f"unknown balancer setting {unknown[0]!r}", source=plan.source,
                         field=f"data.settings.config.{unknown[0]}")
    if batch_size is not None:
        values["batch_size"] = batch_size
    try:
        return BalanceConfig(**values, cost=cost)
    except (TypeError, InputError) as exc:
        raise InputError(f"not a balancer config: {exc}", source=plan.source, field="data.settings.config") from None
