"""The training loop of one rank: data -> global target count -> pipeline step -> DP sync -> optimizer.

    world = init_world(dp_size=2, pp_size=2, device="cpu", timeout_s=60)
    trainer = Trainer(world=world, model=VLM(spec, seed=0), layout=layout, schedule=schedule,
                      dataset=dataset, mode="offline", num_microbatches=4)
    trainer.maybe_resume(checkpoint_dir)          # optional
    summary = trainer.run(num_steps)

Before the first step of a schedule (and again after a resume replaces it) all ranks all-gather its
fingerprint and refuse to train different ones (:class:`~omnibal.errors.ScheduleMismatch` naming the ranks
that differ): each rank builds or reads the schedule itself.

One step on every rank:

1. stage 0 of each DP rank reads its micro-batches from the schedule and collates them (the others wait);
2. one all-reduce over the whole world of (targets, samples, tokens, ...): the global number of target
   tokens, so every micro-batch's loss is ``loss_sum / global_targets`` and packing does not change the
   gradient; it also starts the step on all ranks together;
3. the pipeline schedule (or plain accumulation when pp = 1) runs forward + backward;
4. gradients are summed over the DP group (one flat all-reduce), then the optimizer steps;
5. all ranks' timings are gathered to global rank 0, which logs the step (outside the timed region).

Any backend failure (a peer died, a timeout) becomes a PeerFailure naming this rank and the step.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np
import torch

from omnibal.errors import InputError, ScheduleMismatch
from omnibal.train.collectives import all_gather, all_reduce, gather_objects
from omnibal.train.distributed import World, caused_by_comm_error, is_comm_error, peer_failure
from omnibal.train.feed import Buffer, ScheduleLike, check_schedule, schedule_fingerprint, step_microbatches
from omnibal.train.level_recompute import LevelRecompute
from omnibal.train.metrics_log import (
    MetricsLog,
    RankTimes,
    StepRecord,
    StepReporter,
    StepWork,
    process_memory,
    summarize,
)
from omnibal.train.online import online_forward_backward
from omnibal.train.online_pipeline import OnlineState
from omnibal.train.pipeline import GradSync, StageRunner
from omnibal.train.resume import CheckpointResume
from omnibal.train.samples import SampleReader, placeholder_sample, real_indices
from omnibal.train.sp import sp_schedule
from omnibal.train.sp_pipe import build_sp
from omnibal.train.stage import build_rank_stages, example_carry
from omnibal.train.stage_layout import StageLayout, layout_schedule

_COUNT_FIELDS = ("targets", "samples", "tokens", "tiles", "buffer_tokens", "buffer_tiles")


def model_identity(spec) -> str:
    """Name plus the spec's fingerprint (the one model hash, ``ModelSpec.fingerprint``): checkpoints refuse to
    load into another architecture."""
    return f"{spec.name}:{spec.fingerprint()}"


def base_collate_config(model, dataset):
    """The model's collate settings (image size, tokens per tile) with the dataset's image token where it has
    one (real data: the tokenizer's); None for a model without them."""
    if not hasattr(model, "collate_config"):
        return None
    image_id = getattr(dataset, "image_token_id", None)
    return model.collate_config(num_tiles=1, num_tokens=1, **({} if image_id is None else {"image_token_id": image_id}))


class Trainer(CheckpointResume):
    """One rank of a DP x PP run of the reference VLM (see the module docstring)."""

    def __init__(self, *, world: World, model, layout: StageLayout, schedule: ScheduleLike, dataset,
                 mode: str, num_microbatches: int, pp_schedule: str = "1f1b", lr: float = 1e-4,
                 weight_decay: float = 0.0, buffer: Buffer | None = None, log_path: str | None = None,
                 quiet: bool = True, checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                 run_info: dict | None = None, dp_sync: str = "flat", ledger_path: str | None = None,
                 notify: Callable[[str], None] | None = None, sp_degree: int = 1, level_curriculum: int = 0,
                 level_warmup: int = 0,
                 precision: str = "fp32", prefetch: bool = False, say: Callable[[str], None] | None = None,
                 print_every: int = 0, on_error: str = "raise", warn: Callable[[str], None] | None = None,
                 node_size: int = 0, online_balance: bool = True):
        self.world = world
        self.spec = model.spec
        self.layout = layout
        self.schedule = schedule
        self.dataset = dataset
        self.mode = mode
        self.num_microbatches = num_microbatches
        self.pp_schedule = pp_schedule = layout_schedule(layout, pp_schedule)
        """``1f1b`` or ``gpipe`` (pp > 1); ``interleaved`` for a layout of several chunks per rank."""
        self._init_reporting(quiet=quiet, notify=notify, say=say, print_every=print_every, on_error=on_error,
                             warn=warn)
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.model_id = model_identity(self.spec)
        self.pad_to_longest = mode == "baseline"
        self.node_size = node_size
        """``--mode online``: DP ranks per node of the two-level all-to-all (0: flat)."""
        self.online_balance = online_balance
        """``--mode online``: re-deal the draws (False: the control, every sample stays where drawn)."""
        self.step = 0
        """Steps completed (the next step to run)."""
        self.skipped_checkpoints: list[str] = []
        self.resumed_from: str | None = None
        """The checkpoint folder :meth:`maybe_resume` loaded (None: a fresh start)."""
        self.resharded = False
        """Whether :meth:`maybe_resume` replaced the schedule by the re-balanced rest of another world's epoch."""

        layer_names = [spec.name for spec, _ in model.chain()]
        if layout.ranges[-1][1] != len(layer_names) or len(layout.ranges) != world.pp_size * layout.num_chunks:
            raise InputError(f"stage layout {layout.ranges} does not split the {len(layer_names)}-layer model into "
                             f"{world.pp_size} stages", source="stage_layers")
        self.schedule = schedule = self._sp_schedule(schedule, sp_degree, level_curriculum, level_warmup)
        self._check_schedule(schedule)
        self.schedule_id = schedule_fingerprint(schedule)
        self._agreed_id: str | None = None  # the schedule fingerprint all ranks were found to share

        self.prefetch = prefetch
        """Load the next step's micro-batches on a background thread (:mod:`omnibal.train.prefetch`)."""
        self._prefetcher = None
        self._last_step = schedule.num_steps - 1
        """The last step the current :meth:`run` trains (what the prefetcher may load ahead)."""
        self.autocast = {"fp32": None, "bf16-mixed": torch.bfloat16}[precision]
        """Forward dtype under ``torch.autocast`` (``precision`` bf16-mixed), None for plain fp32."""
        self._build_stage_runner(model, buffer, pp_schedule=pp_schedule, dp_sync=dp_sync, lr=lr,
                                 weight_decay=weight_decay)
        self.collate_base = base_collate_config(model, dataset)
        """The model's collate settings; a step's pack sizes replace its tile and token counts."""
        self.on_checkpoint = None
        """Called with the step after every checkpoint and with None at the end of a run (by whoever runs
        it), on every rank: e.g. export the model in another format (:func:`omnibal.train.hf_run.export_hf`)."""
        self._log_path = log_path if world.rank == 0 else None
        self._log_header = {**(run_info or {}), "world": {"dp": world.dp_size, "pp": world.pp_size},
                            "model_id": self.model_id, "stage_layers": [list(r) for r in layout.ranges],
                            "recompute": [list(r) for r in layout.recompute],
                            "selective": [list(r) for r in layout.selective], "mode": mode,
                            "dp_sync": dp_sync}
        self.log = MetricsLog(None)
        """Step records (the JSONL file opens at the first step: appended to when resuming)."""
        self.consumed: list[list[int]] = []
        """Per completed step, the sample indices this rank's stage 0 fed (for resume checks)."""
        self.ledger_path = ledger_path
        """Per-sample ledger (:mod:`omnibal.train.ledger`): every rank gathers its keys, global rank 0 writes."""
        self._ledger = None
        self.online_state = OnlineState() if mode == "online" else None
        """``--mode online``: the all-to-all groups and pipelines it makes on its first step."""
        self.online_info: list = []
        """``--mode online``: per step, the dispatch's per-phase balance
        (:class:`omnibal.train.online.OnlineStepInfo`)."""
        self.skipped_samples: list[dict] = []
        """After :meth:`run`: every rank's samples left out by ``on_error="skip"`` (see ``reader.skipped``)."""

    def _init_reporting(self, *, quiet: bool, notify, say, print_every: int, on_error: str, warn) -> None:
        """What the run tells and where (the caller, e.g. the CLI, prints it: the trainer itself never writes to
        the terminal, the progress bar aside), and how it reads its samples."""
        world = self.world
        self.quiet = quiet
        """No progress bar and none of ``say``'s lines; notices (:meth:`notify`) are told all the same."""
        self._notify = notify if world.rank == 0 else None
        self.notices: list[str] = []
        """Every line :meth:`notify` told (global rank 0): what the summary JSON lists."""
        # the run's own lines (what it trains, loss every print_every steps, checkpoints saved), unless quiet
        self.say = say if not quiet and world.rank == 0 else None
        self.print_every = print_every
        self.reader = SampleReader(self.dataset, on_error, warn=warn,
                                   where=world.where if world.world_size > 1 else "")
        """Reads the samples of this rank's micro-batches (``on_error``: a sample that cannot be built stops
        the run or is skipped, :mod:`omnibal.train.samples`)."""

    def notify(self, line: str) -> None:
        """Tell a notice about the data (global rank 0; whether or not the run is quiet) and keep it."""
        if self.world.rank == 0:
            self.notices.append(line)
            if self._notify is not None:
                self._notify(line)

    def _check_schedule(self, schedule, num_microbatches: int | None = None) -> None:
        """:func:`omnibal.train.feed.check_schedule` on every rank (the row indices where the dataset is: stage
        0), so a schedule this world cannot run is refused by all ranks alike; sets ``step_mbs``. Only 1F1B
        needs at least as many micro-batches as stages (torch's GPipe runs fewer). ``num_microbatches``: the
        largest count it may run (default: the run's ``--microbatches``)."""
        source = getattr(schedule, "source", "schedule")
        if self.mode == "online" and getattr(schedule, "level_microbatches", None) is not None:
            raise InputError("online mode re-deals fixed draws of --microbatches x --batch-size samples; a schedule "
                             "whose levels run their own micro-batch counts is for offline mode", source=source,
                             field="level_microbatches")
        check_schedule(schedule, dp_size=self.world.dp_size, num_microbatches=num_microbatches or self.num_microbatches,
                       num_samples=None if self.dataset is None else len(self.dataset), source=source,
                       pp_size=self.world.pp_size if self.pp_schedule != "gpipe" else 1)
        self.step_mbs = step_microbatches(schedule)
        """Micro-batches per rank of every step (``num_microbatches`` unless the levels have their own)."""

    def _build_stage_runner(self, model, buffer: Buffer | None, *, pp_schedule: str, dp_sync: str,
                            lr: float, weight_decay: float) -> None:
        """This rank's stage module (checkpointed as the layout says), its pipeline runner, optimizer and
        gradient sync."""
        world, num_microbatches = self.world, self.num_microbatches
        ranges = self._build_stage(model, dp_sync)

        if world.pp_size > 1 and buffer is None:
            raise InputError("a pipeline needs one fixed micro-batch buffer (tiles, tokens)", source="buffer")
        self.buffer = buffer
        example_in = example_out = None
        if world.pp_size > 1:
            kw = dict(num_tiles=buffer.tiles, num_tokens=buffer.tokens, device=world.device,
                      dtype=self.autocast or torch.float32)  # activations cross stages in the forward dtype
            example_in, example_out = ([example_carry(model, r[k], **kw) for r in ranges] for k in (0, 1))
            if self.layout.num_chunks == 1:
                example_in, example_out = example_in[0], example_out[0]
        self.runner = StageRunner(self.stage_module, stage_index=world.pp_rank, num_stages=world.pp_size,
                                  device=world.device, num_microbatches=num_microbatches,
                                  pp_schedule=pp_schedule, pp_group=world.pp_group,
                                  example_inputs=example_in, example_outputs=example_out,
                                  dp_group=world.dp_group, dp_size=world.dp_size, dp_sync=dp_sync,
                                  autocast=self.autocast, num_chunks=self.layout.num_chunks)
        params = [p for p in self.stage_module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay) if params else None
        # with DDP the runner's wrapped module reduces the gradients inside the backward
        self.grad_sync = GradSync(params, world.dp_group, 1 if self.runner.ddp else world.dp_size)
        self.sp = build_sp(model, self.stage_module, world=world, runner=self.runner, step_sp=self.step_sp.tolist(),
                           mode=self.mode, dp_sync=dp_sync, buffer=buffer, dtype=self.autocast or torch.float32)
        """The run's sequence parallelism (:class:`omnibal.train.sp.SequenceParallel`; None: no step uses SP)."""

    # ---------------------------------------------------------------------------------------------- SP

    def _sp_schedule(self, schedule, sp_degree: int, curriculum_epochs: int, warmup_steps: int):
        """The schedule as this world runs it (:func:`omnibal.train.sp.sp_schedule`); sets ``step_sp``."""
        schedule, self.step_sp = sp_schedule(schedule, sp_degree=sp_degree, curriculum_epochs=curriculum_epochs,
                                             dp_size=self.world.dp_size, num_heads=self.spec.llm.num_heads,
                                             warmup_steps=warmup_steps)
        """SP degree of every step (1: plain data parallel)."""
        return schedule

    def _build_stage(self, model, dp_sync: str) -> list[tuple[int, int]]:
        """This rank's stage (its layer range(s) of ``model``, recompute sets, device; with per-level sets,
        ``self.level_recompute`` puts each step's level's sets on it). Returns the stage's layer ranges (one
        per chunk: :func:`omnibal.train.stage.build_rank_stages`)."""
        w = self.world
        self.stage_module, ranges = build_rank_stages(model, self.layout, w.pp_rank, w.pp_size)
        self.stage_module.to(w.device)
        owned = [c * w.pp_size + w.pp_rank for c in range(self.layout.num_chunks)]
        self.level_recompute = LevelRecompute(self.layout, self.schedule, stage_indices=owned) \
            if self.layout.level_recompute else None
        return ranges

    def _sp_leader(self, step: int) -> bool:
        """Whether this rank counts its micro-batches for ``step`` (the first rank of its SP group: the
        group's ranks hold the same packs, which count once in the targets, samples and the ledger).
        Without SP every rank counts, whatever the schedule's length (a resharded remainder is longer)."""
        if self.sp is None:
            return True
        return self.world.dp_rank % int(self.step_sp[step]) == 0

    # ---------------------------------------------------------------------------------------------- data

    def _collate_config(self, mb_indices: Sequence[np.ndarray]):
        from dataclasses import replace

        if self.buffer is not None:
            tiles, tokens = self.buffer.tiles, self.buffer.tokens
        else:  # one stage: each micro-batch sized exactly (the baseline pads only to its own longest sample)
            stats = self.dataset.stats
            tiles = max(1, max(int(stats.tiles[mb].sum()) for mb in mb_indices))
            tokens = max(int(len(mb) * stats.tokens[mb].max()) if self.pad_to_longest else int(stats.tokens[mb].sum())
                         for mb in mb_indices)
        return replace(self.collate_base, num_tiles=tiles, num_tokens=tokens,
                       mode="pad_to_longest" if self.pad_to_longest else "pack",
                       source=getattr(self.schedule, "source", "schedule"))

    def load_microbatches(self, step: int):
        """Stage 0: this DP rank's micro-batches of ``step`` (collated MicroBatch objects)."""
        from omnibal.data.collate import collate

        indices = [np.asarray(self.schedule.microbatch(step, self.world.dp_rank, k))
                   for k in range(int(self.step_mbs[step]))]
        cfg = self._collate_config(indices)
        out = []
        for k, mb in enumerate(indices):
            try:  # a micro-batch whose every sample was skipped runs as a pack that trains nothing
                samples = self.reader.read(mb, step=step, report=self._sp_leader(step))
                out.append(collate(samples or [placeholder_sample(cfg.image_size)], cfg))
            except InputError as exc:
                raise InputError(f"step {step}, dp rank {self.world.dp_rank}, micro-batch {k}: {exc.message}",
                                 source=exc.source, record=exc.record, field=exc.field) from exc
        return out

    def _step_batches(self, step: int):
        """:meth:`load_microbatches` of ``step``, loaded ahead during the previous step with ``prefetch``."""
        if not self.prefetch:
            return self.load_microbatches(step)
        if self._prefetcher is None:
            from omnibal.train.prefetch import StepPrefetcher

            self._prefetcher = StepPrefetcher(self.load_microbatches, key=lambda: id(self.schedule),
                                              last_step=lambda: self._last_step)
        return self._prefetcher.get(step)

    # ---------------------------------------------------------------------------------------------- step

    def forward_backward(self) -> StepWork:
        """Steps 1-4 of the next step (data, global count, pipeline forward/backward, DP gradient sum);
        leaves the summed gradients in the stage's parameters and returns what :meth:`train_step` needs to
        finish the step."""
        from omnibal.data.collate import SIZE_TILES, SIZE_TOKENS

        w = self.world
        step = self.step
        if step >= self.schedule.num_steps:
            raise InputError(f"the schedule has {self.schedule.num_steps} steps; step {step} was requested",
                             source=getattr(self.schedule, "source", "schedule"), field="steps")
        if self._agreed_id != self.schedule_id:
            self.check_schedule_agrees()
        if self.mode == "online":  # OrchMLLM-style post-balancing with per-modality dispatch
            return online_forward_backward(self)
        times = RankTimes()
        t_start, cpu_start = time.perf_counter(), time.process_time()
        counts = torch.zeros(len(_COUNT_FIELDS), dtype=torch.float64)
        carries = None
        degree = int(self.step_sp[step])
        module = self.sp.activate(degree) if self.sp is not None else None
        if self.level_recompute is not None:
            self.level_recompute.apply(self.stage_module, self.schedule, step)
        fed: list[int] = []
        if w.is_first_stage:
            batches = self._step_batches(step)
            carries = [b.carry() for b in batches]
            tiles = sum(int(b.sizes[0, SIZE_TILES]) for b in batches)
            fed = [i for b in batches for i in real_indices(b.sample_indices)]
            counts += torch.tensor([
                sum(b.num_targets for b in batches), len(fed),
                sum(b.num_real_tokens for b in batches), tiles, sum(int(b.sizes[0, SIZE_TOKENS]) for b in batches),
                tiles], dtype=torch.float64)
            if not self._sp_leader(step):
                counts.zero_()
                fed = []
        times.data_s = time.perf_counter() - t_start
        try:
            all_reduce(w, counts, f"step {step}")
            totals = dict(zip(_COUNT_FIELDS, counts.tolist()))
            result = self.runner.run_step(carries, global_targets=totals["targets"], module=module,
                                          variant=degree, num_microbatches=int(self.step_mbs[step]))
            t_sync = time.perf_counter()
            self.grad_sync()
            times.dp_sync_s = time.perf_counter() - t_sync
        except InputError:
            raise
        except Exception as exc:
            if is_comm_error(exc) or caused_by_comm_error(exc):
                raise peer_failure(w, f"step {step}", exc) from exc
            raise
        times.compute_s = result.compute_s
        return StepWork(loss_sum=result.loss_sum, times=times, counts=totals, fed=fed, t_start=t_start,
                        cpu_start=cpu_start)

    def train_step(self) -> StepRecord | None:
        """Run the next step on this rank; global rank 0 returns the step's record, the others None."""
        work = self.forward_backward()
        times, step = work.times, self.step
        t_opt = time.perf_counter()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        times.optim_s = time.perf_counter() - t_opt
        times.step_s = time.perf_counter() - work.t_start
        times.cpu_s = time.process_time() - work.cpu_start
        times.wait_s = max(0.0, times.step_s - times.compute_s - times.dp_sync_s - times.optim_s - times.data_s)
        times.mem_bytes, times.peak_mem_bytes = process_memory(self.world.device.type)
        if self.world.is_first_stage:
            self.consumed.append(work.fed)
        if self.ledger_path:
            self._ledger_step(step, work.fed)
        self.step += 1
        return self._gather_record(step, times, work.loss_sum, work.counts)

    def _ledger_start(self) -> None:
        """Global rank 0: open the ledger with this run's start (what it resumed from)."""
        if self.ledger_path and self.world.rank == 0 and self._ledger is None:
            from omnibal.train.ledger import LedgerWriter

            self._ledger = LedgerWriter(self.ledger_path, {
                "resumed_at": self.step, "checkpoint": self.resumed_from, "resharded": self.resharded,
                "world": self._world_doc(), "schedule_steps": self.schedule.num_steps, "model_id": self.model_id})

    def _ledger_step(self, step: int, fed: list[int]) -> None:
        """Gather every DP rank's sample keys of ``step`` to global rank 0, which appends them to the ledger
        (before the step's checkpoint can be written)."""
        from omnibal.train.ledger import sample_keys

        mine = (sample_keys(self.dataset, fed), list(fed)) if self.world.is_first_stage else None
        parts = [p for p in gather_objects(self.world, mine, f"step {step} (ledger)") if p]
        if self.world.rank == 0:
            self._ledger_start()
            self._ledger.step(step, [k for p in parts for k in p[0]], [i for p in parts for i in p[1]])

    def _gather_record(self, step: int, times: RankTimes, loss_sum: float, counts: dict) -> StepRecord | None:
        w = self.world
        mine = torch.tensor(times.as_list() + [loss_sum], dtype=torch.float64)
        gathered = all_gather(w, mine, f"step {step} (metrics)")
        if w.rank != 0:
            return None
        if self._log_path is not None and self.log.path is None:
            header = dict(self._log_header, resumed_at_step=step) if step else self._log_header
            self.log = MetricsLog(self._log_path, append=step > 0, header=header)
        ranks = []
        for r, row in enumerate(gathered):
            vals = row.tolist()
            ranks.append({"rank": r, "dp": r // w.pp_size, "pp": r % w.pp_size,
                          **RankTimes.from_list(vals[:-1]).__dict__})
        record = StepRecord(step=step, loss=float(sum(row[-1].item() for row in gathered)),
                            step_s=max(r["step_s"] for r in ranks), samples=int(counts["samples"]),
                            tokens=int(counts["tokens"]), tiles=int(counts["tiles"]),
                            buffer_tokens=int(counts["buffer_tokens"]), buffer_tiles=int(counts["buffer_tiles"]),
                            targets=int(counts["targets"]), microbatches=int(self.step_mbs[step]), ranks=ranks)
        self.log.add(record)
        return record

    # ---------------------------------------------------------------------------------------------- run

    def run(self, num_steps: int | None = None, *, warmup: int = 1) -> dict:
        """Train until ``num_steps`` steps are done in total (resumed ones count; None or 0: to the end of
        the schedule); returns the summary (on global rank 0; an empty dict elsewhere)."""
        num_steps = self._steps_to_run(num_steps)
        self._last_step = num_steps - 1
        bar = StepReporter(num_steps, self.step, show=not self.quiet and self.world.rank == 0, say=self.say,
                           every=self.print_every)
        samples = "" if self.dataset is None else f", {len(self.dataset):,} samples"
        bar.line(f"omnibal train: training steps {self.step + 1}-{num_steps} of the {self.schedule.num_steps}-step "
                 f"epoch{samples}" if self.step < num_steps else f"omnibal train: all {num_steps} steps done already")
        self._ledger_start()
        try:
            while self.step < num_steps:
                bar.update(self.train_step())
                if self.checkpoint_dir and ((self.checkpoint_every and self.step % self.checkpoint_every == 0)
                                            or self.step == num_steps):
                    self.save_checkpoint()
                    bar.line(f"omnibal train: checkpoint of step {self.step} saved to {self.checkpoint_path()}")
        finally:
            bar.close()
            self.log.close()
            if self._prefetcher is not None:
                self._prefetcher.close()
                self._prefetcher = None
            if self._ledger is not None:
                self._ledger.close()
                self._ledger = None
        self.skipped_samples = [s for part in gather_objects(self.world, self.reader.skipped, "the skipped samples")
                                for s in part or ()]
        if self.world.rank != 0:
            return {}
        return summarize(self.log.records, warmup=warmup)

    def check_schedule_agrees(self) -> None:
        """All-gather every rank's schedule fingerprint; raise :class:`~omnibal.errors.ScheduleMismatch` naming
        the ranks whose schedule differs (every rank raises the same). Runs before a schedule's first step."""
        fingerprints = gather_objects(self.world, self.schedule_id, "the schedule check")
        ScheduleMismatch.check(fingerprints, source=getattr(self.schedule, "source", "schedule"),
                               describe=self.world.where_rank)
        self._agreed_id = self.schedule_id
