"""Synthetic InternVL-like SFT mixtures: the embedded default when no real statistics are at hand.

The default mixture mimics the InternVL-Chat-1.2 supervised fine-tuning set (about 1.2M samples) by its
published make-up: sub-datasets of general visual QA on photos, GPT-4V captions, Chinese VQA, synthetic
bar charts, real charts, science diagrams, document scans, geometry problems and synthetic OCR pages, plus a
small share of text-only conversations (InternVL feeds them a dummy tile). Each sub-dataset is a
:class:`SubsetProfile`: an image-size model (log-normal long side, a few typical aspect ratios with a
little jitter) run through the InternVL dynamic-resolution rule (:mod:`omnibal.stats.tiles`), and a
log-normal text length (prompt template + question + answer, clipped); the LLM sequence length is the text
plus ``tokens_per_tile`` image tokens per tile plus two ``<img>``/``</img>`` tokens per image.

The numbers are our own choices, guided by the public descriptions of these datasets (sample counts as
listed for the InternVL-Chat-1.2 SFT data, typical image resolutions: COCO photos ~640 px, SAM photos
~1500 px, DVQA charts 448 px, DocVQA scans ~1700x2200 px, small GeoQA diagrams) and by aggregate shapes
of published statistics (ChartQA: most samples 1.1k-1.6k tokens; AI2D: a few hundred to 1.5k). No
per-sample data is copied: nothing here is read from the real statistics files.

**Fitted to OmniBal's published statistics** (the default). OmniBal's reference repository
publishes per-sample statistics of two subsets of this mixture (AI2D, 12,413 samples; ChartQA, 18,317;
``internvl-1.2m-stats``). They fix two things the descriptions above do not:

* the tile rule: their samples have only 1, 3, 4 or 5 tiles, i.e. InternVL's dynamic resolution with at
  most 4 tiles plus the thumbnail (grids 1x1, 1x2, 1x3, 2x2/1x4), not the 12-tile rule of InternVL-1.5's
  own SFT; :data:`FITTED_TILES` is that rule and the default for every sub-dataset;
* the two sub-datasets themselves: ``science_diagrams`` (AI2D) and ``charts`` (ChartQA) draw their tile
  count from the published shares and their text length (``tokens - 256 tiles - 2``) from a log-normal
  fitted per tile count (median and standard deviation of the log), :class:`TileMix` below. Only these
  summary numbers are embedded (written out in the profiles), no per-sample row;
  ``tests/test_stats_synthetic.py`` refits them from the files when those are present.

The other sub-datasets keep their image-size and text models (no per-sample statistics of them are
published) under the fitted tile rule.

Deterministic in ``(num_samples, seed, profiles, settings)``; each sub-dataset draws from its own random
stream (seeded by the seed and the profile name), so adding a profile does not change the others.
Vectorised: 1.2M samples take well under a second of numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal.errors import InputError
from omnibal.stats.table import SampleStats, hash_key, index_keys
from omnibal.stats.tiles import TileConfig, count_tiles

IMAGE_MARKER_TOKENS = 2
"""``<img>`` and ``</img>`` around each image's tokens."""


@dataclass(frozen=True, kw_only=True)
class SubsetProfile:
    """One sub-dataset of a mixture."""

    name: str
    """Sub-dataset name (also seeds its random stream and keys)."""
    weight: float
    """Share of the mixture (relative; the default weights are sample counts summing to 1.2M)."""
    text_median: float
    """Median text tokens per sample (template, prompt and answer; all turns)."""
    text_sigma: float
    """Log-normal spread of text tokens."""
    text_min: int = 8
    """Clip: fewest text tokens."""
    text_max: int = 3500
    """Clip: most text tokens."""
    images: int = 1
    """Images per sample (0: text-only conversations)."""
    long_side_median: float = 640.0
    """Median of the image's longer side in pixels."""
    long_side_sigma: float = 0.3
    """Log-normal spread of the longer side."""
    long_side_min: int = 64
    long_side_max: int = 6000
    aspect_ratios: tuple[float, ...] = (4 / 3,)
    """Typical width/height ratios (< 1: portrait)."""
    aspect_weights: tuple[float, ...] | None = None
    """Probabilities of ``aspect_ratios`` (uniform when None)."""
    aspect_jitter: float = 0.05
    """Log-normal jitter around the chosen ratio (0: exact ratios)."""
    tile_mix: tuple[TileMix, ...] = ()
    """Fitted per-tile-count model (see the module docstring); when given it replaces the image-size model
    and ``text_median``/``text_sigma`` (the text clip still applies)."""

    def __post_init__(self) -> None:
        if self.weight < 0 or not np.isfinite(self.weight):
            raise InputError(f"weight must be >= 0, got {self.weight}", source=f"profile {self.name}", field="weight")
        if self.aspect_weights is not None and len(self.aspect_weights) != len(self.aspect_ratios):
            raise InputError("aspect_weights and aspect_ratios differ in length", source=f"profile {self.name}",
                             field="aspect_weights")  # fmt: skip
        if not 1 <= self.text_min <= self.text_max:
            raise InputError("need 1 <= text_min <= text_max", source=f"profile {self.name}", field="text_min")


