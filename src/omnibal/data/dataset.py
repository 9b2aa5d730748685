"""A map-style dataset of synthetic samples with exactly the sizes of a :class:`SampleStats` table.

Sample ``i`` has ``stats.tiles[i]`` tiles and ``stats.tokens[i]`` tokens, so the trainer's compute follows
the real data's size distribution while pixels and token ids are random. Everything is a pure function of
(seed, index): any DataLoader worker, any rank, any resume point yields the same sample.

Token layout, like an InternVL SFT sample: one BOS-like text token, the image slots (``tokens_per_tile``
per tile), the prompt's text, then the answer; the last ``target_fraction`` of the text tokens are the answer
(the targets). A row with ``images == 0`` is text-only: its tiles (InternVL's dummy tile, which the real
statistics count) run through the vision encoder but fill no token slot, so all its tokens are text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from omnibal.data.collate import IGNORE_INDEX
from omnibal.errors import InputError
from omnibal.stats.table import SampleStats, tokens_for_model


@dataclass(frozen=True, kw_only=True)
class SyntheticSampleConfig:
    """What a synthetic sample looks like (take the sizes from the model: ``VLM.collate_config``)."""

    image_size: int
    """Tile side in pixels."""
    tokens_per_tile: int
    """LLM image tokens per tile."""
    vocab_size: int
    """Token ids are drawn from [0, vocab_size) without ``image_token_id``."""
    image_token_id: int
    """Token id of an image slot."""
    target_fraction: float = 0.5
    """Fraction of the text tokens that are answer (target) tokens."""
    seed: int = 0
    """Seed; sample i is a function of (seed, i)."""


def stats_for_model(stats: SampleStats, tokens_per_tile: int, *, source_tokens_per_tile: int = 256) -> SampleStats:
    """The same samples under a model with ``tokens_per_tile`` LLM tokens per tile, from statistics that
    counted ``source_tokens_per_tile`` (InternVL-1.5: 256): the text is kept, each tile of a row with images
    contributes ``tokens_per_tile`` instead. Rows without images (a dummy tile, no image tokens) keep their
    tokens. Keys are kept, so the result still identifies the same samples."""
    tokens = tokens_for_model(stats.tiles, stats.tokens, stats.images, tokens_per_tile=tokens_per_tile,
                              source_tokens_per_tile=source_tokens_per_tile, source=stats.source)
    return SampleStats(tiles=stats.tiles, tokens=tokens.astype(np.int32), images=stats.images, keys=stats.keys,
                       source=f"{stats.source} ({tokens_per_tile} tokens per tile)")


class SyntheticVLMDataset(Dataset):
    """``dataset[i]`` -> ``{"pixel_values", "input_ids", "labels", "index", "key"}`` (see
    :mod:`omnibal.data.collate` for the format); sizes from ``stats`` row ``i``."""

    def __init__(self, stats: SampleStats, config: SyntheticSampleConfig) -> None:
        self.stats = stats
        self.config = config
        if not 0.0 <= config.target_fraction <= 1.0:
            raise InputError(f"target_fraction {config.target_fraction} not in [0, 1]", source="SyntheticSampleConfig",
                             field="target_fraction")
        if not 0 <= config.image_token_id < config.vocab_size or config.vocab_size < 2:
            raise InputError(f"image_token_id {config.image_token_id} not in a vocabulary of {config.vocab_size}",
                             source="SyntheticSampleConfig", field="image_token_id")
        need = stats.tiles.astype(np.int64) * config.tokens_per_tile * (stats.images > 0) + 1
        bad = np.flatnonzero(stats.tokens < need)
        if len(bad):
            i = int(bad[0])
            raise InputError(f"{int(stats.tokens[i])} tokens cannot hold {int(stats.tiles[i])} image tiles x "
                             f"{config.tokens_per_tile} image tokens + 1 text token ({len(bad)} such rows)",
                             source=stats.source, record=i, field="tokens")

    def __len__(self) -> int:
        return len(self.stats)

    def __getitem__(self, index: int) -> dict:
        cfg = self.config
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        index = int(index) % n
        tiles, tokens = int(self.stats.tiles[index]), int(self.stats.tokens[index])
        rng = np.random.default_rng([cfg.seed, index])
        gen = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))
        pixels = torch.randn(tiles, 3, cfg.image_size, cfg.image_size, generator=gen)
        num_image = tiles * cfg.tokens_per_tile if int(self.stats.images[index]) > 0 else 0
        num_text = tokens - num_image
        text = rng.integers(0, cfg.vocab_size - 1, size=num_text)
        text[text >= cfg.image_token_id] += 1  # skip the image token id
        ids = np.concatenate([text[:1], np.full(num_image, cfg.image_token_id), text[1:]]).astype(np.int64)
        num_answer = min(int(round(cfg.target_fraction * num_text)), num_text - 1)
        labels = np.full(tokens, IGNORE_INDEX, dtype=np.int64)
        if num_answer > 0:
            labels[-num_answer:] = ids[-num_answer:]
        return {"pixel_values": pixels, "input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "index": index, "key": int(self.stats.keys[index])}
