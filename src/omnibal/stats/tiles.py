"""The InternVL dynamic-resolution tile rule, vectorised, and image sizes read from headers only.

InternVL (1.5 and later) cuts an image of W x H pixels into a grid of ``cols x rows`` square tiles of
``tile_size`` pixels. The grid is chosen among all grids with ``min_tiles <= cols*rows <= max_tiles``,
visited in order of area (``cols*rows``): the one whose ratio ``cols/rows`` is closest to ``W/H`` wins; on
an exact tie a later (larger) grid replaces the current best only if ``W*H > 0.5 * tile_size**2 *
cols*rows`` (the image has enough pixels to fill it). With the thumbnail on, a grid of more than one tile
adds one whole-image tile, which ``max_tiles`` does not count (so up to 13 tiles with ``max_tiles=12``).

The visiting order within one area matters only for exact ties, and is reproduced exactly: the candidate
list is built the way InternVL builds it (a Python set of ``(cols, rows)`` sorted by area; CPython's
tuple-of-int hashing makes that order deterministic).

Sizes come from image headers (Pillow's ``Image.open(path).size`` reads a few hundred bytes, no pixel
decode); EXIF orientations 5-8 (rotated by 90 degrees) swap width and height, as a viewer (or a loader
that calls ``ImageOps.exif_transpose``) sees the image. InternVL's own loader opens images without
``exif_transpose``; ``apply_exif=False`` reproduces that.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from omnibal.errors import InputError

ORIENTATION_TAG = 0x0112  # EXIF Orientation; 5-8 rotate by 90 degrees
MAX_SIDE = 1 << 20  # pixels; larger is a corrupt header, not a real image
_CHUNK = 1 << 14


@dataclass(frozen=True, kw_only=True)
class TileConfig:
    """InternVL dynamic-resolution settings (defaults: InternVL-1.5 chat models)."""

    min_tiles: int = 1
    """Smallest tile grid (columns x rows) an image is cut into."""
    max_tiles: int = 12
    """Largest tile grid an image is cut into; the thumbnail is not counted in it."""
    tile_size: int = 448
    """Tile side in pixels (the vision encoder's input size)."""
    use_thumbnail: bool = field(default=True, metadata={"flag": "--thumbnail"})
    """Add one whole-image thumbnail tile when the grid has more than one tile."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_tiles <= self.max_tiles:
            raise InputError(
                f"need 1 <= min_tiles <= max_tiles, got {self.min_tiles}, {self.max_tiles}", source="TileConfig",
                field="min_tiles",
            )  # fmt: skip
        if self.max_tiles > 1024:
            raise InputError(f"max_tiles {self.max_tiles} is absurd", source="TileConfig", field="max_tiles")
        if not 1 <= self.tile_size <= 1 << 14:
            raise InputError(f"tile_size must be in [1, 16384], got {self.tile_size}", source="TileConfig",
                             field="tile_size")  # fmt: skip

    @property
    def max_tiles_per_image(self) -> int:
        return self.max_tiles + (1 if self.use_thumbnail and self.max_tiles > 1 else 0)


@functools.lru_cache(maxsize=64)
def candidate_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """``(cols, rows)`` grids in the order the rule visits them (InternVL's own construction)."""
    grids = {
        (i, j)
        for n in range(min_tiles, max_tiles + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if min_tiles <= i * j <= max_tiles
    }
    return tuple(sorted(grids, key=lambda g: g[0] * g[1]))


def choose_grids(widths, heights, config: TileConfig = TileConfig()) -> tuple[np.ndarray, np.ndarray]:
    """Grid ``(cols, rows)`` for each image; vectorised over the images, a loop over the few grids."""
    w = np.asarray(widths, dtype=np.float64)
    h = np.asarray(heights, dtype=np.float64)
    if w.shape != h.shape:
        raise InputError(f"widths {w.shape} and heights {h.shape} differ in shape", source="choose_grids")
    if w.size and (min(w.min(), h.min()) < 1 or not (np.isfinite(w).all() and np.isfinite(h).all())):
        raise InputError("image sides must be >= 1 pixel", source="choose_grids", field="width/height")
    grids = candidate_grids(config.min_tiles, config.max_tiles)
    table = np.array(grids, dtype=np.int64)
    ratios = table[:, 0] / table[:, 1]
    fill = 0.5 * config.tile_size * config.tile_size * table[:, 0] * table[:, 1]
    best = np.empty(w.shape, dtype=np.int64)
    flat_w, flat_h, flat_best = w.reshape(-1), h.reshape(-1), best.reshape(-1)
    # chunks that stay in cache: faster than whole-array passes over a large mixture
    for start in range(0, flat_w.size, _CHUNK):
        cw, ch = flat_w[start : start + _CHUNK], flat_h[start : start + _CHUNK]
        aspect, area = cw / ch, cw * ch
        best_diff = np.full(aspect.shape, np.inf)
        chunk_best = np.zeros(aspect.shape, dtype=np.int64)
        diff = np.empty_like(aspect)
        for g in range(len(grids)):
            np.subtract(aspect, ratios[g], out=diff)
            np.abs(diff, out=diff)
            # InternVL: a closer ratio wins; an exact tie goes to the later (larger) grid only if the image
            # has more than half the pixels that grid holds
            take = (diff < best_diff) | ((diff == best_diff) & (area > fill[g]))
            chunk_best[take] = g
            np.minimum(best_diff, diff, out=best_diff)
        flat_best[start : start + _CHUNK] = chunk_best
    return table[best, 0], table[best, 1]


def count_tiles(widths, heights, config: TileConfig = TileConfig()) -> np.ndarray:
    """Tiles the vision encoder processes per image (grid plus thumbnail), int32."""
    cols, rows = choose_grids(widths, heights, config)
    tiles = cols * rows
    if config.use_thumbnail:
        tiles = tiles + (tiles != 1)
    return tiles.astype(np.int32)


def open_image_file(path, *, source: str | None = None, record: str | int | None = None):
    """A binary file object for the image at ``path``, opened without blocking and only if it is a regular
    file: a FIFO would block the open (and the command) until a writer appears, and a device never ends."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError(f"image not found: {path}", source=source, record=record, field="image") from None
    except OSError as exc:
        raise InputError(f"cannot open image {path}: {exc.strerror or exc}", source=source, record=record,
                         field="image") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
            raise InputError(f"image {path} is {kind}, not an image file", source=source, record=record,
                             field="image")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def image_size(
    path, *, source: str | None = None, record: str | int | None = None, apply_exif: bool = True
) -> tuple[int, int]:
    """``(width, height)`` from the header; with ``apply_exif`` EXIF orientations 5-8 swap the sides.

    Reads no pixel data. Errors name ``source`` (the annotation file) and ``record`` as well as the image.
    """
    saved_limit = Image.MAX_IMAGE_PIXELS
    try:
        # the decompression-bomb guard protects decoding; only the header is read here, and a huge scan
        # is a real (large) image to count, not an attack
        Image.MAX_IMAGE_PIXELS = None
        with open_image_file(path, source=source, record=record) as f, Image.open(f) as img:
            width, height = img.size
            orientation = _orientation(img) if apply_exif else 1
    except InputError:
        raise
    except Exception as exc:  # Pillow's plugins raise many kinds on corrupt headers; all mean "unreadable"
        raise InputError(
            f"unreadable image header {path}: {type(exc).__name__}: {exc}", source=source, record=record, field="image"
        ) from None
    finally:
        Image.MAX_IMAGE_PIXELS = saved_limit
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise InputError(f"absurd image size {width}x{height}: {path}", source=source, record=record, field="image")
    if orientation in (5, 6, 7, 8):
        width, height = height, width
    return int(width), int(height)


def _orientation(img) -> int:
    """EXIF orientation without decoding pixels (PNG: only an eXIf chunk before the image data)."""
    try:
        if img.format == "PNG":
            raw = img.info.get("exif")
            if not raw:
                return 1
            exif = Image.Exif()
            exif.load(raw)
        else:
            exif = img.getexif()
        value = exif.get(ORIENTATION_TAG, 1)
        return int(value) if isinstance(value, int) else 1
    except Exception:  # a damaged EXIF block does not make the pixels unusable: read as unrotated
        return 1
