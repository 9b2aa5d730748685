"""Parsing and checking one annotation record (the worker side of :mod:`omnibal.stats.annotations`).

Pure functions: a record (parsed JSON) in, its turn texts, image paths, given sizes and key out, or a
:class:`RecordError` naming the field. No file is opened here except to resolve paths for the image-root
guard.
"""

from __future__ import annotations

import json
import math
import os

from omnibal.errors import InputError
from omnibal.stats.table import MAX_IMAGES, hash_key
from omnibal.stats.tiles import MAX_SIDE

IMAGE_PLACEHOLDER = "<image>"


class RecordError(Exception):
    """A bad record; the caller adds the file and the record locator."""

    def __init__(self, message: str, field: str | None = None) -> None:
        self.message, self.field = message, field


def check_inside(path: str, img: str, real_root: str, real_dirs: dict, source: str, locator: str) -> None:
    """Refuse a path whose real location (``..`` and every symlink resolved) is outside ``real_root``.

    Resolving every component costs an ``lstat`` each; folders repeat across records, so their real
    paths are cached per chunk and only the file itself is checked for being a link (one ``lstat``)."""
    folder, name = os.path.split(path)
    if name in ("", ".", ".."):
        real = os.path.realpath(path)
    else:
        real_folder = real_dirs.get(folder)
        if real_folder is None:
            real_folder = real_dirs[folder] = os.path.realpath(folder)
        real = os.path.join(real_folder, name)
        if os.path.islink(real):
            real = os.path.realpath(real)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise InputError(
            f"image path {img!r} leads outside the image root {real_root} (to {real}); "
            "pass --allow-outside-root (AnnotationConfig.allow_outside_root) if that is intended",
            source=source, record=locator, field="image",
        )  # fmt: skip


def parse_json_line(line: bytes):
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RecordError(f"not UTF-8 text (byte {exc.start} of the line)") from None
    except json.JSONDecodeError as exc:
        raise RecordError(f"malformed JSON: {exc.msg} (column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:
        raise RecordError(f"malformed JSON: {type(exc).__name__}") from None


def parse_record(rec, file_name: str) -> dict:
    if not isinstance(rec, dict):
        raise RecordError(f"expected a JSON object, got {type(rec).__name__}")
    convs = rec.get("conversations")
    if convs is None:
        raise RecordError("missing", "conversations")
    if not isinstance(convs, list) or not convs:
        raise RecordError("must be a non-empty list of {from, value} turns", "conversations")
    texts, placeholders = [], 0
    for t, turn in enumerate(convs):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise RecordError(f"turn {t} must be an object with a string 'value'", "conversations")
        if not isinstance(turn.get("from"), str):
            raise RecordError(f"turn {t} must say who speaks ('from')", "conversations")
        value = turn["value"]
        placeholders += value.count(IMAGE_PLACEHOLDER)
        texts.append(value.replace(IMAGE_PLACEHOLDER, ""))
    image = rec.get("image")
    if image is None:
        images = []
    elif isinstance(image, str):
        images = [image]
    elif isinstance(image, list) and all(isinstance(x, str) for x in image):
        images = list(image)
    else:
        raise RecordError(f"must be a path or a list of paths, got {_short(image)}", "image")
    if any(not x.strip() for x in images):
        raise RecordError("empty image path", "image")
    if len(images) > MAX_IMAGES:
        raise RecordError(f"{len(images)} images is absurd", "image")
    if placeholders and placeholders != len(images):
        raise RecordError(
            f"{placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but {len(images)} image(s)", "conversations"
        )
    sizes = _given_sizes(rec, len(images))
    key = None
    if "id" in rec and rec["id"] is not None:
        if isinstance(rec["id"], bool) or not isinstance(rec["id"], (str, int)):
            raise RecordError(f"must be a string or an integer, got {_short(rec['id'])}", "id")
        key = hash_key(f"{file_name}#{rec['id']}")
    return {"texts": texts, "images": images, "sizes": sizes, "key": key}


def _given_sizes(rec: dict, num_images: int):
    has_w, has_h = "width" in rec, "height" in rec
    if not (has_w or has_h):
        return None
    if has_w != has_h:
        raise RecordError("width and height must be given together", "width" if has_h else "height")
    if num_images == 0:
        raise RecordError("width/height given for a record without an image", "width")
    ws, hs = rec["width"], rec["height"]
    if num_images == 1 and not isinstance(ws, list):
        ws, hs = [ws], [hs]
    for name, vals in (("width", ws), ("height", hs)):
        if not isinstance(vals, list) or len(vals) != num_images:
            raise RecordError(f"must be one size per image ({num_images}), got {_short(vals)}", name)
        for v in vals:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v):
                raise RecordError(f"must be a whole number of pixels, got {_short(v)}", name)
            if not 1 <= v <= MAX_SIDE:
                raise RecordError(f"must be in [1, {MAX_SIDE}] pixels, got {_short(v)}", name)
    return [(int(w), int(h)) for w, h in zip(ws, hs)]


def _short(value) -> str:
    text = repr(value)
    return (text if len(text) <= 60 else text[:57] + "...") + f" ({type(value).__name__})"
