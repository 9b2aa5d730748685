"""The ``Plan``: what to run (data caps, stage ranges, recompute sets), what it is predicted to cost, and what
it was made from. Plain data with a versioned JSON form; loading validates every field and names the bad one.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from omnibal.errors import InputError
from omnibal.layout import Engine, Layout, check_choice, check_layout_fields
from omnibal.outputs import write_text
from omnibal.plan.exports import export_all
from omnibal.validate import is_int

PLAN_FORMAT = "omnibal.plan"
PLAN_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """Everything the plan was computed from (a plan applied to another model or cluster is refused)."""

    model: str
    """Model preset or spec name."""
    model_spec: dict
    """The model spec as a dict (``dataclasses.asdict(ModelSpec)``)."""
    hardware: str
    """Hardware preset name."""
    layout: Layout
    """DP x PP x TP, the ZeRO stage and micro-batches per step per DP rank the plan is for (flat in the plan
    file, after ``num_gpus``, their product: :meth:`to_dict`)."""
    memory_budget_bytes: float | None
    """Bytes per device the plan must fit (None: unlimited)."""
    stats_source: str
    """Where the per-sample statistics came from (file path or the synthetic generator and its seed)."""
    stats_fingerprint: str
    """``SampleStats.fingerprint()`` of those statistics."""
    num_samples: int
    """Samples in the epoch."""
    profile: str | None = None
    """Measured profile the cost table was calibrated with (None: analytic model)."""
    omnibal_version: str = ""
    """Version of omnibal that made the plan."""
    stats_convention: str = ""
    """Image convention the statistics were read in and what the model ran them as (``omnibal.jobs.predict``),
    e.g. ``internvl/256 (not recorded: default) -> internvl/16``."""
    memory_headroom: float | None = None
    """What the budget left of the device memory (a share below 1, else GiB; None: a budget given outright,
    or an older plan)."""
    num_chunks: int = 1
    """Model chunks per pipeline device: 1 for one layer range per device; more for interleaved 1F1B, whose
    ``stages`` are then the ``pp_size * num_chunks`` virtual stages in layer order (virtual stage ``c * P + d``
    is chunk ``c`` of device ``d``)."""

    def to_dict(self) -> dict:
        """The plan file's ``inputs``: the layout flat, after ``num_gpus``."""
        out = {}
        for name, value in asdict(self).items():
            if name == "layout":
                out.update(num_gpus=self.layout.num_gpus, **value)
            else:
                out[name] = value
        return out

    @classmethod
    def file_keys(cls) -> set[str]:
        """The keys of a plan file's ``inputs``."""
        return {f.name for f in fields(cls) if f.name != "layout"} | {"num_gpus", *(f.name for f in fields(Layout))}


@dataclass(frozen=True, kw_only=True)
class DataPlan:
    """How micro-batches are formed: the balancer and its settings (caps), and its metrics on the epoch."""

    method: str
    """Balancer method (``omnibal``, ``isf``, ``random``, ``length-grouped``)."""
    settings: dict
    """The balancer's config (caps such as max tiles / max tokens per pack, seed, ...)."""
    num_steps: int
    """Steps in the epoch."""
    metrics: dict = field(default_factory=dict)
    """Balance metrics (pad ratio, dist ratios, max/mean per step)."""


