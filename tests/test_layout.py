"""omnibal.layout: one Layout validated once, and one vocabulary per choice."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.jobs.plan_config import PLAN_LAYOUT, PlanJobConfig
from omnibal.layout import BalanceMethod, Engine, Layout, OversizePolicy, Padding, PipelineSchedule, check_layout_fields
from omnibal.plan.plan import PlanInputs
from omnibal.train.config import TRAIN_LAYOUT, TrainConfig


@given(dp=st.integers(-2, 64), pp=st.integers(-2, 16), tp=st.integers(-2, 8), zero=st.integers(-1, 4),
       mb=st.integers(-2, 32))
def test_layout_accepts_exactly_positive_sizes_and_zero_0_to_3(dp, pp, tp, zero, mb):
    ok = min(dp, pp, tp, mb) >= 1 and zero in (0, 1, 2, 3)
    if ok:
        layout = Layout(dp_size=dp, pp_size=pp, tp_size=tp, zero_stage=zero, num_microbatches=mb)
        assert layout.num_gpus == dp * pp * tp
    else:
        with pytest.raises(InputError):
            Layout(dp_size=dp, pp_size=pp, tp_size=tp, zero_stage=zero, num_microbatches=mb)


def test_layout_refuses_bools_and_floats():
    for bad in (True, 2.0, "2"):
        with pytest.raises(InputError, match="dp_size"):
            Layout(dp_size=bad)


def test_for_devices_fills_dp_or_refuses_a_product_that_is_not_the_device_count():
    assert Layout.for_devices(128, pp_size=4).dp_size == 32
    with pytest.raises(InputError, match="not a multiple of 4"):
        Layout.for_devices(10, pp_size=4)
    with pytest.raises(InputError, match="--gpus"):
        Layout.for_devices(16, dp_size=2, pp_size=4)
    with pytest.raises(InputError, match="--gpus"):
        Layout.for_devices(0)


def test_configs_hold_one_layout_and_no_flat_copy_of_it():
    names = {f.name for f in dataclasses.fields(Layout)}
    for cls in (PlanJobConfig, TrainConfig, PlanInputs):
        own = {f.name for f in dataclasses.fields(cls)}
        assert "layout" in own and not own & names and not any(hasattr(cls, n) for n in names), cls
    with pytest.raises(TypeError):
        TrainConfig(dp_size=2)  # the flat keyword is gone
    assert PlanJobConfig().layout == PLAN_LAYOUT and PLAN_LAYOUT.num_gpus == 128  # the README's job
    assert TrainConfig().layout == TRAIN_LAYOUT and TRAIN_LAYOUT.zero_stage == 0
    train = TrainConfig(layout=dataclasses.replace(TRAIN_LAYOUT, dp_size=2, pp_size=2))
    assert train.world_size == 4 and train.layout.num_microbatches == 4
    with pytest.raises(InputError, match="dp_size"):
        dataclasses.replace(TRAIN_LAYOUT, dp_size=0)
    with pytest.raises(InputError, match="tensor parallelism"):
        TrainConfig(layout=dataclasses.replace(TRAIN_LAYOUT, tp_size=2))
    assert {"dp_size", "pp_size", "num_microbatches", "mode"} <= set(train.to_dict())  # the summary stays flat


def test_check_layout_fields_names_the_source_and_field():
    with pytest.raises(InputError, match=r"--pp: field 'pp_size'"):
        check_layout_fields({"pp_size": 0}, source="--pp")
    with pytest.raises(InputError, match=r"plan.json: field 'inputs.zero_stage'"):
        check_layout_fields({"zero_stage": 4}, source="plan.json", field_prefix="inputs.")


def test_the_libraries_lists_are_the_vocabularies():
    from omnibal.data.balance.api import METHODS, OVERSIZE_POLICIES
    from omnibal.data.balance.schedule import PADDINGS
    from omnibal.plan.engines import ENGINES
    from omnibal.sim.schedule import SCHEDULES

    assert METHODS == tuple(BalanceMethod) and OVERSIZE_POLICIES == tuple(OversizePolicy)
    assert PADDINGS == tuple(Padding) and ENGINES == tuple(Engine) and SCHEDULES == tuple(PipelineSchedule)
    assert BalanceMethod.ISF_ASSIGN == "isf+assign" and f"{PipelineSchedule.ONE_F_ONE_B}" == "1f1b"
