"""Checkpoints of the training loop: what a step's checkpoint records, writing it, and resuming from the
newest valid one, also on another DP size (the rest of the epoch re-balanced, :mod:`omnibal.train.reshard`).

A mixin of :class:`omnibal.train.loop.Trainer` (kept apart so each module stays readable); it uses the
trainer's world, schedule, stage module and optimizer, and the world's collectives
(:mod:`omnibal.train.collectives`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnibal.errors import InputError
from omnibal.train import checkpoint as ckpt
from omnibal.train.collectives import barrier, broadcast_object, gather_objects
from omnibal.train.feed import fixed_buffer, schedule_fingerprint
from omnibal.train.reshard import balance_record, reshard_schedule
from omnibal.train.reshard_kinds import hbp_of, rebuild, rest_of_epoch
from omnibal.train.sp import step_degrees


class CheckpointResume:
    """Checkpoint writing and resuming for :class:`omnibal.train.loop.Trainer`."""

    schedule_stats = None
    """The statistics the run's schedules are balanced from, when not the dataset's (a ``--schedule-file`` was
    balanced from the statistics as their file has them): what a resharding resume balances the rest with."""
    reshard_source = None
    """The schedule an earlier world trained, when this run was given it (a ``--schedule-file`` made for another
    DP size) and trains another: what a resharding resume finds the checkpoint's untrained samples in."""

    def _world_doc(self) -> dict:
        return {"dp_size": self.world.dp_size, "pp_size": self.world.pp_size}

    def sampler_state(self) -> dict:
        """The data position a checkpoint records: the next step, i.e. the steps *trained* so far. Stage 0
        reads a step's micro-batches from the schedule inside that step (no DataLoader prefetching ahead)
        and ``self.step`` advances only after the optimizer step, so nothing fetched-but-untrained is
        counted (unlike a sampler behind a DataLoader with workers; see ``BalancedBatchSampler.mark_trained``)."""
        state = {"next_step": self.step, "schedule_fingerprint": self.schedule_id}
        record = balance_record(self.schedule)
        if record is not None:  # lets a resume on another dp size rebuild this stream (reshard=True)
            state["balance"] = record
        if getattr(self.schedule, "record", None) is not None:  # random micro-batches, an HBP or random remainder
            state["rebuild"] = self.schedule.record
        return state

    def checkpoint_path(self) -> Path:
        """The folder :meth:`save_checkpoint` writes for the current step."""
        return ckpt.step_dir(self.checkpoint_dir, self.step)

    def save_checkpoint(self) -> None:
        """Write this step's checkpoint: each stage's dp-rank-0 writes its file, rank 0 the manifest."""
        w = self.world
        record = None
        if w.dp_rank == 0:
            record = ckpt.write_stage_file(self.checkpoint_dir, self.step, w.pp_rank, model=self.stage_module,
                                           optimizer=self.optimizer)
        records = gather_objects(self.world, record, "checkpoint")
        if w.rank == 0:
            ckpt.write_manifest(self.checkpoint_dir, self.step, stage_records=[r for r in records if r is not None],
                                world=self._world_doc(), model_id=self.model_id,
                                stage_layers=[list(r) for r in self.layout.ranges], sampler=self.sampler_state(),
                                extra={"mode": self.mode})
        barrier(self.world, "checkpoint")
        if self.on_checkpoint is not None:
            self.on_checkpoint(self.step)

    def maybe_resume(self, checkpoint_dir: str | None = None, *, reshard: bool = False) -> bool:
        """Load the newest valid checkpoint (corrupt newer ones are skipped and listed in
        ``skipped_checkpoints``); returns False when there is none. Incompatible ones raise InputError.

        ``reshard=True`` also accepts a checkpoint written with another DP size (same pp and stage layers):
        each stage loads its weights and optimizer state (replicated over DP), and the samples the old world
        had not trained yet are re-balanced for this world (:mod:`omnibal.train.reshard`); the schedule
        becomes that remainder, numbered from the checkpoint's ``next_step``, and :meth:`run` ends with it."""
        root = checkpoint_dir or self.checkpoint_dir
        w = self.world
        if reshard and self.step_sp.max(initial=1) > 1 and hbp_of(self.schedule) is None:
            raise InputError("a resume on another dp size re-balances the levels of a multi-level (HBP) schedule "
                             "or one level for plain DP; this run splits one level by --sp-degree", source="--reshard",
                             field="reshard")
        decision: dict[str, Any] = {}
        if w.rank == 0:
            try:
                decision = self._resume_decision(root, reshard)
            except InputError as exc:
                decision = {"error": exc.message, "source": exc.source, "field": exc.field}
        decision = broadcast_object(self.world, decision, "resume")
        if "error" in decision:
            raise InputError(decision["error"], source=decision["source"], field=decision["field"])
        self.skipped_checkpoints = decision["skipped"]
        for line in self.skipped_checkpoints:
            self.notify(line)
        if decision["path"] is None:
            if reshard and self.reshard_source is not None:
                self.notify(f"no checkpoint in {root}: training the epoch of {self.reshard_source.source} re-balanced "
                            f"for dp {w.dp_size} from its start")
            return False
        ckpt.load_stage_file(Path(decision["path"]), decision["manifest"], w.pp_rank, model=self.stage_module,
                             optimizer=self.optimizer, map_location=w.device)
        if decision.get("schedule") is not None:
            self._use_resharded(decision["schedule"])
        self.step = int(decision["manifest"]["sampler"]["next_step"])
        self.resumed_from = decision["path"]
        how = "" if not self.resharded else (
            f", the rest of the epoch re-balanced for dp {w.dp_size} (steps {self.step}..{self.schedule.num_steps - 1})"
            if self.step < self.schedule.num_steps else ", at the end of its epoch: nothing is left to train")
        self.notify(f"resumed from {decision['path']} at step {self.step}{how}")
        for line in decision.get("notes", ()):
            self.notify(line)
        return True

    def _resume_decision(self, root, reshard: bool) -> dict:
        """Global rank 0: the checkpoint to resume (checked against this run) and, when resharding, the
        re-balanced rest of its epoch."""
        found = ckpt.find_latest_valid(root, world=self._world_doc(), model_id=self.model_id,
                                       stage_layers=[list(r) for r in self.layout.ranges], any_dp_size=reshard)
        decision = {"path": str(found.path) if found.path else None, "manifest": found.manifest,
                    "skipped": found.skipped}
        if found.manifest is None:
            return decision
        sampler = found.manifest["sampler"]
        fp, next_step = sampler.get("schedule_fingerprint"), sampler["next_step"]
        if reshard and (fp != self.schedule_id or found.manifest["world"] != self._world_doc()):
            decision["schedule"], decision["notes"] = self._rest_of_epoch(found.manifest, str(found.path))
        elif fp != self.schedule_id:
            raise InputError(f"checkpoint was trained on schedule {fp}, this run uses {self.schedule_id}: "
                             f"resuming would not continue the same sample stream", source=str(found.path),
                             field="sampler")
        elif next_step > self.schedule.num_steps:
            raise InputError(f"next_step {next_step} is past the end of the schedule ({self.schedule.num_steps} "
                             f"steps)", source=str(found.path), field="sampler.next_step")
        return decision

    def _rest_of_epoch(self, manifest: dict, source: str) -> tuple:
        """Global rank 0, resharding: the schedule the checkpoint was trained on (this run's own, the schedule
        file it was given for the old world, or rebuilt from the checkpoint's record), and the rest of its epoch
        after ``next_step`` for this world, of the same kind; with the notices it needs said."""
        sampler = manifest["sampler"]
        fp, next_step = sampler.get("schedule_fingerprint"), int(sampler["next_step"])
        stats = self.schedule_stats if self.schedule_stats is not None else getattr(self.dataset, "stats", None)
        if stats is None:
            raise InputError("resharding needs the dataset's statistics on global rank 0", source=source,
                             field="dataset")
        old = next((s for s in (self.reshard_source,) if s is not None and schedule_fingerprint(s) == fp), None)
        if old is None and isinstance(sampler.get("rebuild"), dict):
            old = rebuild(sampler["rebuild"], stats, source=source)
            if schedule_fingerprint(old) != fp:
                raise InputError("rebuilding the checkpoint's schedule from its record gave another schedule (other "
                                 "stats or omnibal version?): cannot tell which samples are left", source=source,
                                 field="sampler.schedule_fingerprint")
        if old is not None and old.dp_size == self.world.dp_size and \
                getattr(old, "num_microbatches", None) == self.num_microbatches:
            return old, []  # its own world: continue the checkpoint's stream (e.g. an earlier remainder)
        rest = None if old is None else rest_of_epoch(
            old, next_step, stats, dp_size=self.world.dp_size, num_microbatches=self.num_microbatches,
            num_heads=self.spec.llm.num_heads, source=source, equal_ranks=self.mode == "online")
        if rest is not None:
            return rest
        if old is not None and balance_record(old) is not None:  # the balancer's single level, given as a file
            manifest = {**manifest, "sampler": {**sampler, "balance": balance_record(old)}}
        elif old is None and not isinstance(sampler.get("balance"), dict):
            raise InputError("the checkpoint does not record how its schedule was built (a schedule file, or "
                             "written by an older omnibal): pass the --schedule-file it was trained on (its "
                             f"fingerprint is {fp}) to re-balance the rest of its epoch", source=source,
                             field="sampler")
        return reshard_schedule(manifest, stats, dp_size=self.world.dp_size, num_microbatches=self.num_microbatches,
                                source=source, fingerprint=schedule_fingerprint), []

    def _steps_to_run(self, num_steps: int | None) -> int:
        """The step to stop at. After a reshard the epoch has the new world's length, which the caller could
        not know: a request past its end stops at the end, and one that leaves nothing of it to train (the
        old world's step count) is refused rather than silently training nothing."""
        source = getattr(self.schedule, "source", "schedule")
        end = self.schedule.num_steps
        if not num_steps:
            return end
        if self.resharded:
            if num_steps <= self.step < end:
                raise InputError(f"resumed at step {self.step} with the rest of the epoch re-balanced for dp "
                                 f"{self.world.dp_size} (steps {self.step}..{end - 1}); {num_steps} steps in total "
                                 f"leaves nothing to train: ask for {end} steps, or 0 for the rest of the epoch",
                                 source=source, field="num_steps")
            if num_steps < end:
                left = self._samples_in_steps(num_steps, end)
                self.notify(f"stopping at step {num_steps} of the re-balanced epoch (it ends at step {end}): "
                            f"{left} samples of steps {num_steps}..{end - 1} are not trained (--steps 0 trains "
                            f"the rest of the epoch)")
            return min(num_steps, end)
        if num_steps > end:
            raise InputError(f"{num_steps} steps requested but the schedule has {end}", source=source,
                             field="num_steps")
        return num_steps

    def _samples_in_steps(self, start: int, end: int) -> int:
        """Samples the schedule's steps ``start..end-1`` train (an SP group's packs counted once)."""
        degrees = self.step_sp
        return sum(len(self.schedule.microbatch(s, r, k)) for s in range(start, end)
                   for r in range(0, self.world.dp_size, int(degrees[s])) for k in range(int(self.step_mbs[s])))

    def _use_resharded(self, schedule) -> None:
        """Switch to the re-balanced rest of the epoch (built on global rank 0, the same on every rank). Its
        micro-batch counts are its own (levels balanced again may run other counts); the SP groups were built
        for this world's degrees, which a remainder of the same schedule file uses."""
        self._check_schedule(schedule, num_microbatches=schedule.num_microbatches)  # sets step_mbs
        degrees = set(step_degrees(schedule).tolist()) - ({1} | set(getattr(self.sp, "modules", {})))
        if degrees:
            raise InputError(f"the rest of the epoch runs SP degrees {sorted(degrees)} this run has no groups for",
                             source=schedule.source, field="level_sp")
        if self.buffer is not None and self.mode != "online":
            need = fixed_buffer(schedule, self.dataset.stats, mode=self.mode) if self.dataset is not None else None
            if need is not None and (need.tiles > self.buffer.tiles or need.tokens > self.buffer.tokens):
                raise InputError(f"the re-balanced rest of the epoch needs a ({need.tiles}, {need.tokens}) micro-batch "
                                 f"buffer, the pipeline was built for ({self.buffer.tiles}, {self.buffer.tokens})",
                                 source=schedule.source, field="buffer")
        if getattr(self, "level_recompute", None) is not None:
            self.level_recompute.check(schedule)
        self.schedule = schedule
        # step_sp follows the schedule: the remainder is numbered from the checkpoint's next_step and can be
        # longer than the fresh epoch step_sp was built for (dp 1 -> 2); a reshard runs plain DP (degree 1)
        self.step_sp = step_degrees(schedule)
        self.schedule_id = schedule_fingerprint(schedule)
        self.resharded = True