@dataclass(frozen=True, kw_only=True)
class PlanStage:
    """One pipeline stage."""

    stage: int
    """Stage index (0 = first)."""
    layers: tuple[int, int]
    """Layer range ``[start, stop)`` in the model's layer chain."""
    modules: tuple[str, ...]
    """Module names of those layers (the reference trainer's names)."""
    recompute: tuple[str, ...]
    """Module names recomputed whole (activation checkpointing)."""
    in_flight: int
    """Micro-batches whose activations the stage holds at its peak (1F1B: min(P - s, M))."""
    compute_time_s: float
    """Forward + backward seconds of the mean micro-batch."""
    boundary_time_s: float
    """Point-to-point seconds per micro-batch at its boundaries."""
    recompute_time_s: float
    """Recompute seconds per mean micro-batch."""
    memory_bytes: float
    """Planned peak bytes per device (largest micro-batches in flight)."""
    simulated_peak_memory_bytes: float | None = None
    """Peak bytes per device the simulator saw over the epoch."""
    selective: tuple[str, ...] = ()
    """Module names under selective recompute (``omnibal.train.recompute``; absent in older plans: none)."""

    @property
    def time_s(self) -> float:
        return self.compute_time_s + self.boundary_time_s + self.recompute_time_s


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The simulator's prediction for the plan over the epoch."""

    step_time_s: float
    """Mean seconds per step."""
    epoch_time_s: float
    """Seconds for the epoch."""
    gpu_days: float
    """epoch_time_s * num_gpus / 86400."""
    bubble: float
    """Mean pipeline bubble share."""
    num_steps: int
    """Steps simulated."""
    oom: bool = False
    """Whether the simulator saw any device exceed the memory budget."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A complete plan. ``to_json``/``from_json`` round-trip it exactly."""

    inputs: PlanInputs
    data: DataPlan
    stages: tuple[PlanStage, ...]
    prediction: Prediction
    search: dict = field(default_factory=dict)
    """How the partition was found: anchor cut points, candidates scored, the chosen candidate's rank."""
    version: int = PLAN_VERSION
    engine: str = "reference"
    """The engine whose constraints the plan respects (``omnibal plan --engine``; ``reference``: none)."""

    @property
    def parts(self) -> tuple[int, ...]:
        return tuple([st.layers[0] for st in self.stages] + [self.stages[-1].layers[1]])

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    @property
    def pp_schedule(self) -> str:
        """The pipeline schedule the plan runs (``interleaved`` when it has several chunks per device)."""
        return self.search.get("pp_schedule", "1f1b")

    def device_of(self, stage: int) -> int:
        """Pipeline device (rank) of (virtual) stage ``stage``."""
        return stage % self.inputs.layout.pp_size

    def recompute_modules(self) -> tuple[str, ...]:
        return tuple(m for st in self.stages for m in st.recompute)

    def selective_modules(self) -> tuple[str, ...]:
        return tuple(m for st in self.stages for m in st.selective)

    def to_dict(self) -> dict:
        # "model" at the top is what the reference trainer checks before applying a plan
        out = {"format": PLAN_FORMAT, "version": self.version, "model": self.inputs.model, "engine": self.engine,
               "inputs": self.inputs.to_dict(),
               "data": asdict(self.data), "stages": [], "prediction": asdict(self.prediction),
               "search": self.search}
        for st in self.stages:
            d = asdict(st)
            d["layers"] = list(st.layers)
            d["modules"], d["recompute"], d["selective"] = list(st.modules), list(st.recompute), list(st.selective)
            out["stages"].append(d)
        out["exports"] = export_all(self)  # derived (omnibal.integrations writes the files); ignored on load
        return out

    def to_json(self) -> str:
        return json.dumps(_finite(self.to_dict()), indent=2, sort_keys=False) + "\n"

    def save(self, path: str | Path) -> Path:
        return write_text(path, self.to_json())

    @classmethod
    def from_json(cls, text: str, source: str = "plan.json") -> Plan:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"not valid JSON: {exc.msg}", source=source, record=f"line {exc.lineno}") from None
        except RecursionError:
            raise InputError("not valid JSON: nested too deeply", source=source) from None
        except ValueError as exc:  # e.g. an integer beyond Python's int-from-string digit limit
            raise InputError(f"not valid JSON: {exc}", source=source) from None
        return cls.from_dict(raw, source=source)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise InputError("no such file", source=str(path))
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, exc.start) + 1
            raise InputError(f"not UTF-8 text (byte {exc.start})", source=str(path), record=f"line {line}") from None
        return cls.from_json(text, source=str(path))

    @classmethod
    def from_dict(cls, raw: Any, source: str = "plan") -> Plan:
        r = _Reader(source)
        r.obj(raw, "")
        if raw.get("format") != PLAN_FORMAT:
            raise InputError(f"not an omnibal plan (format {raw.get('format')!r}, expected {PLAN_FORMAT!r})",
                             source=source, field="format")
        version = r.get(raw, "version", int, "")
        if version != PLAN_VERSION:
            raise InputError(f"plan format version {version} is not supported (this omnibal reads version "
                             f"{PLAN_VERSION})", source=source, field="version")
        inputs = _read_inputs(r, raw, source)
        data = DataPlan(**_read_fields(r, raw, "data", DataPlan, {"method": str, "settings": dict, "num_steps": int,
                                                                   "metrics": dict}))
        if data.settings.get("stack") == "omnibal":  # earlier versions' name of the reference trainer's stack
            data = replace(data, settings={**data.settings, "stack": "reference"})
        prediction = Prediction(**_read_fields(r, raw, "prediction", Prediction, {
            "step_time_s": float, "epoch_time_s": float, "gpu_days": float, "bubble": float, "num_steps": int,
            "oom": bool}))
        stages_raw = r.get(raw, "stages", list, "")
        _check_stage_count(stages_raw, inputs, source)
        stages = []
        expected_start = 0
        for s, st in enumerate(stages_raw):
            where = f"stages[{s}]"
            r.obj(st, where)
            layers = r.get(st, "layers", list, where)
            if len(layers) != 2 or not all(is_int(x) for x in layers):
                raise InputError("must be [start, stop] integers", source=source, record=where, field="layers")
            start, stop = layers
            if start != expected_start or stop <= start:
                raise InputError(f"layer range [{start}, {stop}) does not continue the previous stage (expected "
                                 f"to start at {expected_start} and be non-empty)", source=source, record=where,
                                 field="layers")
            expected_start = stop
            modules = tuple(r.str_list(st, "modules", where))
            if len(modules) != stop - start:
                raise InputError(f"{len(modules)} module names for {stop - start} layers", source=source,
                                 record=where, field="modules")
            recompute = tuple(r.str_list(st, "recompute", where))
            selective = tuple(r.str_list(st, "selective", where)) if "selective" in st else ()
            for field_name, names in (("recompute", recompute), ("selective", selective)):
                unknown = [m for m in names if m not in modules]
                if unknown:
                    raise InputError(f"{field_name} names modules not in this stage: {unknown}", source=source,
                                     record=where, field=field_name)
            both = sorted(set(recompute) & set(selective))
            if both:
                raise InputError(f"modules both recomputed whole and selectively: {both}", source=source,
                                 record=where, field="selective")
            if r.get(st, "stage", int, where) != s:
                raise InputError(f"stage index {st['stage']} at position {s}", source=source, record=where,
                                 field="stage")
            stages.append(PlanStage(
                stage=s, layers=(start, stop), modules=modules, recompute=recompute, selective=selective,
                in_flight=r.get(st, "in_flight", int, where),
                compute_time_s=r.get(st, "compute_time_s", float, where),
                boundary_time_s=r.get(st, "boundary_time_s", float, where),
                recompute_time_s=r.get(st, "recompute_time_s", float, where),
                memory_bytes=r.get(st, "memory_bytes", float, where),
                simulated_peak_memory_bytes=r.get(st, "simulated_peak_memory_bytes", (float, None), where,
                                                  default=None)))
        search = r.get(raw, "search", dict, "", default={})
        if "schedule" in search and "pp_schedule" not in search:  # the key earlier versions wrote
            search = {("pp_schedule" if k == "schedule" else k): v for k, v in search.items()}
        engine = r.get(raw, "engine", str, "", default="reference")
        if engine == "omnibal":  # what earlier versions wrote for the reference trainer's engine
            engine = "reference"
        check_choice(engine, Engine, source=source, field="engine")
        plan = cls(inputs=inputs, data=data, stages=tuple(stages), prediction=prediction, search=search,
                   version=version, engine=engine)
        _check_values(plan, source)
        _refuse_unknown_keys(raw, source)
        return plan


