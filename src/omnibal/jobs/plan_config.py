"""What ``omnibal plan`` is asked: the model, the cluster, the data and the planner's settings
(:class:`PlanJobConfig`, checked by its ``validate``). :func:`omnibal.jobs.plan_job.run_plan_job` runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

from omnibal.cost.hardware import DEFAULT_MEMORY_HEADROOM, HardwareSpec
from omnibal.errors import InputError
from omnibal.layout import (
    BASELINE_PADDINGS,
    PLAN_PADDINGS,
    PLANNER_PP_SCHEDULES,
    BalanceMethod,
    BaselinePartition,
    BaselineSampler,
    Engine,
    Layout,
    OversizePolicy,
    Padding,
    PipelineSchedule,
    check_choice,
)
from omnibal.plan.packsize import PackSearchConfig
from omnibal.plan.search import SearchConfig
from omnibal.validate import is_int

PLAN_LAYOUT = Layout(dp_size=32, pp_size=4, tp_size=1, zero_stage=1, num_microbatches=8)
"""The README's main job: DP 32 x PP 4, ZeRO-1, 8 micro-batches (8 x 4 samples x DP 32 = global batch 1024)."""


def parse_balance_samples(text: str) -> int | None:
    """``--balance-samples``: a number of samples, or ``all`` (None)."""
    if str(text).lower() == "all":
        return None
    try:
        return int(text)
    except ValueError:
        raise InputError(f"must be a number of samples or 'all', got {text!r}", source="--balance-samples",
                         field="balance_samples") from None


def parse_chunks(text: str) -> tuple[int, ...]:
    """``--chunks``: comma-separated chunk counts, as :func:`omnibal.plan.interleaved.check_chunks` keeps them."""
    from omnibal.plan.interleaved import check_chunks

    try:
        return check_chunks(int(x) for x in text.split(","))
    except ValueError:
        raise InputError(f"must be comma-separated integers, got {text!r}", source="--chunks",
                         field="chunks") from None


def parse_pack_microbatches(text: str) -> PackSearchConfig:
    """``--pack-microbatches``: comma-separated micro-batch counts, or ``none`` (no pack-size search)."""
    if text.strip().lower() == "none":
        return PackSearchConfig(microbatches=())
    try:
        return PackSearchConfig(microbatches=tuple(int(x) for x in text.split(",")))
    except ValueError:
        raise InputError(f"must be comma-separated integers or 'none', got {text!r}", source="--pack-microbatches",
                         field="pack_microbatches") from None


