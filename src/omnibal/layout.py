"""The cluster layout of a job and the words omnibal's options take, each declared once.

:class:`Layout` is how a job is laid out over devices (DP x PP x TP, the ZeRO stage, micro-batches per
step); the job configs (``PlanJobConfig``, ``TrainConfig``) and a plan's ``PlanInputs`` hold one (read
``config.layout.dp_size``). The planner's and simulator's inner configs (``SimConfig``, ``StageModelConfig``)
keep the few layout values they use flat beside the partition and features that give the rest, and validate
them with :func:`check_layout_fields`, so every layout value is checked by the same code with the same message.

The ``StrEnum`` vocabularies are the one list of each choice: configs validate against them and the CLI
offers them as ``choices``. A member equals its string (``BalanceMethod.OMNIBAL == "omnibal"``), so configs
and JSON keep plain strings.

Each :class:`Layout` field's command-line spelling (flag, help) is declared beside it in
:data:`LAYOUT_FLAGS`: ``omnibal.cli.options`` builds every subcommand's layout options from it.

This module sits at the bottom of the layer order (beside ``errors``): it imports nothing of omnibal else.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields, make_dataclass, replace
from enum import StrEnum

from omnibal.errors import InputError
from omnibal.validate import is_int


class BalanceMethod(StrEnum):
    """How samples are packed into micro-batches (``omnibal.data.balance``)."""

    OMNIBAL = "omnibal"
    ISF = "isf"
    ISF_ASSIGN = "isf+assign"
    RANDOM = "random"
    LENGTH_GROUPED = "length-grouped"


class PipelineSchedule(StrEnum):
    """Order in which pipeline stages run micro-batches' forward and backward passes."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED = "interleaved"
    """Megatron's interleaved 1F1B (several model chunks per device): simulated, chosen by the planner
    (``omnibal plan --chunks``), never asked for with ``--pp-schedule``."""


PLANNER_PP_SCHEDULES = (PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.GPIPE)
"""Schedules ``--pp-schedule`` asks the planner and the reference trainer for (one layer range per stage; an
interleaved plan's chunks come from ``omnibal plan --chunks`` and its plan file)."""


class Engine(StrEnum):
    """Training engine a plan is made for (``omnibal.plan.engines``)."""

    REFERENCE = "reference"
    """omnibal's own reference trainer (``omnibal train``): no engine constraint."""
    DEEPSPEED = "deepspeed"
    MEGATRON = "megatron"
    TORCHTITAN = "torchtitan"


class Padding(StrEnum):
    """How a micro-batch's samples run (``omnibal.data.balance.schedule``)."""

    VARLEN = "varlen"
    PAD_TO_LONGEST = "pad_to_longest"
    FIXED_BUFFER = "fixed_buffer"


PLAN_PADDINGS = (Padding.VARLEN, Padding.FIXED_BUFFER)
"""How a plan's balanced packs may run (``pad_to_longest`` is the baseline's)."""
BASELINE_PADDINGS = (Padding.PAD_TO_LONGEST, Padding.VARLEN)
"""How the ablation baseline's fixed micro-batches run: padded to their longest sample (InternVL-Chat's
collator) or variable-length (a trainer that already packs its fixed-size micro-batches)."""


class OversizePolicy(StrEnum):
    """What the balancer does with a sample over a fixed cap."""

    ERROR = "error"
    OWN_PACK = "own_pack"
    DROP = "drop"


class TrainMode(StrEnum):
    """How the reference trainer forms micro-batches (``omnibal.train.config``)."""

    BASELINE = "baseline"
    OFFLINE = "offline"
    """Micro-batches balanced before training (the balancer's schedule), against ``online``'s per-step
    post-balancing."""
    ONLINE = "online"


class DpSync(StrEnum):
    """How the reference trainer sums gradients over DP."""

    FLAT = "flat"
    DDP = "ddp"