def _check_stage_count(stages_raw: list, inputs: PlanInputs, source: str) -> None:
    """One stage per pipeline stage (per virtual stage: ``pp_size x num_chunks``), at least one."""
    if inputs.num_chunks < 1:
        raise InputError(f"must be >= 1, got {inputs.num_chunks}", source=source, field="inputs.num_chunks")
    if not stages_raw:
        raise InputError("a plan needs at least one stage", source=source, field="stages")
    if len(stages_raw) != inputs.layout.pp_size * inputs.num_chunks:
        chunks = f" x {inputs.num_chunks} chunks" if inputs.num_chunks > 1 else ""
        raise InputError(f"{len(stages_raw)} stages but pp_size is {inputs.layout.pp_size}{chunks}", source=source,
                         field="stages")


def _refuse_unknown_keys(raw: dict, source: str) -> None:
    """An InputError naming the first key a plan file has that the plan format does not (a misspelt
    ``recompute`` would otherwise silently mean no recompute, in the trainer, simulate and report alike)."""
    top = {"format", "version", "model", "engine", "inputs", "data", "stages", "prediction", "search", "exports"}
    sections = [("", raw, top)]
    sections.append(("inputs", raw["inputs"], PlanInputs.file_keys()))
    for key, cls in (("data", DataPlan), ("prediction", Prediction)):
        sections.append((key, raw[key], {f.name for f in fields(cls)}))
    stage_keys = {f.name for f in fields(PlanStage)}
    sections += [(f"stages[{s}]", st, stage_keys) for s, st in enumerate(raw["stages"])]
    for where, section, known in sections:
        unknown = sorted(set(section) - known)
        if unknown:
            name = f"{where}.{unknown[0]}" if where else unknown[0]
            raise InputError(f"unknown key {unknown[0]!r} (the plan format has {', '.join(sorted(known))})",
                             source=source, record=where or None, field=name)


