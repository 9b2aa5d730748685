"""Hugging Face ``Trainer`` / accelerate integration: train a HF VLM on omnibal's balanced packs.

:class:`HFPackCollator` turns a pack (a list of samples in omnibal's sample format, see
:mod:`omnibal.data.collate`) into one packed batch a HF VLM's ``forward`` accepts (LLaVA, InternVL and other
models that put image features into ``image_token_id`` slots of a Llama / Qwen2-style decoder):

``input_ids``     int64 [1, sum T]: the samples one after another, no padding.
``position_ids``  int64 [1, sum T]: restart at 0 in every sample, so RoPE sees each sample as if it ran alone.
``labels``        int64 [1, sum T]: the samples' unshifted labels with the FIRST token of every sample (and every
                  image token) set to -100. HF shifts labels inside its loss (position t predicts ``labels[t+1]``);
                  without this the last token of sample k would be trained to predict the first token of
                  sample k+1.
``pixel_values``  float [tiles, 3, S, S]: the tiles of the samples that have image tokens, in sample order. A
                  text-only sample's dummy tile is dropped (the key is absent when no sample has image tokens).
attention         ``attention="mask"`` (default): ``attention_mask`` [1, 1, T, T], block-diagonal causal (a token
                  sees the earlier tokens of its own sample only), bool (True = attend; sdpa only) or additive
                  float (0 / dtype min; eager and sdpa). transformers passes a 4-D mask through unchanged
                  (``masking_utils._preprocess_mask_arguments``). ``attention="flash"``: no mask, but
                  ``cu_seq_lens_q/k`` (int32 [n + 1]) and ``max_length_q/k`` (int): the varlen kwargs transformers'
                  flash-attention path reads (``modeling_flash_attention_utils.FlashAttentionKwargs``).
``omnibal_sample_index``  int64 [n], only with ``sample_index=True``: the samples' dataset indices.
                  :class:`OmnibalTrainer` removes it before the forward (a plain ``Trainer`` would not).

:class:`OmnibalTrainer` is a ``transformers.Trainer`` whose training DataLoader takes its micro-batches from
:class:`~omnibal.data.sampler.BalancedBatchSampler` (one pack per micro-batch, ``gradient_accumulation_steps``
micro-batches per optimizer step, each rank its own row of the schedule), keeps the sampler's epoch equal to the
Trainer's, writes the sampler state into every checkpoint folder and checks it on resume. See ``docs/hf.md``.
Written against transformers 5.23 / accelerate 1.15 (the internals relied on are listed in ``docs/hf.md``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Sequence

import torch

from omnibal.data.collate import IGNORE_INDEX
from omnibal.data.sampler import BalancedBatchSampler
from omnibal.errors import InputError
from omnibal.validate import check_positive_int

try:
    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, seed_worker
    from transformers.utils import SAFE_WEIGHTS_NAME
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("omnibal.integrations.hf needs transformers and accelerate: pip install 'omnibal[hf]'") from exc

SAMPLE_INDEX_KEY = "omnibal_sample_index"
"""Batch key holding the dataset indices of a pack (``HFPackCollator(sample_index=True)``)."""
STATE_FILE = "omnibal_sampler_rank{rank}.json"
"""Per-rank sampler state written into every checkpoint folder."""
STATE_FORMAT = "omnibal.hf_sampler/1"
ATTENTION_MODES = ("mask", "flash")
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


# ------------------------------------------------------------------------------------------------ collator


def block_causal_mask(lengths: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[1, 1, T, T] mask of a pack of sequences of ``lengths``: causal inside each sequence, nothing across.
    ``dtype=torch.bool``: True where attention is allowed; a float dtype: additive (0 allowed, dtype min not)."""
    lengths_t = torch.as_tensor(list(lengths), dtype=torch.int64)
    seg = torch.repeat_interleave(torch.arange(len(lengths_t)), lengths_t)
    pos = torch.arange(len(seg))
    allowed = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
    if dtype == torch.bool:
        return allowed[None, None]
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _attn_implementation(model) -> str | None:
    """The language model's attention implementation (what the packed sequence goes through)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)


class HFPackCollator:
    """Callable ``collate(samples) -> dict`` for a HF VLM (see the module docstring for the keys).

    ``image_token_id``  the model's image slot id (``config.image_token_id``); None: a text-only model.
    ``attention``       ``"mask"`` (4-D block-diagonal causal mask) or ``"flash"`` (flash-attention varlen kwargs).
    ``mask_dtype``      ``torch.bool`` (sdpa only: eager would *add* it) or a float dtype (additive; use the
                        model's dtype for eager). Default float32, right for both eager and sdpa.
    ``tokens_per_tile`` when given, every sample with image tokens must have ``tiles x tokens_per_tile`` of them.
    ``sample_index``    add ``omnibal_sample_index`` (the samples' ``index``) to the batch.
    """

    def __init__(self, *, image_token_id: int | None, attention: str = "mask",
                 mask_dtype: torch.dtype = torch.float32, tokens_per_tile: int | None = None,
                 sample_index: bool = False, source: str = "HFPackCollator") -> None:
        if attention not in ATTENTION_MODES:
            raise InputError(f"unknown attention {attention!r}; choose one of {ATTENTION_MODES}", source=source,
                             field="attention")
        if mask_dtype != torch.bool and not mask_dtype.is_floating_point:
            raise InputError(f"mask_dtype must be torch.bool or a float dtype, got {mask_dtype}", source=source,
                             field="mask_dtype")
        if tokens_per_tile is not None:
            check_positive_int(tokens_per_tile, "tokens_per_tile", source=source)
        self.image_token_id = None if image_token_id is None else int(image_token_id)
        self.attention = attention
        self.mask_dtype = mask_dtype
        self.tokens_per_tile = tokens_per_tile
        self.sample_index = bool(sample_index)
        self.source = source

    @classmethod
    def for_model(cls, model, **overrides) -> HFPackCollator:
        """The collator a HF model needs: its ``image_token_id``; a bool mask for sdpa, an additive mask in the
        model's dtype for eager, varlen kwargs for ``flash_attention_*``."""
        config = getattr(model, "config", None)
        if config is None:
            raise InputError("not a Hugging Face model (no .config)", source="model")
        image_token_id = getattr(config, "image_token_id", None)
        if image_token_id is None:
            image_token_id = getattr(config, "image_token_index", None)
        impl = _attn_implementation(model)
        if impl is not None and impl.startswith("flash_attention"):
            kwargs = dict(attention="flash")
        elif impl == "sdpa":
            kwargs = dict(attention="mask", mask_dtype=torch.bool)
        elif impl in (None, "eager"):
            kwargs = dict(attention="mask", mask_dtype=getattr(model, "dtype", torch.float32))
        else:
            raise InputError(f"attention implementation {impl!r} is not supported (eager, sdpa, flash_attention_*); "
                             "build HFPackCollator yourself if it reads a 4-D mask or the varlen kwargs",
                             source="model.config", field="attn_implementation")
        kwargs.update(overrides)
        return cls(image_token_id=image_token_id, **kwargs)

    def check_model(self, model) -> None:
        """Refuse a model whose attention would ignore (or misread) what this collator produces."""
        impl = _attn_implementation(model)
        if impl is None:
            return
        flash = impl.startswith("flash_attention")
        if flash and self.attention == "mask":
            raise InputError(f"the model uses {impl}, which takes no 4-D mask; use attention='flash'",
                             source=self.source, field="attention")
        if impl in ("eager", "sdpa") and self.attention == "flash":
            raise InputError(f"the model uses {impl}, which ignores the varlen kwargs; use attention='mask'",
                             source=self.source, field="attention")
        if impl == "eager" and self.mask_dtype == torch.bool:
            raise InputError("eager attention adds the mask to the scores: a bool mask would be read as 0/1; "
                             "use a float mask_dtype", source=self.source, field="mask_dtype")

    def _check(self, pos: int, sample: dict) -> tuple[int, int, bool]:
        """(index, tokens, has image tokens) of one sample; InputError naming it when malformed."""
        idx = int(sample.get("index", pos))
        where = dict(source=self.source, record=f"sample {idx}")
        for key in ("input_ids", "labels", "pixel_values"):
            if not isinstance(sample.get(key), torch.Tensor):
                raise InputError("missing or not a tensor", field=key, **where)
        ids, labels, pix = sample["input_ids"], sample["labels"], sample["pixel_values"]
        if ids.ndim != 1 or len(ids) == 0 or labels.shape != ids.shape:
            raise InputError(f"input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)} must be equal, "
                             "non-empty and 1-D", field="labels", **where)
        if pix.ndim != 4 or pix.shape[1] != 3:
            raise InputError(f"pixel_values shape {tuple(pix.shape)} is not [tiles, 3, S, S]", field="pixel_values",
                             **where)
        num_img = 0 if self.image_token_id is None else int((ids == self.image_token_id).sum())
        if num_img and (pix.shape[0] == 0 or (self.tokens_per_tile is not None
                                              and num_img != pix.shape[0] * self.tokens_per_tile)):
            raise InputError(f"{num_img} image tokens but {pix.shape[0]} tiles x {self.tokens_per_tile} tokens",
                             field="input_ids", **where)
        return idx, int(ids.shape[0]), num_img > 0

    def __call__(self, samples: Sequence[dict]) -> dict:
        if len(samples) == 0:
            raise InputError("empty pack", source=self.source)
        ids, labels, positions, pixels, lengths, indices = [], [], [], [], [], []
        for pos, s in enumerate(samples):
            idx, n, has_image = self._check(pos, s)
            x = s["input_ids"].to(torch.int64)
            y = s["labels"].to(torch.int64).clone()
            if self.image_token_id is not None:
                y[x == self.image_token_id] = IGNORE_INDEX  # image slots are never targets
            y[0] = IGNORE_INDEX  # HF shifts: the previous sample's last token must not predict this one
            ids.append(x)
            labels.append(y)
            positions.append(torch.arange(n, dtype=torch.int64))
            if has_image:
                pixels.append(s["pixel_values"])
            lengths.append(n)
            indices.append(idx)
        sizes = {tuple(p.shape[1:]) for p in pixels}
        if len(sizes) > 1:
            raise InputError(f"tiles of different sizes in one pack: {sorted(sizes)}", source=self.source,
                             record=f"samples {indices}", field="pixel_values")
        batch = {"input_ids": torch.cat(ids)[None], "position_ids": torch.cat(positions)[None],
                 "labels": torch.cat(labels)[None]}
        if pixels:
            batch["pixel_values"] = torch.cat(pixels)
        if self.attention == "mask":
            batch["attention_mask"] = block_causal_mask(lengths, self.mask_dtype)
        else:
            cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=max(lengths),
                         max_length_k=max(lengths))
        if self.sample_index:
            batch[SAMPLE_INDEX_KEY] = torch.tensor(indices, dtype=torch.int64)
        return batch


# ------------------------------------------------------------------------------------------------ trainer


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
    ``ledger_path``    optional JSONL file (``{rank}`` in it is replaced by the process index): one line per trained
                       micro-batch, ``{"rank", "epoch", "step", "micro", "indices"}``.
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
        path = folder / STATE_FILE.format(rank=self.args.process_index)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, sort_keys=True))
        os.replace(tmp, path)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise InputError("no checkpoint found to resume from", source=str(self.args.output_dir))
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
        line = {"rank": self.args.process_index, "epoch": self.omnibal_sampler.epoch, "step": step, "micro": micro,
                "indices": [int(i) for i in indices.tolist()]}
        with open(self.ledger_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")

    def _track_num_input_tokens(self, inputs):
        # a pack has no padding: every token counts ("all" and "non_padding" agree); Trainer's "non_padding" would
        # sum the 4-D mask's T x T entries or drop real tokens equal to the pad id
        if self.args.include_num_input_tokens_seen == "no" or "input_ids" not in inputs:
            return super()._track_num_input_tokens(inputs)
        tokens = torch.as_tensor(inputs["input_ids"].numel(), device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(tokens).sum().item()