class Device(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


class Precision(StrEnum):
    """How the reference trainer computes (``omnibal.train.config``)."""

    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"
    """fp32 weights, gradients and optimizer state; forward (and so backward) under ``torch.autocast`` in bf16."""


class Dtype(StrEnum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class BaselinePartition(StrEnum):
    """The ablation baseline's layer split."""

    EVEN = "even"
    VISION_FIRST = "vision-first"


class BaselineSampler(StrEnum):
    """The ablation baseline's sampler (fixed micro-batches of ``--batch-size`` samples, padded)."""

    LENGTH_GROUPED = "length-grouped"
    RANDOM = "random"


class OnError(StrEnum):
    """What a reader does with a bad input record."""

    RAISE = "raise"
    SKIP = "skip"


ZERO_STAGES = (0, 1, 2, 3)


def _cli(flag: str, help: str) -> dict:
    return {"flag": flag, "help": help}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one job is laid out over devices. Validated on construction (:func:`check_layout_fields`)."""

    dp_size: int = 1
    """Data-parallel size: replicas that see different data."""
    pp_size: int = 1
    """Pipeline-parallel size: stages the layer chain is cut into."""
    tp_size: int = 1
    """Tensor-parallel size: devices each layer is split over."""
    zero_stage: int = 1
    """ZeRO stage over DP: 0 nothing sharded, 1 optimizer state, 2 optimizer state and gradients."""
    num_microbatches: int = 1
    """Micro-batches per step on each DP rank."""

    def __post_init__(self) -> None:
        check_layout_fields(self.to_dict(), source="layout")

    @property
    def num_gpus(self) -> int:
        """Devices the layout occupies: DP x PP x TP."""
        return self.dp_size * self.pp_size * self.tp_size

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def describe(self) -> str:
        return (f"DP {self.dp_size} x PP {self.pp_size} x TP {self.tp_size}, ZeRO-{self.zero_stage}, "
                f"{self.num_microbatches} micro-batches per step")

    @classmethod
    def for_devices(cls, num_gpus: int, *, dp_size: int | None = None, **rest) -> Layout:
        """The layout of ``num_gpus`` devices; ``dp_size`` None: what is left after PP x TP. Refuses a
        product that is not ``num_gpus`` (flags named as the CLI spells them)."""
        check_layout_fields({"num_gpus": num_gpus}, source="--gpus")
        layout = cls(dp_size=1 if dp_size is None else dp_size, **rest)
        if dp_size is None:
            per_replica = layout.pp_size * layout.tp_size
            if num_gpus % per_replica:
                raise InputError(f"{num_gpus} devices do not split into PP {layout.pp_size} x TP {layout.tp_size} "
                                 f"x DP: {num_gpus} is not a multiple of {per_replica}", source="--gpus",
                                 field="num_gpus")
            layout = replace(layout, dp_size=num_gpus // per_replica)
        layout.check_devices(num_gpus)
        return layout

    def check_devices(self, num_gpus: int | None) -> None:
        """Refuse a device count (None: any) other than DP x PP x TP."""
        if num_gpus is not None and num_gpus != self.num_gpus:
            raise InputError(f"DP x PP x TP = {self.dp_size} x {self.pp_size} x {self.tp_size} = {self.num_gpus} "
                             f"does not match the {num_gpus} devices of the job; choose sizes whose product is "
                             f"{num_gpus}", source="--gpus", field="num_gpus")


def _given(self) -> dict:
    """{field: value} of the fields this partial layout sets (not None)."""
    return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _resolve(self, base: Layout) -> Layout:
    """``base`` with the fields this partial layout sets."""
    return replace(base, **self.given())


PartialLayout = make_dataclass(
    "PartialLayout",
    [(f.name, typing.get_type_hints(Layout)[f.name] | None, field(default=None)) for f in fields(Layout)],
    frozen=True, kw_only=True, namespace={"given": _given, "resolve": _resolve, "__module__": __name__, "__doc__": (
        "Some of a :class:`Layout`'s fields, the rest unset (None): what a job is told before it knows the "
        "layout it completes (``omnibal simulate``'s, from a plan). Its fields are :class:`Layout`'s, each "
        "optional; ``resolve(base)`` fills the unset ones from ``base``.")})
"""Some of a :class:`Layout`'s fields (made from them, so a new layout field is one here too)."""


# How each layout field is spelled on the command line: the CLI's layout options are built from this.
LAYOUT_FLAGS = {
    "dp_size": _cli("--dp", "data-parallel size"),
    "pp_size": _cli("--pp", "pipeline stages"),
    "tp_size": _cli("--tp", "tensor-parallel size"),
    "zero_stage": _cli("--zero-stage", "ZeRO stage over DP (0: nothing sharded, 1: optimizer state, 2: and "
                       "gradients, 3: and weights, gathered layer by layer)"),
    "num_microbatches": _cli("--microbatches", "micro-batches per DP rank per step"),
}

_POSITIVE = ("dp_size", "pp_size", "tp_size", "num_microbatches", "num_gpus", "num_stages")


def check_layout_fields(values: dict, *, source: str | None = None, field_prefix: str = "") -> None:
    """Validate whichever layout values ``values`` holds (``dp_size``, ``pp_size``, ``tp_size``,
    ``num_microbatches``, ``num_gpus``, ``num_stages``: positive integers; ``zero_stage``: 0, 1, 2 or 3).
    ``source``: what the error names (None: the field itself); ``field_prefix``: put before the field name
    (``"inputs."`` for a plan file's)."""
    for name, value in values.items():
        where = {"source": source or name, "field": field_prefix + name}
        if name in _POSITIVE:
            if not is_int(value) or value < 1:
                raise InputError(f"must be a positive integer, got {value!r}", **where)
        elif name == "zero_stage":
            if not is_int(value) or value not in ZERO_STAGES:
                raise InputError(f"must be 0, 1, 2 or 3, got {value!r}", **where)


def check_choice(value, vocabulary, *, source: str, field: str, choices=None) -> None:
    """Refuse ``value`` unless it is one of ``choices`` (default: every member of ``vocabulary``)."""
    allowed = tuple(vocabulary) if choices is None else tuple(choices)
    if value not in allowed:
        raise InputError(f"unknown {field.replace('_', ' ')} {value!r}; choose one of "
                         f"{', '.join(str(c) for c in allowed)}", source=source, field=field)