@dataclass(frozen=True, kw_only=True)
class TileMix:
    """One tile count of a sub-dataset fitted to published per-sample statistics."""

    tiles: int
    """Tiles per sample (thumbnail included)."""
    share: float
    """Fraction of the sub-dataset's samples with this many tiles."""
    text_median: float
    """Median text tokens of these samples (LLM tokens less 256 per tile and the two image markers)."""
    text_sigma: float
    """Standard deviation of log(text tokens) of these samples."""


PHOTO = dict(aspect_ratios=(4 / 3, 3 / 4, 16 / 9, 1.0, 3 / 2, 2 / 3),
             aspect_weights=(0.45, 0.12, 0.1, 0.13, 0.12, 0.08))

INTERNVL_12_SFT: tuple[SubsetProfile, ...] = (
    SubsetProfile(name="general_vqa", weight=568_000, text_median=190, text_sigma=0.75, long_side_median=640,
                  long_side_sigma=0.25, **PHOTO),
    SubsetProfile(name="gpt4v_caption", weight=102_000, text_median=260, text_sigma=0.3, long_side_median=1500,
                  long_side_sigma=0.35, **PHOTO),
    SubsetProfile(name="chinese_vqa", weight=158_000, text_median=280, text_sigma=0.6, long_side_median=640,
                  long_side_sigma=0.2, **PHOTO),
    SubsetProfile(name="synthetic_bar_charts", weight=200_000, text_median=70, text_sigma=0.25,
                  long_side_median=448, long_side_sigma=0.0, aspect_ratios=(1.0,), aspect_jitter=0.0),
    # ChartQA, fitted to chartqa_train_18k_wh_token_lengths.json (18,317 samples)
    SubsetProfile(name="charts", weight=18_000, text_median=55, text_sigma=0.6, text_min=31, text_max=550,
                  tile_mix=(TileMix(tiles=1, share=0.0316, text_median=152, text_sigma=0.133),
                            TileMix(tiles=3, share=0.0598, text_median=127, text_sigma=0.578),
                            TileMix(tiles=4, share=0.0008, text_median=150, text_sigma=0.161),
                            TileMix(tiles=5, share=0.9078, text_median=48, text_sigma=0.597))),
    # AI2D, fitted to ai2d_train_12k_wh_token_lengths.json (12,413 samples)
    SubsetProfile(name="science_diagrams", weight=12_000, text_median=50, text_sigma=0.2, text_min=35,
                  text_max=345,
                  tile_mix=(TileMix(tiles=1, share=0.4667, text_median=50, text_sigma=0.198),
                            TileMix(tiles=3, share=0.2989, text_median=50, text_sigma=0.197),
                            TileMix(tiles=4, share=0.0486, text_median=50, text_sigma=0.197),
                            TileMix(tiles=5, share=0.1859, text_median=50, text_sigma=0.202))),
    SubsetProfile(name="documents", weight=10_000, text_median=80, text_sigma=0.4, long_side_median=2200,
                  long_side_sigma=0.2, aspect_ratios=(0.77, 0.71, 1.3), aspect_weights=(0.7, 0.2, 0.1)),
    SubsetProfile(name="geometry", weight=72_000, text_median=170, text_sigma=0.45, long_side_median=230,
                  long_side_sigma=0.3, aspect_ratios=(4 / 3, 1.0, 3 / 2), aspect_jitter=0.1),
    SubsetProfile(name="synthetic_ocr", weight=30_000, text_median=380, text_sigma=0.45, long_side_median=1100,
                  long_side_sigma=0.25, aspect_ratios=(0.75, 1.0, 4 / 3, 1.6), aspect_jitter=0.1),
    SubsetProfile(name="text_only", weight=30_000, text_median=520, text_sigma=0.8, text_max=4000, images=0),
)  # fmt: skip
"""The default mixture (weights are sample counts in the 1.2M set)."""

FITTED_TILES = TileConfig(max_tiles=4, use_thumbnail=True)
"""The tile rule of OmniBal's published InternVL-1.2M statistics: at most 4 tiles plus the thumbnail (their
samples have 1, 3, 4 or 5 tiles, never 2 or more than 5)."""


@dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    """Settings of a synthetic mixture beyond its size and seed."""

    profiles: tuple[SubsetProfile, ...] = INTERNVL_12_SFT
    """Sub-datasets and their shares."""
    tiles: TileConfig = FITTED_TILES
    """Dynamic-resolution rule (default: the published statistics' 1..4 tiles plus a thumbnail;
    ``TileConfig()`` is InternVL-1.5's 12-tile chat rule)."""
    tokens_per_tile: int = 256
    """LLM tokens per vision tile (256 after InternVL's pixel shuffle)."""
    count_dummy_tile: bool = True
    """Text-only samples carry one dummy tile through the vision encoder (InternVL does; the real stats
    count it). False: 0 tiles."""
    max_tokens: int | None = None
    """Clip sequence lengths to this many tokens, as a trainer that truncates to its maximum length does
    (None: no clipping; samples over the budget stay visible to the balancer)."""


