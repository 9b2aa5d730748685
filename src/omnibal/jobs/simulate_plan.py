"""What ``omnibal simulate --plan`` takes from a plan, so that it predicts what ``omnibal plan`` predicted.

A plan's prediction depends on more than its partition and recompute set: the model spec it was made for (a
``--hf-model`` checkpoint has no preset), the measured profile, the memory budget, the pipeline schedule, the
statistics and the uniform sample of them that was balanced (and the epoch scale that sample stands for), the
balancer's settings (the pack size the pack-size search chose, fixed caps, the oversize policy) and the seed.
``omnibal plan`` records each of them in ``plan.json`` (:class:`omnibal.plan.plan.Plan`); the functions here
read them from the plan and turn them into the simulator's inputs with the same calls ``omnibal plan`` made
(``omnibal.jobs.predict``). A setting given explicitly to ``simulate`` wins over the plan's.

A plan from an older omnibal may lack some of these fields: the simulation then falls back to the flags and
defaults for them, and :func:`missing` names the fields (``omnibal simulate`` prints them).
"""

from __future__ import annotations

from dataclasses import fields

from omnibal.errors import InputError
from omnibal.plan.plan import Plan

RECORDED = {
    "inputs.model_spec": lambda plan: plan.inputs.model_spec or None,
    "search.pp_schedule": lambda plan: plan.search.get("pp_schedule"),
    "data.settings.config": lambda plan: plan.data.settings.get("config"),
    "data.settings.seed": lambda plan: plan.data.settings.get("seed"),
    "data.settings.balanced_samples": lambda plan: plan.data.settings.get("balanced_samples"),
    "data.settings.synthetic_stats": lambda plan: plan.data.settings.get("synthetic_stats"),
    "data.settings.convert_stats": lambda plan: plan.data.settings.get("convert_stats"),
    "data.settings.caps": lambda plan: plan.data.settings.get("caps"),
}
"""Fields an older plan may lack, by their place in plan.json: how to read each (None: not recorded)."""


def missing(plan: Plan) -> list[str]:
    """Where in plan.json the fields this plan lacks would be (the simulation uses flags or defaults)."""
    return [place for place, read in RECORDED.items() if read(plan) is None]


def planned_spec(name: str, plan: Plan | None, source: str):
    """The :class:`omnibal.cost.spec.ModelSpec` to simulate: the plan's recorded spec, else preset ``name``."""
    from omnibal.cost.spec import ModelSpec

    if plan is not None and plan.inputs.model_spec and name == plan.inputs.model:
        return ModelSpec.from_dict(plan.inputs.model_spec, source=f"{source}: inputs.model_spec")
    from omnibal.cost.presets import get_model_preset

    return get_model_preset(name)


def planned_data(plan: Plan | None, source: str, *, stats_path: str | None, samples: int | None,
                 seed: int | None, convert: bool) -> dict:
    """Keyword arguments of ``omnibal.jobs.predict.job_stats`` (``stats_path``, ``num_samples``, ``seed``,
    ``convert``) and ``balance_samples``: the given ones, else the plan's data, else the defaults."""
    settings = plan.data.settings if plan is not None else {}
    seed = seed if seed is not None else (settings["seed"] if settings.get("seed") is not None else 0)
    out = {"stats_path": stats_path, "num_samples": samples, "seed": seed, "convert": convert,
           "balance_samples": None}
    if plan is None:
        return out
    if stats_path is None and settings.get("synthetic_stats") is False:
        if settings.get("stats_path") is None:
            raise InputError("the plan was made from statistics handed over in memory: give them with --stats",
                             source=source, field="data.settings.stats_path")
        out["stats_path"] = settings["stats_path"]
    if out["stats_path"] is None and samples is None:
        out["num_samples"] = plan.inputs.num_samples  # the synthetic mixture the plan drew (older plans: assumed)
    if settings.get("convert_stats"):
        out["convert"] = True
    out["balance_samples"] = settings.get("balanced_samples")
    return out


def planned_balance_config(plan: Plan | None, source: str, *, method: str | None, batch_size: int | None, cost):
    """The :class:`omnibal.data.balance.BalanceConfig` to balance with: the plan's (its pack target, caps and
    oversize policy; the cost from this simulation's own cost table, as ``omnibal plan`` made it) unless
    ``method`` names another balancer or the plan records none; ``batch_size`` given wins."""
    from omnibal.data.balance import BalanceConfig

    recorded = plan.data.settings.get("config") if plan is not None else None
    if recorded is None or (method is not None and method != plan.data.method):
        return BalanceConfig(method=method or "omnibal", batch_size=4 if batch_size is None else batch_size,
                             cost=cost)
    known = {f.name for f in fields(BalanceConfig)}
    values = {k: v for k, v in recorded.items() if k != "cost"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise InputError(f"unknown balancer setting {unknown[0]!r}", source=source,
                         field=f"data.settings.config.{unknown[0]}")
    if batch_size is not None:
        values["batch_size"] = batch_size
    try:
        return BalanceConfig(**values, cost=cost)
    except (TypeError, InputError) as exc:
        raise InputError(f"not a balancer config: {exc}", source=source, field="data.settings.config") from None
