"""Fuzzing the plan loader (``Plan.from_json`` / ``Plan.load``) with corrupted, truncated, non-UTF-8, deeply
nested and semantically impossible plans.

The promise (docs/guarantees.md, "Bad input"): loading either gives a :class:`Plan` that a trainer can run
(sizes >= 1, stages tiling the layer chain, finite non-negative times and bytes, the same plan again after
``to_json``), or raises :class:`~omnibal.errors.InputError` naming the file. Never another exception type,
never an impossible plan accepted silently.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.layout import Layout
from omnibal.plan.joint import JointPlanner
from omnibal.plan.plan import DataPlan, Plan, PlanInputs, Prediction, plan_stages
from omnibal.plan.stages import StageModelConfig, layer_quantities
from plan_helpers import uniform_features, vlm_like_table

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SOURCE = "fuzzed-plan.json"
NAMES = (["vision.embed"] + [f"vision.blocks.{i}" for i in range(6)] + ["projector", "llm.embed"]
         + [f"llm.blocks.{i}" for i in range(8)] + ["llm.head"])


def _plan(num_stages: int = 3) -> Plan:
    cfg = StageModelConfig(num_stages=num_stages, num_microbatches=6, dp_size=2)
    q = layer_quantities(vlm_like_table(), uniform_features(), cfg)
    lo = JointPlanner(q, cfg).min_memory_partition().bottleneck
    cfg = StageModelConfig(num_stages=num_stages, num_microbatches=6, dp_size=2, memory_budget_bytes=lo * 1.1)
    sp = JointPlanner(q, cfg).plan()
    inputs = PlanInputs(model="tiny-vlm", model_spec={"name": "tiny-vlm"}, hardware="a100-80g",
                        layout=Layout(dp_size=2, pp_size=num_stages, num_microbatches=6),
                        memory_budget_bytes=cfg.memory_budget_bytes,
                        stats_source="synthetic(seed=0)", stats_fingerprint="abc", num_samples=100)
    return Plan(inputs=inputs, data=DataPlan(method="omnibal", settings={"max_tiles": 9}, num_steps=10),
                stages=plan_stages(NAMES, sp),
                prediction=Prediction(step_time_s=1.5, epoch_time_s=15.0, gpu_days=0.001, bubble=0.2, num_steps=10))


GOOD = _plan()
GOOD_TEXT = GOOD.to_json()
GOOD_RAW = json.loads(GOOD_TEXT)


def check_runnable(plan: Plan) -> None:
    """What a trainer relies on in a loaded plan."""
    i = plan.inputs
    for name in ("dp_size", "pp_size", "tp_size", "num_microbatches", "num_gpus"):
        assert getattr(i.layout, name) >= 1, f"inputs.{name} = {getattr(i.layout, name)} accepted"
    assert i.num_samples >= 1, i.num_samples
    assert i.layout.zero_stage in (0, 1, 2), i.layout.zero_stage
    assert i.memory_budget_bytes is None or (math.isfinite(i.memory_budget_bytes) and i.memory_budget_bytes > 0)
    assert plan.data.num_steps >= 0
    assert plan.stages[0].layers[0] == 0
    for stage in plan.stages:
        assert stage.in_flight >= 1, f"stage {stage.stage}: in_flight {stage.in_flight} accepted"
        for name in ("compute_time_s", "boundary_time_s", "recompute_time_s", "memory_bytes"):
            v = getattr(stage, name)
            assert math.isfinite(v) and v >= 0, f"stage {stage.stage}: {name} = {v} accepted"
    p = plan.prediction
    for name in ("step_time_s", "epoch_time_s", "gpu_days", "bubble"):
        v = getattr(p, name)
        assert math.isfinite(v) and v >= 0, f"prediction.{name} = {v} accepted"


def checked_load_text(text: str) -> Plan | None:
    try:
        plan = Plan.from_json(text, source=SOURCE)
    except InputError as exc:
        assert SOURCE in str(exc), f"the error does not name the file: {exc}"
        return None
    check_runnable(plan)
    assert Plan.from_json(plan.to_json(), source=SOURCE) == plan  # what loads, saves and loads the same
    return plan


def checked_load_file(tmp_path, data: bytes) -> Plan | None:
    path = tmp_path / "plan.json"
    path.write_bytes(data)
    try:
        plan = Plan.load(path)
    except InputError as exc:
        assert str(path) in str(exc), f"the error does not name the file: {exc}"
        return None
    check_runnable(plan)
    return plan


def test_the_good_plan_loads():
    assert checked_load_text(GOOD_TEXT) == GOOD


# ------------------------------------------------------------------------------------------ bytes
@FUZZ
@given(cut=st.integers(0, len(GOOD_TEXT.rstrip().encode()) - 1))
def test_truncated_plan_is_refused(tmp_path, cut):
    assert checked_load_file(tmp_path, GOOD_TEXT.encode()[:cut]) is None


@FUZZ
@given(at=st.integers(0, len(GOOD_TEXT.encode()) - 1),
       junk=(st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"])
             | st.binary(min_size=1, max_size=4)))
@example(at=0, junk=b"\xef\xbb\xbf")  # a BOM
def test_bytes_inserted_anywhere(tmp_path, at, junk):
    data = GOOD_TEXT.encode()
    checked_load_file(tmp_path, data[:at] + junk + data[at:])


@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,
    '{"a": ' * 50_000 + "1" + "}" * 50_000,
    GOOD_TEXT.replace('"num_steps": 10', '"num_steps": ' + "9" * 5000, 1),  # beyond int() digit limit
    GOOD_TEXT.replace('"step_time_s": 1.5', '"step_time_s": 1e999'),
    GOOD_TEXT.replace('"step_time_s": 1.5', '"step_time_s": NaN'),
    GOOD_TEXT.replace('"step_time_s": 1.5', '"step_time_s": -Infinity'),
    "", "null", "[]", '"plan"', "1e999",
], ids=["deep-list", "deep-object", "huge-int", "overflow-float", "nan", "neg-inf", "empty", "null", "list",
        "string", "float"])
def test_adversarial_documents(text):
    assert checked_load_text(text) is None


def test_non_utf8_file_is_an_input_error(tmp_path):
    data = GOOD_TEXT.encode()
    assert checked_load_file(tmp_path, data[:40] + b"\xff" + data[40:]) is None
    assert checked_load_file(tmp_path, GOOD_TEXT.encode("utf-16")) is None


# ------------------------------------------------------------------------------------ structure
def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            if prefix == () and k == "exports":  # derived, ignored on load
                continue
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


PATHS = [p for p in _paths(GOOD_RAW) if p]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6) | st.sampled_from([0, -1, 1, 2, 3, 17, 18, 19, 0.0, -0.5, 1e308]),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3), max_leaves=6)


def _edit(raw, path, op, value):
    raw = json.loads(json.dumps(raw))
    parent = raw
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    if op == "delete":
        del parent[key]
    elif op == "replace":
        parent[key] = value
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, parent[key])
    return raw


@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(PATHS), st.sampled_from(["replace", "delete", "duplicate"]),
                                json_values), min_size=1, max_size=3))
def test_structural_edits(edits):
    raw = GOOD_RAW
    for path, op, value in edits:
        try:
            raw = _edit(raw, path, op, value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or retyped this path
    checked_load_text(json.dumps(raw, allow_nan=True))


@pytest.mark.parametrize("path,value", [
    (("inputs", "dp_size"), -2), (("inputs", "pp_size"), 0), (("inputs", "num_microbatches"), 0),
    (("inputs", "zero_stage"), 7), (("inputs", "memory_budget_bytes"), -1.0), (("inputs", "num_samples"), -5),
    (("stages", 0, "in_flight"), 0), (("stages", 1, "compute_time_s"), -1.0),
    (("stages", 2, "memory_bytes"), -3.0), (("prediction", "bubble"), -0.5),
    (("stages", 0, "layers"), [-1, 5]),
])
def test_impossible_values_are_refused(path, value):
    raw = GOOD_RAW
    if path[0] == "inputs" and path[1] in ("dp_size", "pp_size"):  # keep num_gpus consistent to reach the check
        raw = _edit(raw, ("inputs", "num_gpus"), "replace",
                    (value if path[1] == "dp_size" else 2) * (value if path[1] == "pp_size" else 3))
    assert checked_load_text(json.dumps(_edit(raw, path, "replace", value))) is None