def split_counts(num_samples: int, weights) -> np.ndarray:
    """Samples per profile: proportional to ``weights``, rounded by largest remainder to sum exactly."""
    w = np.asarray(weights, dtype=np.float64)
    if num_samples < 1 or w.sum() <= 0:
        raise InputError(f"need num_samples >= 1 and positive weights, got {num_samples}", source="synthetic")
    exact = num_samples * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    rest = num_samples - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:rest]] += 1
    return counts


def synthetic_internvl_mixture(
    num_samples: int = 1_200_000, seed: int = 0, *, config: SyntheticConfig = SyntheticConfig()
) -> SampleStats:
    """An InternVL-like SFT mixture of ``num_samples`` rows, sub-datasets one after another."""
    counts = split_counts(num_samples, [p.weight for p in config.profiles])
    parts = [
        _profile_stats(p, int(n), seed, config) for p, n in zip(config.profiles, counts) if n > 0
    ]
    return SampleStats.concat(parts, source=f"synthetic:internvl-sft(n={num_samples},seed={seed})")


def mixture_layout(num_samples: int = 1_200_000, *, config: SyntheticConfig = SyntheticConfig()):
    """``(name, start, stop)`` row ranges of each sub-dataset in :func:`synthetic_internvl_mixture`."""
    counts = split_counts(num_samples, [p.weight for p in config.profiles])
    stops = np.cumsum(counts)
    return [(p.name, int(s - n), int(s)) for p, n, s in zip(config.profiles, counts, stops) if n > 0]


def sample_image_sizes(profile: SubsetProfile, num_images: int, rng: np.random.Generator):
    """``(width, height)`` pixel arrays drawn from ``profile``'s size model."""
    long_side = profile.long_side_median * np.exp(profile.long_side_sigma * rng.standard_normal(num_images))
    long_side = np.clip(long_side, profile.long_side_min, profile.long_side_max)
    ratios = np.asarray(profile.aspect_ratios, dtype=np.float64)
    p = None if profile.aspect_weights is None else np.asarray(profile.aspect_weights) / np.sum(profile.aspect_weights)
    aspect = rng.choice(ratios, size=num_images, p=p) * np.exp(profile.aspect_jitter * rng.standard_normal(num_images))
    wide = aspect >= 1
    width = np.where(wide, long_side, long_side * aspect)
    height = np.where(wide, long_side / aspect, long_side)
    return np.maximum(np.rint(width), 1).astype(np.int64), np.maximum(np.rint(height), 1).astype(np.int64)


def _profile_stats(profile: SubsetProfile, n: int, seed: int, config: SyntheticConfig) -> SampleStats:
    rng = np.random.default_rng([seed & 0xFFFFFFFF, hash_key(profile.name) & 0xFFFFFFFF])
    text = profile.text_median * np.exp(profile.text_sigma * rng.standard_normal(n))
    text = np.clip(np.rint(text), profile.text_min, profile.text_max).astype(np.int64)
    if profile.tile_mix:
        tiles, text = _fitted_draw(profile, n, rng)
        images = np.ones(n, dtype=np.int64)
        tokens = text + tiles * config.tokens_per_tile + images * IMAGE_MARKER_TOKENS
    elif profile.images == 0:
        tiles = np.full(n, 1 if config.count_dummy_tile else 0, dtype=np.int64)
        images = np.zeros(n, dtype=np.int64)
        tokens = text
    else:
        width, height = sample_image_sizes(profile, n * profile.images, rng)
        per_image = count_tiles(width, height, config.tiles).astype(np.int64).reshape(n, profile.images)
        tiles = per_image.sum(axis=1)
        images = np.full(n, profile.images, dtype=np.int64)
        tokens = text + tiles * config.tokens_per_tile + images * IMAGE_MARKER_TOKENS
    if config.max_tokens is not None:
        tokens = np.minimum(tokens, config.max_tokens)
    return SampleStats(
        tiles=tiles, tokens=tokens, images=images,
        keys=index_keys(f"synthetic/{profile.name}/seed={seed}", n), source=profile.name,
    )  # fmt: skip


def _fitted_draw(profile: SubsetProfile, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(tiles, text tokens)`` of ``n`` samples from ``profile.tile_mix``."""
    shares = np.array([m.share for m in profile.tile_mix], dtype=np.float64)
    which = rng.choice(len(shares), size=n, p=shares / shares.sum())
    tiles = np.array([m.tiles for m in profile.tile_mix], dtype=np.int64)[which]
    median = np.array([m.text_median for m in profile.tile_mix])[which]
    sigma = np.array([m.text_sigma for m in profile.tile_mix])[which]
    text = median * np.exp(sigma * rng.standard_normal(n))
    return tiles, np.clip(np.rint(text), profile.text_min, profile.text_max).astype(np.int64)