@dataclass(frozen=True, kw_only=True)
class PlanJobConfig:
    """Everything ``omnibal plan`` needs. Defaults: the README's main job (see docs/plan.md for why)."""

    preset: str = field(default="internvl-chat-1.5", metadata={"option": "model"})
    """Model preset (``omnibal.cost.presets``)."""
    hf_model: str | None = None
    """Plan a local Hugging Face checkpoint (Llava / InternVL; only its ``config.json`` is read) instead of
    ``preset``: the plan then names the chain ``omnibal train --hf-model`` builds from that checkpoint."""
    hardware: str | HardwareSpec = field(default="a100-80g", metadata={"parse": str})
    """Hardware preset (``omnibal.cost.hardware``: a100-40g, a100-80g, h100, h200) or a :class:`HardwareSpec`
    (``--hardware cpu``: the CLI measures this machine with ``omnibal.measure.hardware.hardware_by_name`` and
    passes the spec)."""
    num_gpus: int | None = None
    """Devices in the job; None: dp_size * pp_size * tp_size. Must equal that product (``omnibal plan``: DP
    defaults to what the devices leave after PP x TP, and the devices to the default layout's 128)."""
    layout: Layout = PLAN_LAYOUT
    """DP x PP x TP, ZeRO stage and micro-batches per step per DP rank. Another layout:
    ``replace(PLAN_LAYOUT, pp_size=2)``."""
    baseline_batch_size: int = field(default=4, metadata={"option": "batch_size"})
    """Samples per micro-batch of the baseline (random, fixed size, padded to the longest sample)."""
    memory_budget_gib: float | None = field(default=None, metadata={"flag": "--memory-budget", "metavar": "GIB"})
    """Per-device budget in GiB; None: the device memory less ``memory_headroom``."""
    memory_headroom: float = field(default=DEFAULT_MEMORY_HEADROOM, metadata={"metavar": "SHARE_OR_GIB"})
    """What the budget leaves of the device memory for what the memory model does not count (allocator
    reserve, CUDA context, communication buffers): a share when below 1, else GiB
    (:func:`omnibal.cost.hardware.memory_budget`; docs/gpu.md has the measurement the default rests on).
    Ignored with ``memory_budget_gib``."""
    stats_path: str | None = field(default=None, metadata={"option": "stats"})
    """Per-sample stats file (``omnibal stats``); None: the synthetic InternVL-like mixture."""
    num_samples: int = field(default=1_200_000, metadata={"option": "samples"})
    """Size of the synthetic mixture."""
    balance_samples: int | None = field(default=200_000, metadata={"parse": parse_balance_samples, "metavar": "N"})
    """Balance a uniform random subset of this many samples and scale the epoch to the full dataset
    (None, on the command line ``all``: balance every sample). A subset this size predicts the default job's
    epoch close to balancing every sample, at a fraction of the CPU time (benchmarks/results:
    bench_plan_default)."""
    seed: int = 0
    """Seed of the synthetic data, the shuffles and the step sample of the search."""
    profile_path: str | None = field(default=None, metadata={"option": "profile"})
    """Measured profile to use instead of the analytic cost model."""
    balance_method: BalanceMethod = "omnibal"
    """Balancer of the planned job."""
    max_tiles: int | None = field(default=None, metadata={"metavar": "N"})
    """Fixed Q_v of the planned job's packs (None: the balancer's cap search). Fixed caps set the pack, so
    they turn the pack-size search off."""
    max_tokens: int | None = None
    """Fixed Q_t of the planned job's packs (None: the balancer's cap search)."""
    oversize: OversizePolicy = "error"
    """Samples over a fixed cap: ``error``, ``own_pack`` or ``drop`` (``BalanceConfig.oversize``); with ``--hbp``,
    samples no level holds: ``error`` or ``drop``."""
    padding: Padding = field(default="varlen", metadata={"choices": PLAN_PADDINGS})
    """How balanced packs run: ``varlen`` (variable-length micro-batches, Megatron's variable_seq_lengths)
    or ``fixed_buffer`` (padded to the caps: static shapes, e.g. torch.distributed.pipelining)."""
    baseline_sampler: BaselineSampler = "length-grouped"
    """The baseline's sampler: ``length-grouped`` (InternVL-Chat's ``--group_by_length``, on in its official
    InternVL-1.5 fine-tuning scripts: one mega-batch per step sorted by length and split into micro-batches of
    balanced total length, ``omnibal.data.balance.baselines``) or ``random`` (a plain shuffle)."""
    baseline_padding: Padding = field(default="pad_to_longest", metadata={"choices": BASELINE_PADDINGS})
    """How the baseline's micro-batches run: ``pad_to_longest`` (InternVL-Chat's collator pads every sample
    to the micro-batch's longest) or ``varlen`` (a trainer that concatenates them with variable-length
    attention, so the baseline keeps only its imbalance, not its padding)."""
    baseline_partition: BaselinePartition = "vision-first"
    """The baseline's layer split: ``vision-first`` (the vision encoder and projector on stage 0, LLM layers
    split evenly over the rest, as Megatron-core's LLaVA and torchtitan do; the paper's baseline most
    likely, docs/plan.md) or ``even`` (equal layer counts)."""
    stack: str = "megatron-deepspeed"
    """Software stack whose weight/gradient/optimizer bytes the memory model counts (``omnibal.cost.stack``:
    ``megatron-deepspeed``, the paper's, ``fsdp`` or ``omnibal``)."""
    pack_search: PackSearchConfig = field(default_factory=lambda: PackSearchConfig(microbatches=()), metadata={
        "flag": "--pack-microbatches", "parse": parse_pack_microbatches, "cli_default": "8,12,16,24,32",
        "metavar": "M,M,..."})
    """Pack sizes (micro-batches per step, samples per pack) searched with partition and recompute; the job's
    own ``num_microbatches`` is always a candidate. On the command line the micro-batch counts tried at the
    same samples per step (``none``: keep ``--microbatches`` and 4.5 samples per pack). Off here (a library
    caller's M stays M); ``omnibal plan`` turns it on (default 8,12,16,24,32)."""
    pp_schedule: PipelineSchedule = field(default="1f1b", metadata={"choices": PLANNER_PP_SCHEDULES})
    """Pipeline schedule the simulator runs."""
    chunks: tuple[int, ...] = field(default=(1,), metadata={"option": "chunks", "parse": parse_chunks,
                                                            "cli_default": "1,2", "metavar": "V[,V...]"})
    """Model chunks per pipeline device the planner may choose (``omnibal.plan.interleaved``): 1 is the
    ``pp_schedule`` itself; more is interleaved 1F1B, kept only when the simulator finds it faster. Off here (a
    library caller's pp_schedule stays as given); ``omnibal plan`` turns it on (default 1,2)."""
    search: SearchConfig = field(default_factory=SearchConfig, metadata={"cli": False})
    """Neighbour search around the exact optimum (``omnibal plan`` adds :class:`SearchConfig`'s own fields;
    its seed is the job's ``seed``)."""
    convert_stats: bool = False
    """Convert statistics made in another image convention (InternVL tiles vs LLaVA single image) to the
    model's (``--convert-stats``); without it such statistics are an InputError naming both
    (``omnibal.cost.units.model_stats``). The synthetic InternVL-like mixture is always converted."""
    engine: Engine = "reference"
    """Engine the plan is for (``omnibal.plan.engines``): its constraints are inputs to the planner, the
    ablation gets one row per constraint (and one with all of them: the plan), and its ready-to-use files go
    to ``OUT/exports/`` (docs/engines/)."""
    selective: bool | None = field(default=None, metadata={"option": "selective_recompute"})
    """Let adaptive recompute run transformer blocks selectively (``omnibal.train.recompute``); None: where
    the engine expresses it per layer (``reference``: the reference trainer and the HF adapter)."""

    @property
    def selective_recompute(self) -> bool:
        """Whether the plan may recompute selectively (``selective``, or the engine's default)."""
        from omnibal.plan.engines import get_engine

        return get_engine(self.engine).selective if self.selective is None else self.selective

    @property
    def hardware_name(self) -> str:
        """The hardware's name, a preset's or a measured spec's (``cpu-1t``)."""
        return self.hardware.name if isinstance(self.hardware, HardwareSpec) else str(self.hardware)

    def validate(self) -> None:
        from omnibal.cost.stack import check_stack_zero
        from omnibal.plan.engines import check_job

        check_choice(self.engine, Engine, source="--engine", field="engine")
        check_choice(self.pp_schedule, PLANNER_PP_SCHEDULES, source="--pp-schedule", field="pp_schedule")
        from omnibal.plan.interleaved import check_chunks

        check_chunks(self.chunks)
        check_job(self.engine, pp_schedule=self.pp_schedule, zero_stage=self.layout.zero_stage,
                  selective=self.selective)
        check_stack_zero(self.stack, self.layout.zero_stage)
        for name in ("baseline_batch_size", "num_samples"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise InputError(f"must be a positive integer, got {value!r}", source=f"--{name.replace('_', '-')}",
                                 field=name)
        self.layout.check_devices(self.num_gpus)
        if self.memory_budget_gib is not None and not self.memory_budget_gib > 0:
            raise InputError(f"must be positive, got {self.memory_budget_gib}", source="--memory-budget",
                             field="memory_budget_gib")
        check_choice(self.baseline_sampler, BaselineSampler, source="--baseline-sampler", field="baseline_sampler")
        check_choice(self.baseline_partition, BaselinePartition, source="--baseline-partition",
                     field="baseline_partition")
        check_choice(self.padding, PLAN_PADDINGS, source="--padding", field="padding")
        check_choice(self.baseline_padding, BASELINE_PADDINGS, source="--baseline-padding", field="baseline_padding")
        check_choice(self.balance_method, BalanceMethod, source="--balance-method", field="balance_method")
        check_choice(self.oversize, OversizePolicy, source="--oversize", field="oversize")
        for name in ("max_tiles", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise InputError(f"must be a positive integer, got {value!r}", source=f"--{name.replace('_', '-')}",
                                 field=name)
            if value is not None and self.balance_method in (BalanceMethod.RANDOM, BalanceMethod.LENGTH_GROUPED):
                raise InputError(f"the {self.balance_method} sampler packs a fixed number of samples, no buffer "
                                 "to cap; use --balance-method omnibal, isf or isf+assign",
                                 source=f"--{name.replace('_', '-')}", field=name)
        slots = self.layout.dp_size * self.layout.num_microbatches
        if self.balance_samples is not None and self.balance_samples < slots:
            raise InputError(f"needs at least dp_size x num_microbatches = {slots} "
                             f"samples, got {self.balance_samples}", source="--balance-samples",
                             field="balance_samples")
