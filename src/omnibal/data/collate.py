"""Packing collator: a pack (list of samples) -> one fixed-shape micro-batch.

Pipeline stages size their receive buffers once, so every micro-batch of a run must have the same shapes.
A micro-batch is a fixed buffer of ``num_tiles`` (Q_v) tile slots and ``num_tokens`` (Q_t) token slots;
the pack's samples are laid out one after another from the start of the buffer and the rest is padding.

Two layouts (``CollateConfig.mode``):

``pack``            (omnibal) samples are concatenated with no padding between them; attention stays inside
                    each sample (segment ids / per-sample position ids / cu_seqlens). Only the buffer's tail
                    after the last sample is padding.
``pad_to_longest``  (InternVL-style baseline) the B samples of a micro-batch are each padded to the longest
                    one, t_max, and laid out as B rows of t_max tokens. A padded row is one attention segment
                    of t_max tokens (the real tokens first, then padding, causal): the padding is *processed*
                    like real tokens, exactly the compute a padded [B, t_max] batch costs. The fixed buffer is
                    sized for the baseline's worst case (B * longest possible sample); only its tail after the
                    B rows is unused.

The model skips the buffer tail (``sizes`` below says where it starts) without changing any shape, so the
fixed buffer costs memory but no compute in either mode; what the baseline pays for is its in-row padding.

Sample format (what :mod:`omnibal.data.dataset` and :mod:`omnibal.data.realdata` yield): a dict with
``pixel_values`` float [tiles, 3, S, S], ``input_ids`` int64 [tokens] (image slots hold
``image_token_id``, ``tokens_per_tile`` of them per tile, in tile order; or none at all: a text-only sample's
*dummy* tiles run through the vision encoder, as in InternVL, but fill no slot), ``labels`` int64 [tokens]
(unshifted, Hugging Face style: the token id where the token is a target, ``IGNORE_INDEX`` elsewhere) and
``index`` (the dataset index, for error messages).

The micro-batch crosses pipeline boundaries as the *carry* ``(activation, token_meta, sizes)``:

``activation``  float; at the input it is ``pixel_values`` [1, Q_v, 3, S, S] (see :mod:`omnibal.train.stage`
                for its shape at later boundaries).
``token_meta``  int64 [1, 5, Q_t]: rows ``META_INPUT_IDS``, ``META_POSITION_IDS`` (0.. within each sample
                or padded row), ``META_SEGMENT_IDS`` (0.. per sample / row; -1 on the tail),
                ``META_LABELS`` (already shifted: the target *at* position t is the next token of the same
                sample, ``IGNORE_INDEX`` for prompt, image and padding tokens and for each sample's last
                token), ``META_IMAGE_INDEX`` (for an image slot the row in the flattened
                [Q_v * tokens_per_tile] image features that fills it, -1 for text and padding).
``sizes``       int64 [1, 2]: (active tiles, active tokens) = where the buffer tail starts.

Every tensor has a leading micro-batch dimension of 1, so ``n`` micro-batches concatenate along dim 0
into the batch ``PipelineSchedule.step`` splits back (:func:`stack_carries`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from omnibal.errors import InputError
from omnibal.validate import check_positive_int

IGNORE_INDEX = -100

META_INPUT_IDS = 0
META_POSITION_IDS = 1
META_SEGMENT_IDS = 2
META_LABELS = 3
META_IMAGE_INDEX = 4
NUM_META_ROWS = 5

SIZE_TILES = 0
SIZE_TOKENS = 1


@dataclass(frozen=True, kw_only=True)
class CollateConfig:
    """Shape and layout of the fixed micro-batch buffer."""

    num_tiles: int
    """Q_v: tile slots per micro-batch."""
    num_tokens: int
    """Q_t: token slots per micro-batch."""
    image_size: int
    """Tile side in pixels (the model's ``vision.image_size``)."""
    tokens_per_tile: int
    """LLM image tokens per tile (the model's ``llm_tokens_per_tile``)."""
    image_token_id: int
    """Token id that marks image slots in ``input_ids``."""
    pad_token_id: int = 0
    """Token id written into padding slots."""
    mode: Literal["pack", "pad_to_longest"] = "pack"
    """Layout: ``pack`` (varlen, no padding between samples) or ``pad_to_longest`` (baseline rows)."""
    source: str = "collate"
    """Name used in error messages (e.g. the dataset path)."""

    def __post_init__(self) -> None:
        for name in ("num_tiles", "num_tokens", "image_size", "tokens_per_tile"):
            check_positive_int(getattr(self, name), name, source=self.source)
        if self.mode not in ("pack", "pad_to_longest"):
            raise InputError(f"unknown mode {self.mode!r} (pack, pad_to_longest)", source=self.source,
                             field="mode")


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """One fixed-shape micro-batch (all tensors have a leading dimension of 1)."""

    pixel_values: torch.Tensor
    """float32 [1, Q_v, 3, S, S]; unused tile slots are zero."""
    token_meta: torch.Tensor
    """int64 [1, 5, Q_t] (rows ``META_*``)."""
    sizes: torch.Tensor
    """int64 [1, 2]: active tiles, active tokens."""
    tile_mask: torch.Tensor
    """bool [1, Q_v]: tile slots that hold a real tile."""
    cu_seqlens: torch.Tensor
    """int32 [num_segments + 1]: segment boundaries in the active prefix (for flash-attn varlen; variable
    length, so not part of the carry: the model derives it from the segment ids)."""
    sample_indices: tuple[int, ...]
    """Dataset indices of the samples, in buffer order."""
    num_real_tokens: int
    """Tokens of the samples themselves (no padding)."""

    @property
    def input_ids(self) -> torch.Tensor:
        return self.token_meta[:, META_INPUT_IDS]

    @property
    def position_ids(self) -> torch.Tensor:
        return self.token_meta[:, META_POSITION_IDS]

    @property
    def segment_ids(self) -> torch.Tensor:
        return self.token_meta[:, META_SEGMENT_IDS]

    @property
    def labels(self) -> torch.Tensor:
        return self.token_meta[:, META_LABELS]

    @property
    def image_index(self) -> torch.Tensor:
        return self.token_meta[:, META_IMAGE_INDEX]

    @property
    def num_targets(self) -> int:
        """Target tokens (the loss is summed over these; the trainer divides by the global count)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def carry(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The carry at the chain's input (stage 0's ``forward(*carry)``)."""
        return (self.pixel_values, self.token_meta, self.sizes)

    def to(self, device) -> MicroBatch:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(move(self.pixel_values), move(self.token_meta), move(self.sizes), move(self.tile_mask),
                          move(self.cu_seqlens), self.sample_indices, self.num_real_tokens)


def stack_carries(batches: Sequence[MicroBatch]) -> tuple[torch.Tensor, ...]:
    """Concatenate micro-batches along dim 0: the input of ``schedule.step(*carry)``, which splits it back
    into ``len(batches)`` micro-batches."""
    if not batches:
        raise InputError("no micro-batches to stack", source="stack_carries")
    return tuple(torch.cat(parts, dim=0) for parts in zip(*(b.carry() for b in batches)))


class PackCollator:
    """Callable ``collate(samples) -> MicroBatch`` (use as a DataLoader ``collate_fn``; one pack per call)."""

    def __init__(self, config: CollateConfig) -> None:
        self.config = config

    def __call__(self, samples: Sequence[dict]) -> MicroBatch:
        return collate(samples, self.config)


def collate(samples: Sequence[dict], config: CollateConfig) -> MicroBatch:
    """Lay a pack of samples into one fixed-shape micro-batch (see the module docstring).

    Raises ``InputError`` naming the sample when it is malformed or the pack does not fit
    (``num_tiles``, ``num_tokens``).
    """
    if len(samples) == 0:
        raise InputError("empty pack", source=config.source)
    lengths, tiles = _sample_sizes(samples, config)
    row = max(lengths) if config.mode == "pad_to_longest" else None
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += row if row is not None else n
    _check_fits(samples, config, lengths, tiles, row, total)
    return _fill(samples, config, lengths, tiles, starts, row, total)


def _sample_sizes(samples: Sequence[dict], cfg: CollateConfig) -> tuple[list[int], list[int]]:
    """Every sample's (tokens, tiles), after checking its tensors' shapes and image-token count."""
    lengths, tiles = [], []
    for pos, s in enumerate(samples):
        ids, labels, pix = s["input_ids"], s["labels"], s["pixel_values"]
        idx = s.get("index", pos)
        if ids.ndim != 1 or labels.shape != ids.shape:
            raise InputError(f"input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)} must be equal 1-D",
                             source=cfg.source, record=f"sample {idx}", field="labels")
        if pix.ndim != 4 or tuple(pix.shape[1:]) != (3, cfg.image_size, cfg.image_size):
            raise InputError(f"pixel_values shape {tuple(pix.shape)} is not [tiles, 3, {cfg.image_size}, "
                             f"{cfg.image_size}]", source=cfg.source, record=f"sample {idx}", field="pixel_values")
        num_img = int((ids == cfg.image_token_id).sum())
        if num_img not in (0, pix.shape[0] * cfg.tokens_per_tile):
            raise InputError(f"{num_img} image tokens but {pix.shape[0]} tiles x {cfg.tokens_per_tile} tokens",
                             source=cfg.source, record=f"sample {idx}", field="input_ids")
        lengths.append(int(ids.shape[0]))
        tiles.append(int(pix.shape[0]))
    return lengths, tiles


def _check_fits(samples: Sequence[dict], cfg: CollateConfig, lengths: list[int], tiles: list[int],
                row: int | None, total: int) -> None:
    """InputError naming the first sample that overflows the buffer, so the user sees which one breaks it."""
    total_tiles = sum(tiles)
    if total_tiles <= cfg.num_tiles and total <= cfg.num_tokens:
        return
    t_acc = v_acc = 0
    culprit = samples[-1].get("index", len(samples) - 1)
    for pos, (n, v) in enumerate(zip(lengths, tiles)):
        t_acc += row if row is not None else n
        v_acc += v
        if t_acc > cfg.num_tokens or v_acc > cfg.num_tiles:
            culprit = samples[pos].get("index", pos)
            break
    field = "tokens" if total > cfg.num_tokens else "tiles"
    raise InputError(f"pack of {len(samples)} samples needs {total_tiles} tiles / {total} tokens "
                     f"({cfg.mode}), the buffer holds {cfg.num_tiles} / {cfg.num_tokens}",
                     source=cfg.source, record=f"sample {culprit}", field=field)


def _fill(samples: Sequence[dict], cfg: CollateConfig, lengths: list[int], tiles: list[int], starts: list[int],
          row: int | None, total: int) -> MicroBatch:
    """Write the checked samples into the fixed buffers: tokens at ``starts`` (each ``row`` long when padding
    to the longest, else its own length), tiles one after the other."""
    S = cfg.image_size
    pixel_values = torch.zeros(1, cfg.num_tiles, 3, S, S, dtype=torch.float32)
    meta = torch.zeros(1, NUM_META_ROWS, cfg.num_tokens, dtype=torch.int64)
    meta[0, META_INPUT_IDS] = cfg.pad_token_id
    meta[0, META_SEGMENT_IDS] = -1
    meta[0, META_LABELS] = IGNORE_INDEX
    meta[0, META_IMAGE_INDEX] = -1
    tile_mask = torch.zeros(1, cfg.num_tiles, dtype=torch.bool)
    tile_at = 0
    seg_bounds = [0]
    for seg, (s, start, n, v) in enumerate(zip(samples, starts, lengths, tiles)):
        span = row if row is not None else n
        ids = s["input_ids"].to(torch.int64)
        meta[0, META_INPUT_IDS, start:start + n] = ids
        meta[0, META_POSITION_IDS, start:start + span] = torch.arange(span)
        meta[0, META_SEGMENT_IDS, start:start + span] = seg
        is_image = ids == cfg.image_token_id
        labels = s["labels"].to(torch.int64).masked_fill(is_image, IGNORE_INDEX)  # image slots are never targets
        meta[0, META_LABELS, start:start + n - 1] = labels[1:]
        img_pos = torch.nonzero(is_image).flatten() + start
        meta[0, META_IMAGE_INDEX, img_pos] = torch.arange(len(img_pos)) + tile_at * cfg.tokens_per_tile
        pixel_values[0, tile_at:tile_at + v] = s["pixel_values"]
        tile_mask[0, tile_at:tile_at + v] = True
        tile_at += v
        seg_bounds.append(start + span)
    return MicroBatch(
        pixel_values=pixel_values,
        token_meta=meta,
        sizes=torch.tensor([[sum(tiles), total]], dtype=torch.int64),
        tile_mask=tile_mask,
        cu_seqlens=torch.tensor(seg_bounds, dtype=torch.int32),
        sample_indices=tuple(int(s.get("index", i)) for i, s in enumerate(samples)),
        num_real_tokens=sum(lengths),
    )
