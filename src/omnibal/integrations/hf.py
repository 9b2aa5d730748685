"""Hugging Face ``Trainer`` / accelerate integration: train a HF VLM on omnibal's balanced packs.

:class:`OmnibalTrainer` is a ``transformers.Trainer`` whose training DataLoader takes its micro-batches from
:class:`~omnibal.data.sampler.BalancedBatchSampler` (one pack per micro-batch, ``gradient_accumulation_steps``
micro-batches per optimizer step, each rank its own row of the schedule), keeps the sampler's epoch equal to the
Trainer's, writes the sampler state into every checkpoint folder and checks it on resume. Its collator,
:class:`HFPackCollator` (:mod:`omnibal.integrations.hf_collate`, re-exported here), packs a micro-batch into one
batch the HF forward takes. A :class:`~omnibal.data.realdata.RealDataset` is checked against the model when the
trainer is built (``RealDataset.check_model``): samples cut for another tile size, token count or marker layout
are refused by field. See ``docs/hf.md``.
Written against transformers 5.23 / accelerate 1.15 (the internals relied on are listed in ``docs/hf.md``).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np
import torch

from omnibal.cost.hf_spec import SUPPORTED as HF_ADAPTERS
from omnibal.data.sampler import BalancedBatchSampler
from omnibal.errors import InputError
from omnibal.integrations.hf_checkpoints import STATE_FILE, STATE_FORMAT, checkpoint_problem, newest_complete
from omnibal.integrations.hf_collate import (
    FLASH_KWARGS,
    SAMPLE_INDEX_KEY,
    AttentionMode,
    HFPackCollator,
    block_causal_mask,
)
from omnibal.outputs import write_text

try:
    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, seed_worker
    from transformers.utils import SAFE_WEIGHTS_NAME
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("omnibal.integrations.hf needs transformers and accelerate: pip install 'omnibal[hf]'") from exc

__all__ = ["AttentionMode", "FLASH_KWARGS", "SAMPLE_INDEX_KEY", "STATE_FILE", "HFPackCollator", "OmnibalTrainer",
           "block_causal_mask"]



def _saved_to_model_keys(model) -> dict[str, str] | None:
    """Checkpoint key -> model key for every state-dict entry, when ``save_pretrained`` only renames keys
    (None when it converts tensors or the model has no conversion mapping)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - other transformers versions
        return None
    own = model.state_dict()
    by_id: dict[int, str] = {}
    for key, tensor in own.items():
        by_id.setdefault(id(tensor), key)
    try:
        saved = revert_weight_conversion(model, dict(own))
    except Exception:  # noqa: BLE001 - a model this cannot handle (PEFT, ...): keep Trainer's own loading
        return None
    if any(id(t) not in by_id for t in saved.values()):
        return None
    return {key: by_id[id(t)] for key, t in saved.items()}


def _epoch_total(sampler: BalancedBatchSampler) -> int:
    """Micro-batches of this rank in the sampler's current epoch, wherever it stands in it."""
    schedule, _ = sampler.schedule()
    return schedule.num_steps * sampler.num_microbatches


def _state_error(path, exc: InputError) -> InputError:
    return InputError(exc.message, source=str(path), record=exc.record, field=exc.field)