def _check_values(plan: Plan, source: str) -> None:
    """Refuse values no run can have (JSON types alone let ``-2`` DP ranks or a ``NaN`` step time through)."""
    def need(ok: bool, message: str, field: str, record: str | None = None) -> None:
        if not ok:
            raise InputError(message, source=source, record=record, field=field)

    def finite(v: float) -> bool:
        return math.isfinite(v) and v >= 0

    i = plan.inputs
    need(i.num_samples >= 1, f"must be >= 1, got {i.num_samples}", "inputs.num_samples")
    need(i.memory_budget_bytes is None or (math.isfinite(i.memory_budget_bytes) and i.memory_budget_bytes > 0),
         f"must be a positive number of bytes or null, got {i.memory_budget_bytes}", "inputs.memory_budget_bytes")
    need(plan.data.num_steps >= 0, f"must be >= 0, got {plan.data.num_steps}", "data.num_steps")
    for st in plan.stages:
        where = f"stages[{st.stage}]"
        need(st.in_flight >= 1, f"must be >= 1, got {st.in_flight}", "in_flight", where)
        for name in ("compute_time_s", "boundary_time_s", "recompute_time_s", "memory_bytes"):
            need(finite(getattr(st, name)), f"must be finite and >= 0, got {getattr(st, name)}", name, where)
        peak = st.simulated_peak_memory_bytes
        need(peak is None or finite(peak), f"must be finite and >= 0 or null, got {peak}",
             "simulated_peak_memory_bytes", where)
    p = plan.prediction
    for name in ("step_time_s", "epoch_time_s", "gpu_days", "bubble"):
        need(finite(getattr(p, name)), f"must be finite and >= 0, got {getattr(p, name)}", f"prediction.{name}")
    need(p.num_steps >= 0, f"must be >= 0, got {p.num_steps}", "prediction.num_steps")


def plan_stages(names, stage_plans, simulated_peak_memory=None) -> tuple[PlanStage, ...]:
    """``PlanStage`` records from a :class:`omnibal.plan.joint.StagePlanSet` and the layer chain's names."""
    out = []
    for st in stage_plans.stages:
        peak = None if simulated_peak_memory is None else float(simulated_peak_memory[st.stage])
        out.append(PlanStage(
            stage=st.stage, layers=(st.start, st.stop), modules=tuple(names[st.start:st.stop]),
            recompute=tuple(names[i] for i in st.checkpointed), selective=tuple(names[i] for i in st.selective),
            in_flight=st.in_flight,
            compute_time_s=st.compute_time, boundary_time_s=st.boundary_time, recompute_time_s=st.recompute_time,
            memory_bytes=st.memory_bytes, simulated_peak_memory_bytes=peak))
    return tuple(out)


