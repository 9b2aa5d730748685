"""`SampleStats`: per-sample sizes as numpy columns.

One row per training sample, in dataset order (row ``i`` is sample ``i`` of the dataset the stats were
computed from). The balancer, the cost model and the simulator read nothing else about the data.

Columns
-------
``tiles``   vision tiles the encoder processes (InternVL dynamic resolution, thumbnail included; a
            text-only sample that carries a dummy tile counts it, since the encoder still runs on it).
``tokens``  LLM input sequence length in tokens (text plus image tokens).
``images``  number of real images (0 for text-only samples).
``keys``    a stable 64-bit fingerprint of the sample (its annotation id, or source + index), used to
            detect a stats file that no longer matches its dataset instead of silently mis-applying it.

Image convention
----------------
What a "tile" is depends on the model family the statistics were made for (:class:`ImageConvention`):
``internvl`` (dynamic resolution: an image is a grid of square tiles plus a thumbnail, each tile
``tokens_per_tile`` LLM tokens; InternVL-1.5: 448 px, 256 tokens) or ``llava`` (one resized image is one
tile of ``tokens_per_tile`` tokens; LLaVA-1.5: 336 px, 576 tokens). Stats files record it
(:mod:`omnibal.stats.io`); a table without one (``convention=None``: files written before it existed, the
public token-length files) is read as :data:`INTERNVL_CONVENTION`, and code that relies on that default
says so (``omnibal.cost.units.model_stats``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from omnibal.errors import InputError
from omnibal.validate import is_int

# Sizes beyond these are almost certainly corrupt input, not real samples: a 448px tile grid of 4096
# tiles is a 28,000 x 28,000 px image, and 16M tokens is far beyond any context length in use.
MAX_TILES = 4096
MAX_TOKENS = 1 << 24
MAX_IMAGES = 4096

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser: a bijective mix of uint64 values."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return z ^ (z >> np.uint64(31))


def hash_key(text: str) -> int:
    """Stable 64-bit key of a string (blake2b; not Python's salted ``hash``).

    ``surrogatepass``: a JSON id may hold a lone surrogate escape (``"\\ud800"``); it still gets a key
    (every other string encodes exactly as UTF-8, so existing keys do not change)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def index_keys(source: str, num_samples: int, *, start: int = 0) -> np.ndarray:
    """Keys for samples that have no id of their own: a mix of the source name and the row index."""
    base = np.uint64(hash_key(source))
    idx = np.arange(start, start + num_samples, dtype=np.uint64)
    return _splitmix64(idx ^ base)


CONVENTION_LAYOUTS = ("internvl", "llava")


@dataclass(frozen=True)
class ImageConvention:
    """How images became tiles and tokens in a stats table (see the module docstring)."""

    layout: str
    """``internvl`` (dynamic tiles + thumbnail) or ``llava`` (one image = one tile)."""
    tokens_per_tile: int
    """LLM image tokens each tile contributes to ``tokens``."""

    def __post_init__(self) -> None:
        if self.layout not in CONVENTION_LAYOUTS:
            raise InputError(f"unknown image layout {self.layout!r}; one of {', '.join(CONVENTION_LAYOUTS)}",
                             source="convention", field="layout")
        if not is_int(self.tokens_per_tile) or not (
                1 <= self.tokens_per_tile <= MAX_TOKENS):
            raise InputError(f"tokens per tile must be a positive integer, got {self.tokens_per_tile!r}",
                             source="convention", field="tokens_per_tile")

    def __str__(self) -> str:
        return f"{self.layout}/{self.tokens_per_tile}"

    def describe(self) -> str:
        what = "InternVL tiles" if self.layout == "internvl" else "LLaVA single image"
        return f"{what}, {self.tokens_per_tile} tokens per tile ({self})"

    @classmethod
    def parse(cls, text: str, *, source: str = "convention") -> ImageConvention:
        """``"internvl/256"``, ``"llava/576"``; a bare ``internvl`` / ``llava`` takes the family's default."""
        layout, _, count = str(text).strip().partition("/")
        if not count:
            defaults = {"internvl": INTERNVL_CONVENTION, "llava": LLAVA_CONVENTION}
            if layout in defaults:
                return defaults[layout]
        try:
            return cls(layout, int(count))
        except ValueError:
            raise InputError(f"expected LAYOUT/TOKENS_PER_TILE (e.g. internvl/256, llava/576), got {text!r}",
                             source=source, field="convention") from None


INTERNVL_CONVENTION = ImageConvention("internvl", 256)
"""InternVL-1.5 statistics (448 px tiles, 256 tokens each): what a table without a recorded convention is read as."""
LLAVA_CONVENTION = ImageConvention("llava", 576)
"""LLaVA-1.5: one 336 px image, 24 x 24 = 576 tokens."""


@dataclass(frozen=True, eq=False)
class SampleStats:
    """Per-sample statistics as numpy columns (see the module docstring for the columns)."""

    tiles: np.ndarray
    """Vision tiles per sample (int32, >= 0)."""
    tokens: np.ndarray
    """LLM sequence length per sample in tokens (int32, >= 1)."""
    images: np.ndarray
    """Real images per sample (int32, >= 0)."""
    keys: np.ndarray
    """Stable per-sample fingerprint (uint64)."""
    source: str = field(default="<memory>")
    """Where the table came from (a path or a generator description); used in error messages."""
    convention: ImageConvention | None = None
    """How images were counted (:class:`ImageConvention`); None: not recorded (read as InternVL-1.5's)."""

    def __post_init__(self) -> None:
        cols = {}
        for name, dtype in (("tiles", np.int32), ("tokens", np.int32), ("images", np.int32)):
            cols[name] = _as_int_column(getattr(self, name), name, dtype, self.source)
        keys = np.asarray(self.keys)
        if keys.dtype != np.uint64:
            if keys.dtype.kind not in "iu":
                raise InputError(f"keys must be integers, got dtype {keys.dtype}", source=self.source, field="keys")
            keys = keys.astype(np.uint64)
        cols["keys"] = keys
        if self.convention is not None and not isinstance(self.convention, ImageConvention):
            raise InputError(f"convention must be an ImageConvention, got {self.convention!r}", source=self.source,
                             field="convention")
        n = {name: len(col) for name, col in cols.items()}
        if len(set(n.values())) != 1:
            raise InputError(f"columns have different lengths {n}", source=self.source)
        for name, col in cols.items():
            if col.ndim != 1:
                raise InputError(f"column must be 1-D, got shape {col.shape}", source=self.source, field=name)
            col.setflags(write=False)
            object.__setattr__(self, name, col)
        _check_range(cols["tiles"], "tiles", 0, MAX_TILES, self.source)
        _check_range(cols["tokens"], "tokens", 1, MAX_TOKENS, self.source)
        _check_range(cols["images"], "images", 0, MAX_IMAGES, self.source)

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    def from_arrays(
        cls,
        *,
        tiles,
        tokens,
        images=None,
        keys=None,
        source: str = "<memory>",
    ) -> SampleStats:
        """Build from array-likes; ``images`` defaults to one per sample with tiles, ``keys`` to index keys."""
        tiles_arr = np.asarray(tiles)
        n = len(tiles_arr)
        if images is None:
            images = (tiles_arr > 0).astype(np.int32)
        if keys is None:
            keys = index_keys(source, n)
        return cls(tiles=tiles_arr, tokens=np.asarray(tokens), images=np.asarray(images), keys=keys, source=source)

    @classmethod
    def concat(cls, parts: list[SampleStats], *, source: str | None = None) -> SampleStats:
        """Rows of ``parts`` one after another (e.g. sub-datasets of a mixture)."""
        if not parts:
            raise InputError("nothing to concatenate", source=source or "<concat>")
        conventions = {p.convention for p in parts}
        if len(conventions) > 1:
            raise InputError("parts were made with different image conventions: " + ", ".join(
                sorted(str(c or "unrecorded") for c in conventions)), source=source or "<concat>", field="convention")
        return cls(
            tiles=np.concatenate([p.tiles for p in parts]),
            tokens=np.concatenate([p.tokens for p in parts]),
            images=np.concatenate([p.images for p in parts]),
            keys=np.concatenate([p.keys for p in parts]),
            source=source or "+".join(p.source for p in parts),
            convention=parts[0].convention,
        )

    # -- access -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tiles)

    @property
    def num_samples(self) -> int:
        return len(self.tiles)

    def take(self, indices) -> SampleStats:
        """Rows at ``indices`` (in that order), e.g. a subset or a permutation."""
        idx = np.asarray(indices, dtype=np.int64)
        return SampleStats(
            tiles=self.tiles[idx],
            tokens=self.tokens[idx],
            images=self.images[idx],
            keys=self.keys[idx],
            source=self.source,
            convention=self.convention,
        )

    def replicate(self, num_samples: int) -> SampleStats:
        """Cycle the rows up to ``num_samples`` rows; copies get fresh keys so every row stays distinct.

        Used to scale real statistics (~30k rows) to the 1.2M of the full InternVL SFT mixture in benchmarks.
        """
        if num_samples < 1:
            raise InputError(f"num_samples must be >= 1, got {num_samples}", source="replicate")
        if len(self) == 0:
            raise InputError("cannot replicate an empty table", source=self.source)
        idx = np.arange(num_samples, dtype=np.int64) % len(self)
        copy_no = (np.arange(num_samples, dtype=np.uint64) // np.uint64(len(self)))
        keys = np.where(copy_no == 0, self.keys[idx], _splitmix64(self.keys[idx] ^ copy_no))
        return SampleStats(
            tiles=self.tiles[idx],
            tokens=self.tokens[idx],
            images=self.images[idx],
            keys=keys,
            source=f"{self.source} x{num_samples / len(self):.2f}",
            convention=self.convention,
        )

    def equals(self, other: SampleStats) -> bool:
        """Same rows, same order, same keys (``source`` is ignored)."""
        return len(self) == len(other) and all(
            np.array_equal(getattr(self, c), getattr(other, c)) for c in ("tiles", "tokens", "images", "keys")
        )

    def fingerprint(self) -> str:
        """A short hash of all columns: ties a schedule, plan or checkpoint to the exact stats it used."""
        h = hashlib.blake2b(digest_size=8)
        for c in ("tiles", "tokens", "images", "keys"):
            h.update(np.ascontiguousarray(getattr(self, c)).tobytes())
        return h.hexdigest()


def tokens_for_model(tiles, tokens, images, *, tokens_per_tile: int, source_tokens_per_tile: int = 256,
                     source: str = "tokens") -> np.ndarray:
    """LLM sequence lengths (int64) under a model with ``tokens_per_tile`` image tokens per tile, from
    statistics that counted ``source_tokens_per_tile`` (InternVL-1.5: 256).

    The text part is kept; each tile of a row *with images* contributes ``tokens_per_tile`` instead. A
    text-only row (``images == 0``) keeps its tokens: its dummy tile runs through the vision encoder but puts
    no image tokens into the sequence. Raises InputError when a row with images would keep no text token
    (the statistics then do not count ``source_tokens_per_tile`` per tile)."""
    tiles = np.asarray(tiles, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.int64)
    has_images = np.asarray(images) > 0
    if not tiles.shape == tokens.shape == has_images.shape:
        raise InputError(f"tiles {tiles.shape}, tokens {tokens.shape} and images {has_images.shape} differ in "
                         "shape", source=source, field="images")
    image_tiles = tiles * has_images
    text = tokens - int(source_tokens_per_tile) * image_tiles
    bad = np.flatnonzero(text < 1)
    if len(bad):
        i = int(bad[0])
        raise InputError(f"{int(tokens.flat[i])} tokens leave no text after {int(tiles.flat[i])} tiles x "
                         f"{source_tokens_per_tile} image tokens: the statistics do not count "
                         f"{source_tokens_per_tile} per tile ({len(bad)} such rows)", source=source, record=i,
                         field="tokens")
    return text + int(tokens_per_tile) * image_tiles


def one_tile_per_image(stats: SampleStats) -> bool:
    """Whether every image is exactly one tile and text-only rows have at most a dummy tile: InternVL statistics
    like that count the tiles LLaVA's single images would."""
    image = stats.images > 0
    return bool((stats.tiles[image] == stats.images[image]).all() and (stats.tiles[~image] <= 1).all())


def convert_convention(stats: SampleStats, target: ImageConvention) -> SampleStats:
    """``stats`` re-expressed in ``target``'s convention (a table without one is read as InternVL-1.5's).

    Same layout: each image row's tiles contribute ``target.tokens_per_tile`` tokens instead (exact).
    InternVL -> LLaVA: each image becomes one tile of ``target.tokens_per_tile`` tokens, the text part is kept,
    and a text-only row keeps its dummy tile (at most one); exact when every image was one tile
    (:func:`one_tile_per_image`). LLaVA -> InternVL cannot be done from counts (the tile grid needs the image
    sizes): InputError, make the statistics again from the annotations."""
    source = stats.convention or INTERNVL_CONVENTION
    if source == target and stats.convention is not None:
        return stats
    if source.layout == target.layout:
        tiles = stats.tiles
    elif source.layout == "internvl" and target.layout == "llava":
        tiles = np.where(stats.images > 0, stats.images, np.minimum(stats.tiles, 1))
    else:
        raise InputError(f"statistics made as {source.describe()} cannot be converted to {target.describe()}: "
                         "the tile grid needs the image sizes; run omnibal stats on the annotations with the "
                         "model's convention", source=stats.source, field="convention")
    text = tokens_for_model(stats.tiles, stats.tokens, stats.images, tokens_per_tile=0,
                            source_tokens_per_tile=source.tokens_per_tile, source=stats.source)
    tokens = text + target.tokens_per_tile * np.asarray(tiles, np.int64) * (stats.images > 0)
    return SampleStats(tiles=tiles, tokens=tokens, images=stats.images, keys=stats.keys,
                       source=f"{stats.source} (as {target})", convention=target)


def _as_int_column(values, name: str, dtype, source: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise InputError(f"must be a whole number, got {arr[i]!r}", source=source, record=i, field=name)
    elif arr.dtype.kind not in "iub" and arr.size:
        raise InputError(f"must be integers, got dtype {arr.dtype}", source=source, field=name)
    if arr.size and arr.dtype.kind in "iuf":
        too_big = np.abs(arr) > np.iinfo(dtype).max
        if too_big.any():
            i = int(np.flatnonzero(too_big)[0])
            raise InputError(f"value {arr[i]!r} out of range", source=source, record=i, field=name)
    return np.ascontiguousarray(arr, dtype=dtype)


def _check_range(col: np.ndarray, name: str, lo: int, hi: int, source: str) -> None:
    bad = (col < lo) | (col > hi)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InputError(
            f"must be in [{lo}, {hi}], got {int(col[i])} ({int(bad.sum())} rows out of range)",
            source=source,
            record=i,
            field=name,
        )