class _OmnibalCallback(TrainerCallback):
    """Keeps the sampler in step with the Trainer (epoch, trained micro-batches, checkpoints)."""

    def __init__(self, trainer: OmnibalTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._check_resume(state)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.trainer._begin_epoch(state)

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._end_step()

    def on_save(self, args, state, control, **kwargs):
        self.trainer._save_sampler_state(state)

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._close_ledger()


class OmnibalTrainer(Trainer):
    """``transformers.Trainer`` that trains on omnibal's balanced packs (see ``docs/hf.md``).

    Each process gets ``BalancedBatchSampler(stats, dp_rank=args.process_index, dp_size=args.world_size,
    num_microbatches=args.gradient_accumulation_steps, seed=args.data_seed or args.seed, config=balance_config)``
    as the ``batch_sampler`` of its training DataLoader: one pack per micro-batch, so
    ``per_device_train_batch_size`` must be 1 (it is meaningless here). The pack collator defaults to
    ``HFPackCollator.for_model(model, sample_index=True)``.

    ``stats``          per-sample sizes (:class:`~omnibal.stats.table.SampleStats`), row i = ``train_dataset[i]``;
                       default ``train_dataset.stats``.
    ``balance_config`` :class:`~omnibal.data.balance.api.BalanceConfig` of the sampler (default: omnibal's).
    ``ledger_path``    optional ledger file (``{rank}`` in it is replaced by the process index), in the format of
                       :mod:`omnibal.train.ledger`: a ``start`` event per run, then one ``step`` event per trained
                       micro-batch with ``rank``, ``micro`` and ``epoch`` (``trained_counts`` counts it).
    """

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, *more, stats=None,
                 balance_config=None, ledger_path: str | os.PathLike | None = None, **kwargs) -> None:
        if data_collator is None:
            if model is None:
                raise InputError("pass a model (model_init is not supported) or a data_collator", source="model")
            data_collator = HFPackCollator.for_model(model, sample_index=True)
        super().__init__(model, args, data_collator, train_dataset, *more, **kwargs)
        a = self.args
        if a.per_device_train_batch_size != 1:
            raise InputError(f"must be 1 with OmnibalTrainer (a micro-batch is one balanced pack), got "
                             f"{a.per_device_train_batch_size}", source="TrainingArguments",
                             field="per_device_train_batch_size")
        processes = torch.distributed.get_world_size() if torch.distributed.is_initialized() else a.world_size
        if processes != a.world_size:  # each process would train the whole schedule as the only rank
            raise InputError(f"{processes} processes but the Trainer runs {a.world_size} (parallel mode "
                             f"{a.parallel_mode.value}); on CPU set use_cpu=True", source="TrainingArguments",
                             field="use_cpu")
        for name in ("dispatch_batches", "split_batches"):
            if getattr(a.accelerator_config, name, None):
                raise InputError("must be off: every process builds its own micro-batches", source="accelerator_config",
                                 field=name)
        for name, size in (("tp_size", self.get_tp_size()), ("cp_size", self.get_cp_size()),
                           ("sp_size", self.get_sp_size())):
            if size != 1:
                raise InputError(f"only data parallelism is supported, got {name}={size}", source="TrainingArguments",
                                 field=name)
        if isinstance(self.data_collator, HFPackCollator):
            self.data_collator.check_model(self.model)
        kind = getattr(getattr(self.model, "config", None), "model_type", None)
        if kind in HF_ADAPTERS and callable(getattr(train_dataset, "check_model", None)):  # a RealDataset
            train_dataset.check_model(self.model)  # samples cut for this model, or an InputError naming the field
        if ledger_path is not None and not (isinstance(self.data_collator, HFPackCollator)
                                            and self.data_collator.sample_index):
            raise InputError("a ledger needs HFPackCollator(sample_index=True)", source="data_collator",
                             field="sample_index")
        if stats is None and train_dataset is not None:
            stats = getattr(train_dataset, "stats", None)
        if train_dataset is not None:
            if stats is None:
                raise InputError("pass stats= or give the dataset a .stats (SampleStats)", source="stats")
            if len(stats) != len(train_dataset):
                raise InputError(f"{len(stats)} stats rows for {len(train_dataset)} samples", source="stats",
                                 field="num_samples")
        self.stats = stats
        self.balance_config = balance_config
        self.ledger_path = None if ledger_path is None else str(ledger_path).format(rank=a.process_index)
        self.omnibal_sampler: BalancedBatchSampler | None = None
        self._epoch_length: int | None = None
        self._resume_dir: str | None = None
        self._pending_skip = 0
        self._ledger_slot: tuple[int, int] = (-1, 0)
        self._ledger = None
        self.skipped_checkpoints: list[str] = []
        """Checkpoint folders ``train(resume_from_checkpoint=True)`` skipped as incomplete, newest first."""
        self.add_callback(_OmnibalCallback(self))

    # -- data ---------------------------------------------------------------------------------------
    def make_sampler(self) -> BalancedBatchSampler:
        """This process's sampler (a fresh one, at epoch 0)."""
        a = self.args
        seed = a.data_seed if a.data_seed is not None else a.seed
        return BalancedBatchSampler(self.stats, dp_rank=a.process_index, dp_size=a.world_size,
                                    num_microbatches=a.gradient_accumulation_steps, seed=seed,
                                    config=self.balance_config)

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None or self.stats is None:
            raise InputError("training needs a train_dataset and its stats", source="train_dataset")
        a = self.args
        sampler = self.make_sampler()
        params = dict(batch_sampler=sampler, collate_fn=self.data_collator, num_workers=a.dataloader_num_workers,
                      pin_memory=a.dataloader_pin_memory, persistent_workers=a.dataloader_persistent_workers,
                      multiprocessing_context=a.dataloader_multiprocessing_context,
                      prefetch_factor=a.dataloader_prefetch_factor,
                      worker_init_fn=partial(seed_worker, num_workers=a.dataloader_num_workers, rank=a.process_index))
        # no RemoveColumnsCollator: the pack collator reads `index` and emits only model inputs
        dataloader = self.accelerator.prepare(DataLoader(self.train_dataset, **params))
        # accelerate wraps a batch sampler in BatchSamplerShard, which would deal its batches out to the processes
        # a second time; ours is already per rank, so make the wrapper a passthrough (as Trainer does for its own
        # BatchRebalanceSampler).
        shard = getattr(dataloader, "batch_sampler", None)
        if shard is not sampler:
            if getattr(shard, "batch_sampler", None) is not sampler or not hasattr(shard, "num_processes"):
                raise InputError(f"accelerate wrapped the batch sampler unexpectedly ({type(shard).__name__})",
                                 source="accelerator_config")
            shard.num_processes, shard.process_index = 1, 0
        if len(dataloader) != _epoch_total(sampler):
            raise InputError(f"the prepared DataLoader has {len(dataloader)} micro-batches, the sampler "
                             f"{_epoch_total(sampler)}", source="accelerator_config")
        self.omnibal_sampler = sampler
        self._epoch_length = _epoch_total(sampler)
        return dataloader

    # -- epochs, steps, checkpoints (called by _OmnibalCallback) ------------------------------------
    def _steps_per_epoch(self) -> int:
        m = self.args.gradient_accumulation_steps
        return max(self._epoch_length // m + int(self._epoch_length % m > 0), 1)  # as Trainer computes it

    def _begin_epoch(self, state) -> None:
        sampler = self.omnibal_sampler
        epoch = state.global_step // self._steps_per_epoch()  # the Trainer's own epoch (epochs_trained)
        sampler.set_epoch(epoch)
        if _epoch_total(sampler) != self._epoch_length:
            raise InputError(f"epoch {epoch} has {_epoch_total(sampler)} micro-batches per rank, epoch 0 had "
                             f"{self._epoch_length}; Trainer needs one epoch length for the whole run",
                             source="balance_config", field="num_steps")

    def _end_step(self) -> None:
        n = int(getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps))
        self.omnibal_sampler.mark_trained(n + self._pending_skip)  # + what Trainer skipped on resume
        self._pending_skip = 0

    def _save_sampler_state(self, state) -> None:
        folder = Path(self.args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        record = {"format": STATE_FORMAT, "rank": self.args.process_index, "world_size": self.args.world_size,
                  "global_step": state.global_step, "sampler": self.omnibal_sampler.state_dict()}
        write_text(folder / STATE_FILE.format(rank=self.args.process_index), json.dumps(record, sort_keys=True))

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest *complete* checkpoint folder
        (:mod:`omnibal.integrations.hf_checkpoints`), naming every newer one it skips on stderr (process 0) and
        in ``skipped_checkpoints``; a folder given by name must be complete, or an InputError says what it lacks."""
        checks = dict(world_size=self.args.world_size, weights=not (self.is_fsdp_enabled or self.is_deepspeed_enabled),
                      optimizer=not self.args.save_only_model)
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            resume_from_checkpoint, self.skipped_checkpoints = newest_complete(self.args.output_dir, **checks)
            if self.args.process_index == 0:
                for line in self.skipped_checkpoints:
                    print(f"OmnibalTrainer: {line}", file=sys.stderr, flush=True)
            if resume_from_checkpoint is None:
                raise InputError(f"no complete checkpoint to resume from ({len(self.skipped_checkpoints)} incomplete "
                                 "skipped)", source=str(self.args.output_dir), field="resume_from_checkpoint")
            resume_from_checkpoint = str(resume_from_checkpoint)
        elif resume_from_checkpoint:
            why = checkpoint_problem(resume_from_checkpoint, **checks)
            if why is not None:
                raise InputError(f"not a complete checkpoint: {why}", source=str(resume_from_checkpoint),
                                 field="resume_from_checkpoint")
        self._resume_dir = resume_from_checkpoint or None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _check_resume(self, state) -> None:
        """On resume: the checkpoint's sampler state must be this sampler's (stats, world, seed, config) at the
        position Trainer resumes from; Trainer then skips the trained micro-batches itself."""
        self._pending_skip = 0
        if self._resume_dir is None:
            return
        a = self.args
        if a.ignore_data_skip:
            raise InputError("OmnibalTrainer resumes the epoch where it stopped; ignore_data_skip would retrain it",
                             source="TrainingArguments", field="ignore_data_skip")
        path = Path(self._resume_dir) / STATE_FILE.format(rank=a.process_index)
        if not path.is_file():
            raise InputError("no omnibal sampler state in the checkpoint (not written by OmnibalTrainer, or by a "
                             "run with fewer processes)", source=str(path))
        try:
            record = json.loads(path.read_text())
            saved = record["sampler"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InputError(f"unreadable sampler state: {exc}", source=str(path), field="sampler") from None
        if record.get("world_size") != a.world_size:
            raise InputError(f"written by {record.get('world_size')} processes, this run has {a.world_size}",
                             source=str(path), field="world_size")
        probe = self.make_sampler()
        try:
            probe.load_state_dict(saved)
        except InputError as exc:
            raise _state_error(path, exc) from None
        if saved.get("remainder") is not None:
            raise InputError("sampler state is from a resharded epoch; Trainer cannot resume inside one",
                             source=str(path), field="remainder")
        epoch, done = int(saved["epoch"]), int(saved["consumed_microbatches"])
        if done >= _epoch_total(probe):  # the end of an epoch is the start of the next
            epoch, done = epoch + 1, 0
        steps = self._steps_per_epoch()
        want = (state.global_step // steps, (state.global_step % steps) * a.gradient_accumulation_steps)
        if (epoch, done) != want:
            raise InputError(f"sampler state is at epoch {epoch} after {done} micro-batches, the Trainer state "
                             f"(global_step {state.global_step}) at epoch {want[0]} after {want[1]}",
                             source=str(path), field="consumed_microbatches")
        self._pending_skip = done

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """transformers 5.23 saves VLM checkpoints in the original (hub) key format (``save_pretrained`` reverts
        the key renaming ``from_pretrained`` applies) but ``Trainer._load_from_checkpoint`` loads them with plain
        ``load_state_dict(strict=False)``: every LLaVA / InternVL weight is silently skipped on resume
        (transformers issue #43701). Rename the keys back the way ``save_pretrained`` renamed them."""
        target = self.model if model is None else model
        path = Path(resume_from_checkpoint) / SAFE_WEIGHTS_NAME
        keys = None
        if path.is_file() and not (self.is_fsdp_enabled or self.is_deepspeed_enabled):
            keys = _saved_to_model_keys(target)
        if not keys or all(saved == own for saved, own in keys.items()):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # optional dependency (the hf extra), imported where it is used
        import safetensors.torch

        state = safetensors.torch.load_file(str(path), device="cpu")
        result = target.load_state_dict({keys.get(k, k): v for k, v in state.items()}, strict=False)
        if result.unexpected_keys:
            raise InputError(f"{len(result.unexpected_keys)} checkpoint weights match no parameter of the model, "
                             f"e.g. {result.unexpected_keys[:3]}", source=str(path), field="weights")
        shared = Counter(v.data_ptr() for v in target.state_dict().values())
        tied = {k for k, v in target.state_dict().items() if shared[v.data_ptr()] > 1}
        missing = [k for k in result.missing_keys if k not in tied]
        if missing:
            raise InputError(f"{len(missing)} parameters are not in the checkpoint, e.g. {missing[:3]}",
                             source=str(path), field="weights")

    # -- forward ------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, *args, **kwargs):
        indices = inputs.pop(SAMPLE_INDEX_KEY, None)
        if indices is not None and self.ledger_path is not None and model.training:
            self._write_ledger(indices)
        return super().compute_loss(model, inputs, *args, **kwargs)

    def _write_ledger(self, indices: torch.Tensor) -> None:
        step = self.state.global_step
        micro = self._ledger_slot[1] + 1 if self._ledger_slot[0] == step else 0
        self._ledger_slot = (step, micro)
        if self._ledger is None:  # this run's start: the step it trains first is the step it resumed at
            from omnibal.train.ledger import LedgerWriter

            self._ledger = LedgerWriter(self.ledger_path, {"resumed_at": step, "rank": self.args.process_index,
                                                           "processes": self.args.world_size})
        rows = [int(i) for i in indices.tolist()]
        keys = [int(k) for k in np.asarray(self.stats.keys)[rows]]
        self._ledger.step(step, keys, rows, rank=self.args.process_index, micro=micro,
                          epoch=self.omnibal_sampler.epoch)

    def _close_ledger(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    def _track_num_input_tokens(self, inputs):
        # a pack has no padding: every token counts ("all" and "non_padding" agree); Trainer's "non_padding" would
        # sum the 4-D mask's T x T entries or drop real tokens equal to the pad id
        if self.args.include_num_input_tokens_seen == "no" or "input_ids" not in inputs:
            return super()._track_num_input_tokens(inputs)
        tokens = torch.as_tensor(inputs["input_ids"].numel(), device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(tokens).sum().item()
