"""A synthetic long-context VLM mixture: mostly short InternVL-like samples, some long documents and videos.

HBP (Hierarchical Balance Packing, Yao et al. 2025) targets SFT data that mixes short conversations with
long-context samples. There is no public per-sample statistics file of such a mixture, so this preset
builds one from stated, documented choices (no per-sample data is copied from anywhere):

* **short** (``short_share`` = 80%): the default InternVL-like mixture of :mod:`omnibal.stats.synthetic`
  (single images, 1-13 tiles, mostly 300-3,500 LLM tokens).
* **documents** (15%): multi-page documents or multi-image conversations of ``8k..32k`` LLM tokens, drawn
  log-uniformly (long-document VQA sets are dominated by their shorter members). ``image_share`` (70%) of
  the tokens are page images at ``tokens_per_tile`` (256) tokens per tile and up to 6 tiles per page
  (InternVL's dynamic resolution caps a page at 6 tiles in multi-image mode); the rest is text.
* **videos** (5%): video conversations of ``32k..128k`` LLM tokens, log-uniform: one tile per frame
  (InternVL's video mode), 90% of the tokens are frames; the rest is text.

Per sample: ``tokens = text + tiles * tokens_per_tile + 2 * images`` as in the short mixture, so the same
cost model prices every row. ``scale`` shrinks every long sample's token count (and so its tiles) by that
factor, and keeps the short part as it is but with ``tokens_per_tile // scale`` tokens per tile: the
``scale=16`` variant (:func:`cpu_long_context_mixture`) keeps the shape of the mixture (short : document :
video lengths of roughly 1 : 10 : 40) at sizes a CPU trainer with the ``tiny`` preset can run.

Deterministic in ``(num_samples, seed, config)``; each part draws from its own stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal.errors import InputError
from omnibal.stats.synthetic import IMAGE_MARKER_TOKENS, SyntheticConfig, split_counts, synthetic_internvl_mixture
from omnibal.stats.table import SampleStats, hash_key, index_keys


@dataclass(frozen=True, kw_only=True)
class LongPart:
    """One long-context part of the mixture: log-uniform LLM length in ``[min_tokens, max_tokens]``."""

    name: str
    """Part name (seeds its random stream and keys)."""
    share: float
    """Share of the mixture's samples."""
    min_tokens: int
    """Shortest sample (LLM tokens, at scale 1)."""
    max_tokens: int
    """Longest sample (LLM tokens, at scale 1)."""
    image_share: float
    """Share of a sample's tokens that are image tokens."""
    tiles_per_image: int
    """Tiles per image (page or frame)."""


DOCUMENTS = LongPart(name="long_documents", share=0.15, min_tokens=8_192, max_tokens=32_768, image_share=0.7,
                     tiles_per_image=6)
VIDEOS = LongPart(name="long_videos", share=0.05, min_tokens=32_768, max_tokens=131_072, image_share=0.9,
                  tiles_per_image=1)


@dataclass(frozen=True, kw_only=True)
class LongContextConfig:
    """Settings of the long-context mixture (defaults: 80% short, 15% documents, 5% videos)."""

    long_parts: tuple[LongPart, ...] = (DOCUMENTS, VIDEOS)
    """The long parts; the short part takes the rest of the samples."""
    tokens_per_tile: int = 256
    """LLM tokens per tile at scale 1 (InternVL after pixel shuffle)."""
    scale: int = 1
    """Divide every sample's size by this (16: the CPU variant)."""

    def __post_init__(self) -> None:
        total = sum(p.share for p in self.long_parts)
        if not 0 <= total < 1 or any(p.share < 0 for p in self.long_parts):
            raise InputError(f"long parts' shares must be >= 0 and sum below 1, got {total}", source="long_context",
                             field="share")
        if not isinstance(self.scale, int) or self.scale < 1 or self.tokens_per_tile % self.scale:
            raise InputError(f"scale must be a positive integer dividing tokens_per_tile {self.tokens_per_tile}, "
                             f"got {self.scale!r}", source="long_context", field="scale")
        for p in self.long_parts:
            if not 1 <= p.min_tokens <= p.max_tokens or not 0 <= p.image_share < 1 or p.tiles_per_image < 1:
                raise InputError("need 1 <= min_tokens <= max_tokens, 0 <= image_share < 1, tiles_per_image >= 1",
                                 source=f"long part {p.name}", field="min_tokens")


def long_context_mixture(num_samples: int = 1_200_000, seed: int = 0, *,
                         config: LongContextConfig = LongContextConfig()) -> SampleStats:
    """The mixture of the module docstring: short rows first, then each long part."""
    shares = [p.share for p in config.long_parts]
    counts = split_counts(num_samples, [1.0 - sum(shares), *shares])
    tpt = config.tokens_per_tile // config.scale
    parts = []
    if counts[0]:
        parts.append(synthetic_internvl_mixture(int(counts[0]), seed, config=SyntheticConfig(tokens_per_tile=tpt)))
    for part, n in zip(config.long_parts, counts[1:]):
        if n:
            parts.append(_long_part(part, int(n), seed, tpt, config.scale))
    return SampleStats.concat(parts, source=f"synthetic:long-context(n={num_samples},seed={seed},scale={config.scale})")


def cpu_long_context_mixture(num_samples: int = 4_000, seed: int = 0) -> SampleStats:
    """The scaled-down variant for the CPU trainer: every size / 16 (16 LLM tokens per tile, as ``tiny``)."""
    return long_context_mixture(num_samples, seed, config=LongContextConfig(scale=16))


def _long_part(part: LongPart, n: int, seed: int, tokens_per_tile: int, scale: int) -> SampleStats:
    rng = np.random.default_rng([seed & 0xFFFFFFFF, hash_key(part.name) & 0xFFFFFFFF])
    lo, hi = np.log(part.min_tokens / scale), np.log(part.max_tokens / scale)
    total = np.rint(np.exp(rng.uniform(lo, hi, n))).astype(np.int64)
    per_image = part.tiles_per_image * tokens_per_tile + IMAGE_MARKER_TOKENS
    images = np.maximum(np.floor(total * part.image_share / per_image), 1).astype(np.int64)
    tiles = images * part.tiles_per_image
    text = np.maximum(total - images * per_image, 1)
    tokens = text + images * per_image
    return SampleStats(tiles=tiles, tokens=tokens, images=images,
                       keys=index_keys(f"synthetic/{part.name}/seed={seed}/scale={scale}", n), source=part.name)


def llm_only(stats: SampleStats) -> SampleStats:
    """The same sequence lengths as text-only rows (no tiles, no images): an LLM-only model's view."""
    zeros = np.zeros(len(stats), np.int64)
    return SampleStats(tiles=zeros, tokens=stats.tokens, images=zeros, keys=stats.keys,
                       source=f"{stats.source} (LLM only)")


__all__ = ["DOCUMENTS", "VIDEOS", "LongContextConfig", "LongPart", "cpu_long_context_mixture", "llm_only",
           "long_context_mixture"]