def measured_plan(*, model: str, layer_names, parts, stage_times_s, num_samples: int, recompute=None,
                  num_microbatches: int = 1, dp_size: int = 1, source: str = "measured layer times") -> Plan:
    """A :class:`Plan` for a partition chosen outside ``omnibal plan`` (e.g. the min-max cut of this machine's
    measured per-layer times): what the trainer reads with :meth:`Plan.load`, with the stage times given and
    no memory or step-time prediction (zeros)."""
    parts = [int(x) for x in parts]
    pp = len(parts) - 1
    recompute = recompute or [[] for _ in range(pp)]
    names = list(layer_names)
    inputs = PlanInputs(model=model, model_spec={}, hardware="measured",
                        layout=Layout(dp_size=dp_size, pp_size=pp, zero_stage=0, num_microbatches=num_microbatches),
                        memory_budget_bytes=None, stats_source=source, stats_fingerprint="",
                        num_samples=num_samples)
    stages = tuple(PlanStage(stage=s, layers=(a, b), modules=tuple(names[a:b]), recompute=tuple(recompute[s]),
                             in_flight=min(pp - s, num_microbatches), compute_time_s=float(t), boundary_time_s=0.0,
                             recompute_time_s=0.0, memory_bytes=0.0)
                   for s, ((a, b), t) in enumerate(zip(zip(parts[:-1], parts[1:]), stage_times_s)))
    return Plan(inputs=inputs, data=DataPlan(method="omnibal", settings={}, num_steps=0), stages=stages,
                prediction=Prediction(step_time_s=0.0, epoch_time_s=0.0, gpu_days=0.0, bubble=0.0, num_steps=0))


def _finite(obj):
    """JSON has no inf/nan: write them as null (loading then reports the field if it is required)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


_MISSING = object()


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source

    def obj(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise InputError(f"must be a JSON object, got {type(value).__name__}", source=self.source,
                             record=where or None, field=where or None)

    def get(self, d: dict, key: str, kind, where: str, default=_MISSING):
        name = f"{where}.{key}" if where else key
        if key not in d:
            if default is not _MISSING:
                return default
            raise InputError("missing", source=self.source, field=name)
        value = d[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        for k in kinds:
            if k is None and value is None:
                return None
            if k is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if k is int and is_int(value):
                return value
            if k not in (None, float, int) and isinstance(value, k):
                return value
        names = " or ".join("null" if k is None else k.__name__ for k in kinds)
        raise InputError(f"must be {names}, got {value!r:.60}", source=self.source, field=name)

    def str_list(self, d: dict, key: str, where: str) -> list[str]:
        values = self.get(d, key, list, where)
        bad = [v for v in values if not isinstance(v, str)]
        if bad:
            raise InputError(f"must be a list of strings, found {bad[0]!r}", source=self.source,
                             field=f"{where}.{key}")
        return values


def _read_inputs(r: _Reader, raw: dict, source: str) -> PlanInputs:
    """The ``inputs`` section, its flat layout checked (errors name the file's field) and nested."""
    rest = _read_fields(r, raw, "inputs", PlanInputs, {
        "model": str, "model_spec": dict, "hardware": str, "memory_budget_bytes": (float, None),
        "stats_source": str, "stats_fingerprint": str, "num_samples": int, "profile": (str, None),
        "omnibal_version": str, "stats_convention": str, "memory_headroom": (float, None), "num_chunks": int})
    section = r.get(raw, "inputs", dict, "")
    names = [f.name for f in fields(Layout)]
    flat = {name: r.get(section, name, int, "inputs") for name in ("num_gpus", *names)}
    if flat["num_gpus"] != flat["dp_size"] * flat["pp_size"] * flat["tp_size"]:
        raise InputError(f"num_gpus {flat['num_gpus']} != dp_size * pp_size * tp_size "
                         f"({flat['dp_size']} * {flat['pp_size']} * {flat['tp_size']})", source=source,
                         field="inputs.num_gpus")
    check_layout_fields(flat, source=source, field_prefix="inputs.")
    return PlanInputs(layout=Layout(**{name: flat[name] for name in names}), **rest)


def _read_fields(r: _Reader, raw: dict, key: str, cls, schema: dict) -> dict:
    """The values of section ``key`` for ``cls``'s fields in ``schema`` (a field with a default may be absent)."""
    section = r.get(raw, key, dict, "")
    values = {}
    for name, kind in schema.items():
        has_default = cls.__dataclass_fields__[name].default is not _dataclass_missing() or \
            cls.__dataclass_fields__[name].default_factory is not _dataclass_missing()
        if has_default and name not in section:
            continue
        values[name] = r.get(section, name, kind, key)
    return values


def _dataclass_missing():
    return dataclasses.MISSING
