"""`TrainConfig`: everything the reference trainer needs to run, as one keyword-only dataclass.

The CLI (`omnibal train`, `torchrun ... -m omnibal train`) builds it from arguments; tests build it directly.
Validation here covers what can be checked without the model or the world: ranges, names, combinations.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from omnibal.errors import InputError
from omnibal.layout import (
    PLANNER_PP_SCHEDULES,
    Device,
    DpSync,
    Layout,
    OnError,
    PipelineSchedule,
    Precision,
    TrainMode,
    check_choice,
)
from omnibal.train.stage_layout import parse_stage_layers
from omnibal.validate import check_positive_int, is_int


def parse_stage_sets(text: str) -> tuple[tuple[str, ...], ...]:
    """Per-stage layer names: stages split by ``;``, names by ``,`` (``"a,b;"``: stage 1 has none)."""
    return tuple(tuple(n.strip() for n in part.split(",") if n.strip()) for part in text.split(";"))


TRAIN_LAYOUT = Layout(zero_stage=0, num_microbatches=4)
"""The trainer's default layout: one rank, no ZeRO (the reference trainer shards nothing), 4 micro-batches."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run of the reference DP x PP trainer."""

    mode: TrainMode = "offline"
    """`baseline`: random fixed micro-batches of `baseline_batch_size` samples padded to their longest
    sample, even layer split, every block recomputed. `offline`: the balanced schedule's packs, the
    plan's (or the given) partition and recompute sets. `online` (OrchMLLM-style; with pp > 1 the vision
    phase runs on stage 0's ranks, :mod:`omnibal.train.online_pipeline`): the baseline's random local draws
    of `num_microbatches x baseline_batch_size` samples per rank, re-dealt every step by an all-gather of
    sizes and all-to-alls, the vision phase dealt by tile and the LLM phase balanced by LLM cost
    (:mod:`omnibal.train.online`)."""
    layout: Layout = TRAIN_LAYOUT
    """DP x PP (world size = dp_size * pp_size) and micro-batches per DP rank per step (must match the
    schedule file when one is given); no TP and no ZeRO (tp_size 1, zero_stage 0). Another layout:
    ``replace(TRAIN_LAYOUT, dp_size=2)``."""
    sp_degree: int = 1
    """Sequence-parallel degree of a single-level run (:mod:`omnibal.train.sp`): every ``sp_degree``
    consecutive DP ranks form one group that splits each pack's tokens (Ulysses) and tiles, so the data is
    balanced for ``dp_size / sp_degree`` groups. A multi-level (HBP) schedule sets its own degrees per level
    (leave this at 1). Needs dp_sync flat and the reference VLM; with pp > 1 each pipeline stage's group is
    the ranks of that stage (:mod:`omnibal.train.sp_pipe`)."""
    level_curriculum: int = 0
    """HBP's curriculum: in a multi-level schedule of one of the first ``level_curriculum`` epochs (its
    ``epoch`` field), the short levels' steps (smaller SP degree) run first. 0: the schedule's order."""
    level_warmup: int = 0
    """HBP's warm-up: in a multi-level schedule of epoch 0, up to ``level_warmup`` steps of the shortest level
    run first, then the levels alternate in the schedule's order (:func:`omnibal.train.sp.warmup_order`)."""
    node_size: int = 0
    """``--mode online``: DP ranks per node for the node-wise (two-level) all-to-all of samples and features,
    intra-node first, then inter-node (:mod:`omnibal.train.alltoall`); must divide ``dp_size``. 0: one flat
    all-to-all."""
    online_balance: bool = True
    """``--mode online``: re-deal each step's draws across DP ranks. False is the control run: every sample
    runs on the rank that drew it, in online's unpadded packs and without recompute, so that comparing it
    with online isolates the balance from the padding and recompute the baseline adds."""
    pp_schedule: PipelineSchedule = field(default="1f1b", metadata={"choices": PLANNER_PP_SCHEDULES})
    """Pipeline schedule (torch.distributed.pipelining Schedule1F1B or ScheduleGPipe)."""
    dp_sync: DpSync = "flat"
    """Gradient sum over DP: ``flat`` (one all-reduce after the step; the wait for the slowest rank is
    logged as ``dp_sync_s``) or ``ddp`` (DistributedDataParallel, overlapping the last backward)."""
    stage_layers: tuple[tuple[int, int], ...] | None = field(default=None, metadata={"parse": parse_stage_layers})
    """Explicit half-open layer ranges [start, end) per stage over ModelSpec.layers(); None: from the
    plan, else an even split of the chain."""
    recompute: tuple[tuple[str, ...], ...] | None = field(default=None, metadata={"parse": parse_stage_sets})
    """Per stage, the layer names whose activations are recomputed; None: the plan's sets in offline mode,
    every block in baseline mode."""
    selective: tuple[tuple[str, ...], ...] | None = field(default=None, metadata={"parse": parse_stage_sets})
    """Per stage, the layer names under selective recompute (``omnibal.train.recompute``); None: the plan's
    sets in offline mode, else none. Given together with or instead of ``recompute``."""
    plan_path: str | None = field(default=None, metadata={"option": "plan"})
    """Plan JSON (from `omnibal plan`) giving the stage ranges and recompute sets."""
    model: str = "tiny"
    """Model preset name (omnibal.cost presets) the reference VLM is built from."""
    stats_path: str | None = field(default=None, metadata={"option": "stats"})
    """Per-sample statistics (a SampleStats file) the synthetic dataset reproduces the shapes of."""
    schedule_path: str | None = field(default=None, metadata={"option": "schedule_file"})
    """Balanced schedule JSON (`omnibal balance`) for offline mode."""
    max_samples: int | None = None
    """Train on a seeded random subset of this many rows of the statistics (None: all rows)."""
    stats_tokens_per_tile: int = 256
    """Image tokens per tile statistics without a recorded convention counted (InternVL-1.5: 256); the
    statistics are put in the model's units by ``omnibal.cost.units.model_stats`` (a recorded convention wins)."""
    convert_stats: bool = False
    """Convert statistics made in another image layout (InternVL tiles vs LLaVA single images) to the model's
    (``--convert-stats``); without it they are an InputError naming both."""
    annotations_path: str | None = field(default=None, metadata={"flag": "--annotations", "metavar": "FILE"})
    """LLaVA / InternVL annotation file (.json or .jsonl) to train on: real images and text instead of the
    synthetic data (needs ``tokenizer_path``)."""
    image_root: str | None = None
    """Folder the annotations' image paths are relative to (None: the annotation file's folder)."""
    tokenizer_path: str | None = field(default=None, metadata={"option": "tokenizer"})
    """Local tokenizer (tokenizer.json or a tokenizer folder), as for ``omnibal stats --tokenizer``."""
    hf_model: str | None = None
    """Local Hugging Face checkpoint folder (Llava or InternVL, transformers 5.x) to fine-tune instead of the
    reference VLM built from ``model``."""
    save_dir: str | None = field(default=None, metadata={"metavar": "DIR"})
    """Write the fine-tuned model here as an HF checkpoint (``from_pretrained`` loads it) at the end, and to
    ``save_dir/checkpoint-<step>`` at every checkpoint. Needs ``hf_model``."""
    max_tiles: int | None = None
    """Dynamic-resolution tile cap per image for real data (InternVL-style models; a Llava image is 1 tile); None:
    the checkpoint's ``preprocessor_config.json`` ``max_patches``, else 12."""
    on_error: OnError = "raise"
    """Bad annotation records: ``raise`` at the first, or ``skip`` them (counted and reported)."""
    baseline_batch_size: int = field(default=4, metadata={"option": "batch_size"})
    """Samples per micro-batch in baseline mode."""
    num_steps: int = field(default=10, metadata={"flag": "--steps"})
    """Optimizer steps to run (in total, counting resumed ones); 0: to the end of the schedule's epoch (after a
    reshard: of the re-balanced rest of it)."""
    lr: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    seed: int = 0
    """Seed of the model initialisation and of the baseline's random micro-batches."""
    device: Device = "cpu"
    """Device type; the backend follows from it (gloo on cpu, nccl on cuda)."""
    precision: Precision = "fp32"
    """``fp32``, or ``bf16-mixed``: fp32 weights and AdamW state, matrix products and attention in bf16 under
    ``torch.autocast`` (what a GPU run uses; on a CPU it works too, slowly)."""
    prefetch: bool | None = None
    """Load the next step's micro-batches on a background thread while the step computes; None: on CUDA
    (the device would wait for the images to be decoded), off on CPU (the thread would take a core from the
    ranks)."""
    timeout_s: float = field(default=60.0, metadata={"flag": "--timeout"})
    """Seconds any collective or p2p operation may block before the rank fails with a clear error
    (a dead or stuck peer); also bounds the rendezvous."""
    torch_threads: int = field(default=1, metadata={"option": "threads"})
    """torch intra-op threads per rank (1 for honest timings with one rank per core)."""
    checkpoint_dir: str | None = field(default=None, metadata={"metavar": "DIR"})
    """Folder of step checkpoints (shared by all ranks); None: no checkpoints."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (0: only at the end when checkpoint_dir is set)."""
    resume: bool = False
    """Continue from the newest valid checkpoint in checkpoint_dir."""
    reshard: bool = False
    """With resume: accept a checkpoint of another dp size (same pp) and re-balance the rest of its epoch."""
    log_path: str | None = field(default=None, metadata={"flag": "--metrics-log", "also": ("--log",),
                                                          "metavar": "FILE"})
    """JSONL metrics log (one line per step, written by global rank 0)."""
    ledger_path: str | None = field(default=None, metadata={"flag": "--ledger",
                                                             "metavar": "FILE"})
    """Per-sample ledger (:mod:`omnibal.train.ledger`): the sample keys every step trained, one JSON line per
    step, appended by global rank 0 (several runs of one job share the file)."""
    summary_path: str | None = field(default=None, metadata={"flag": "--summary-json", "metavar": "FILE"})
    """Write the end-of-run summary (throughput, per-rank compute/wait, memory) as JSON here (rank 0)."""
    quiet: bool = False
    """No progress bar, no step lines and no summary table."""
    print_every: int = 0
    """Steps between the loss lines rank 0 prints where stdout is not a terminal (a log file): 0, about 20 per
    run (:class:`omnibal.train.metrics_log.StepReporter`)."""

    def __post_init__(self) -> None:
        src = "train config"
        check_choice(self.mode, TrainMode, source=src, field="mode")
        check_choice(self.dp_sync, DpSync, source=src, field="dp_sync")
        check_choice(self.pp_schedule, PLANNER_PP_SCHEDULES, source=src, field="pp_schedule")
        if self.layout.tp_size != 1 or self.layout.zero_stage != 0:
            raise InputError("the reference trainer has no tensor parallelism and no ZeRO: tp_size must be 1 "
                             f"and zero_stage 0, got {self.layout.tp_size} and {self.layout.zero_stage}",
                             source=src, field="layout")
        check_choice(self.device, Device, source=src, field="device")
        check_choice(self.precision, Precision, source=src, field="precision")
        if not is_int(self.num_steps) or self.num_steps < 0:
            raise InputError(f"must be an integer >= 0 (0: the whole epoch), got {self.num_steps!r}", source=src,
                             field="num_steps")
        for name in ("baseline_batch_size", "torch_threads"):
            check_positive_int(getattr(self, name), name, source=src)
        if self.max_tiles is not None:
            check_positive_int(self.max_tiles, "max_tiles", source=src)
        check_positive_int(self.sp_degree, "sp_degree", source=src)
        if not is_int(self.level_curriculum) or self.level_curriculum < 0:
            raise InputError(f"must be an integer >= 0 (epochs), got {self.level_curriculum!r}", source=src,
                             field="level_curriculum")
        if not is_int(self.level_warmup) or self.level_warmup < 0:
            raise InputError(f"must be an integer >= 0 (steps), got {self.level_warmup!r}", source=src,
                             field="level_warmup")
        if not is_int(self.print_every) or self.print_every < 0:
            raise InputError(f"must be an integer >= 0 (0: about 20 lines per run), got {self.print_every!r}",
                             source=src, field="print_every")
        if self.checkpoint_every < 0:
            raise InputError(f"must be >= 0, got {self.checkpoint_every}", source=src, field="checkpoint_every")
        if not self.timeout_s > 0:
            raise InputError(f"must be > 0, got {self.timeout_s}", source=src, field="timeout_s")
        if self.lr <= 0:
            raise InputError(f"must be > 0, got {self.lr}", source=src, field="lr")
        if self.layout.num_microbatches < self.layout.pp_size:
            raise InputError(f"{self.layout.num_microbatches} micro-batches cannot fill {self.layout.pp_size} "
                             "pipeline stages", source=src, field="num_microbatches")
        if self.mode == "online" and self.dp_sync != "flat":
            raise InputError("online mode sums gradients with the flat all-reduce (its layers run outside DDP): "
                             "use dp_sync 'flat'", source=src, field="dp_sync")
        self._check_sp()
        if self.node_size < 0 or (self.node_size and self.layout.dp_size % self.node_size):
            raise InputError(f"node_size {self.node_size} must be 0 (flat all-to-all) or divide dp_size "
                             f"{self.layout.dp_size}", source=src, field="node_size")
        if not self.online_balance and self.mode != "online":
            raise InputError("online_balance False is online mode's control: pass mode 'online'", source=src,
                             field="online_balance")
        if self.node_size and self.mode != "online":
            raise InputError("node_size sets online mode's all-to-all: pass mode 'online'", source=src,
                             field="node_size")
        if self.stage_layers is not None and len(self.stage_layers) != self.layout.pp_size:
            raise InputError(f"{len(self.stage_layers)} ranges given for {self.layout.pp_size} stages",
                             source=src, field="stage_layers")
        for name in ("recompute", "selective"):
            sets = getattr(self, name)
            if sets is not None and len(sets) != self.layout.pp_size:
                raise InputError(f"{len(sets)} {name} sets given for {self.layout.pp_size} stages", source=src,
                                 field=name)
        if self.max_samples is not None and self.max_samples < 1:
            raise InputError(f"must be >= 1, got {self.max_samples}", source=src, field="max_samples")
        if self.annotations_path is not None and self.tokenizer_path is None:
            raise InputError("real data needs the tokenizer its token counts come from: pass tokenizer_path "
                             "(--tokenizer)", source=src, field="tokenizer_path")
        if self.hf_model is not None and self.annotations_path is None:
            raise InputError("a Hugging Face model trains on real data: pass annotations_path (--annotations)",
                             source=src, field="annotations_path")
        if self.save_dir is not None and self.hf_model is None:
            raise InputError("save_dir writes a Hugging Face checkpoint: pass hf_model (--hf-model)", source=src,
                             field="save_dir")
        check_choice(self.on_error, OnError, source=src, field="on_error")
        if self.resume and not self.checkpoint_dir:
            raise InputError("resume needs checkpoint_dir", source=src, field="resume")
        if self.reshard and not self.resume:
            raise InputError("reshard applies to a resume: pass resume too", source=src, field="reshard")

    def _check_sp(self) -> None:
        if self.sp_degree == 1:
            return
        src = "train config"
        if self.layout.dp_size % self.sp_degree:
            raise InputError(f"SP degree {self.sp_degree} does not divide the {self.layout.dp_size} data-parallel "
                             f"ranks (an SP group is {self.sp_degree} consecutive ranks)", source=src,
                             field="sp_degree")
        for bad, why in ((self.mode == "online", "baseline or offline mode"),
                         (self.dp_sync != "flat", "dp_sync flat"), (self.hf_model is not None, "the reference VLM"),
                         (self.reshard, "no reshard")):
            if bad:
                raise InputError(f"sequence parallelism runs with {why}", source=src, field="sp_degree")

    @property
    def world_size(self) -> int:
        return self.layout.dp_size * self.layout.pp_size

    def to_dict(self) -> dict:
        """Flat (the layout's fields beside the others), as the summary JSON has always been."""
        flat = asdict(self)
        return {**flat.pop("layout"), **flat}
