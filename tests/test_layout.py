"""omnibal.layout: one Layout validated once, and one vocabulary per choice."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.jobs.balance import BalanceJobConfig
from omnibal.jobs.plan_config import PLAN_LAYOUT, PlanJobConfig
from omnibal.jobs.simulate import SimulateJobConfig
from omnibal.layout import BalanceMethod, Layout, PartialLayout, PipelineSchedule, check_layout_fields
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
    for cls in (PlanJobConfig, TrainConfig, PlanInputs, BalanceJobConfig, SimulateJobConfig):
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


def test_a_partial_layout_has_the_layouts_fields_each_unset_until_given():
    assert [f.name for f in dataclasses.fields(PartialLayout)] == [f.name for f in dataclasses.fields(Layout)]
    assert PartialLayout().given() == {} and PartialLayout().resolve(PLAN_LAYOUT) == PLAN_LAYOUT
    partial = PartialLayout(pp_size=2, zero_stage=0)
    assert partial.given() == {"pp_size": 2, "zero_stage": 0}  # 0 is a value, not unset
    assert partial.resolve(PLAN_LAYOUT) == dataclasses.replace(PLAN_LAYOUT, pp_size=2, zero_stage=0)
    with pytest.raises(InputError, match="tp_size"):
        PartialLayout(tp_size=0).resolve(PLAN_LAYOUT)  # the layout it resolves to is validated
    with pytest.raises(TypeError):
        SimulateJobConfig(dp_size=2)  # the flat keyword is gone


def test_check_layout_fields_names_the_source_and_field():
    with pytest.raises(InputError, match=r"--pp: field 'pp_size'"):
        check_layout_fields({"pp_size": 0}, source="--pp")
    with pytest.raises(InputError, match=r"plan.json: field 'inputs.zero_stage'"):
        check_layout_fields({"zero_stage": 4}, source="plan.json", field_prefix="inputs.")


def test_the_libraries_lists_are_the_vocabularies():
    """The libraries validate against the StrEnums themselves (no tuple copies), and name the words."""
    import omnibal.data.balance as balance_pkg
    import omnibal.sim as sim_pkg
    from omnibal.data.balance.api import BalanceConfig
    from omnibal.plan.engines import get_engine
    from omnibal.sim.costs import SimConfig

    for module, names in ((balance_pkg, ("METHODS", "OVERSIZE_POLICIES", "PADDINGS")), (sim_pkg, ("SCHEDULES",))):
        assert not any(hasattr(module, name) for name in names)
    with pytest.raises(InputError, match="choose one of omnibal, isf, isf\\+assign, random, length-grouped"):
        BalanceConfig(method="nope")
    with pytest.raises(InputError, match="choose one of error, own_pack, drop"):
        BalanceConfig(oversize="nope")
    with pytest.raises(InputError, match="choose one of reference, deepspeed, megatron, torchtitan"):
        get_engine("nope")
    with pytest.raises(InputError, match="choose one of 1f1b, gpipe, interleaved"):
        SimConfig(pp_schedule="nope").validate()
    assert BalanceMethod.ISF_ASSIGN == "isf+assign" and f"{PipelineSchedule.ONE_F_ONE_B}" == "1f1b"
