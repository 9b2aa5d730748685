"""What a Hugging Face VLM checkpoint takes as a sample (Llava / InternVL, transformers 5.x): tile size, image
tokens per tile, tile cap, image markers and token ids, pixel normalisation.

One owner: :meth:`omnibal.data.realdata.RealDataConfig.from_hf` builds its settings here, and ``omnibal stats
--hf-model``, ``omnibal train --hf-model`` and :class:`omnibal.integrations.hf.OmnibalTrainer` all go through
it; :func:`check_fits` refuses a dataset whose samples the model would not take, by field, before any forward
(instead of HF's "Image features and image tokens do not match" deep in the model).

The checkpoint's own processor is followed:

- **Llava** (LLaVA-1.5): one image is one tile of the vision tower's ``image_size`` (no dynamic tiles, no
  thumbnail), no markers; ``(image_size / patch_size)**2`` image tokens (the config's ``image_token_id``).
- **InternVL**: dynamic-resolution tiles of the vision ``image_size`` (:mod:`omnibal.stats.tiles`, a thumbnail
  when the grid has more than one tile), between ``min_patches`` and ``max_patches`` of the checkpoint's
  ``preprocessor_config.json`` (1 and 12 without one); each image wrapped in the tokenizer's ``<img>`` and
  ``</img>`` (the processor's ``start_image_token`` / ``end_image_token``);
  ``(image_size / patch_size)**2 * downsample_ratio**2`` image tokens per tile.

Both: pixels normalised with the ``preprocessor_config.json`` ``image_mean`` / ``image_std`` when the checkpoint
has one; tokens per tile and tile size come from :func:`omnibal.cost.hf_spec.spec_from_hf_config`, the same
reading the planner makes of ``config.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from omnibal.cost.hf_spec import load_hf_config, spec_from_hf_config
from omnibal.errors import InputError
from omnibal.stats.tiles import TileConfig
from omnibal.stats.tokens import make_counter
from omnibal.validate import is_int

IMAGE_CONTEXT_TOKEN, IMAGE_START_TOKEN, IMAGE_END_TOKEN = "<IMG_CONTEXT>", "<img>", "</img>"  # InternVL's
DEFAULT_MAX_TILES = 12
"""InternVL's tile cap when the checkpoint has no ``preprocessor_config.json`` (its chat models' ``max_num``)."""
DATA_FIELDS = ("tokens_per_turn", "tokens_per_sample", "count_dummy_tile", "split_max_tiles", "apply_exif",
               "allow_outside_root", "template_token_id")
"""``RealDataConfig`` fields that describe the data, not the model: the only ones ``from_hf`` lets a caller set."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True, kw_only=True)
class ModelImages:
    """How one checkpoint consumes images (see the module docstring)."""

    kind: str
    """``config.model_type``: ``llava`` or ``internvl``."""
    where: str
    """Where the config was read (``DIR/config.json`` or ``model.config``), for error messages."""
    folder: Path | None
    """The checkpoint folder (None when given a config or a model object)."""
    tile_size: int
    """Vision input side in pixels."""
    tokens_per_tile: int
    """LLM image tokens one tile becomes."""
    image_token_id: int
    """The config's ``image_token_id``: the slots image features are written into."""
    vocab_size: int
    """Rows of the language model's embedding."""
    markers: int
    """Marker tokens around each image (InternVL's ``<img>`` and ``</img>``: 2; Llava: 0)."""
    min_tiles: int = 1
    """Smallest grid (``preprocessor_config.json`` ``min_patches``)."""
    max_tiles: int = 1
    """Tile cap (``max_patches``; Llava: 1)."""
    normalisation: tuple = ()
    """``(("image_mean", (r, g, b)), ("image_std", (r, g, b)))`` from ``preprocessor_config.json``, when given."""


def _config_of(model):
    """``(config, folder, where)`` of a checkpoint folder, a transformers config or a model with ``.config``."""
    if isinstance(model, (str, os.PathLike)):
        folder = Path(model)
        return load_hf_config(folder), folder, str(folder / "config.json")
    if hasattr(model, "model_type"):
        return model, None, f"{model.model_type} config"
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise InputError(f"expected a checkpoint folder, a transformers config or model, got {type(model).__name__}",
                         source="model", field="hf_model")
    return config, None, "model.config"


def _preprocessor(folder: Path | None) -> dict:
    """``image_mean`` / ``image_std`` / ``min_patches`` / ``max_patches`` of ``preprocessor_config.json``."""
    path = None if folder is None else folder / "preprocessor_config.json"
    if path is None or not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"unreadable: {exc}", source=str(path)) from None
    out: dict = {}
    for key in ("image_mean", "image_std"):
        value = doc.get(key)
        if value is not None:
            if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value)):
                raise InputError(f"must be three numbers, got {value!r}", source=str(path), field=key)
            out[key] = tuple(float(v) for v in value)
    for key in ("min_patches", "max_patches"):
        value = doc.get(key)
        if value is not None:
            if not is_int(value) or value < 1:
                raise InputError(f"must be a positive integer, got {value!r}", source=str(path), field=key)
            out[key] = value
    return out


def model_images(model) -> ModelImages:
    """How ``model`` (a checkpoint folder, a transformers config, or a model) consumes images."""
    config, folder, where = _config_of(model)
    spec = spec_from_hf_config(config, where=where)  # refuses model types without an adapter
    image_id = getattr(config, "image_token_id", None)
    if image_id is None:
        image_id = getattr(config, "image_token_index", None)
    if not is_int(image_id):
        raise InputError(f"must be a token id, got {image_id!r}", source=where, field="image_token_id")
    pre = _preprocessor(folder)
    norm = tuple((k, pre[k]) for k in ("image_mean", "image_std") if k in pre)
    common = dict(kind=config.model_type, where=where, folder=folder, tile_size=spec.vision.image_size,
                  tokens_per_tile=spec.llm_tokens_per_tile, image_token_id=image_id,
                  vocab_size=spec.llm.vocab_size, normalisation=norm)
    if config.model_type == "llava":
        return ModelImages(markers=0, **common)
    low, high = pre.get("min_patches", 1), pre.get("max_patches", DEFAULT_MAX_TILES)
    if low > high:
        raise InputError(f"min_patches {low} > max_patches {high}", source=str(folder / "preprocessor_config.json"),
                         field="min_patches")
    return ModelImages(markers=2, min_tiles=low, max_tiles=high, **common)


def _tokenizer_of(images: ModelImages, tokenizer) -> str:
    if tokenizer is not None:
        return str(tokenizer)
    folder = images.folder
    if folder is not None and any((folder / name).is_file() for name in TOKENIZER_FILES):
        return str(folder)
    raise InputError("no tokenizer given and the checkpoint folder has none: pass tokenizer= (a tokenizer.json "
                     "or a tokenizer folder)", source=images.where, field="tokenizer")


def _token_ids(images: ModelImages, counter, tokenizer: str) -> dict:
    """The image slot and marker ids, checked against the tokenizer (the model's image token must be one of
    its added special tokens; InternVL's markers must be in it)."""
    image_id = images.image_token_id
    if image_id not in counter.added_token_ids():
        token = counter.id_to_token(image_id)
        what = "no token" if token is None else f"the ordinary text token {token!r}"
        raise InputError(f"the tokenizer has {what} at id {image_id}, the model's image_token_id: use the tokenizer "
                         "the checkpoint was made with (its image token is an added special token)", source=tokenizer,
                         field="tokenizer")
    if counter.vocab_size > images.vocab_size:
        raise InputError(f"the tokenizer has {counter.vocab_size} tokens, the model's embedding only "
                         f"{images.vocab_size} rows ({images.where})", source=tokenizer, field="tokenizer")
    ids = {"image_token_id": image_id}
    if images.markers:
        start, end = counter.token_to_id(IMAGE_START_TOKEN), counter.token_to_id(IMAGE_END_TOKEN)
        if start is None or end is None:
            raise InputError(f"{images.kind} wraps every image in {IMAGE_START_TOKEN} ... {IMAGE_END_TOKEN} (its "
                             f"processor's start_image_token / end_image_token); the tokenizer has no "
                             f"{IMAGE_START_TOKEN if start is None else IMAGE_END_TOKEN} token", source=tokenizer,
                             field="tokenizer")
        ids.update(image_start_id=start, image_end_id=end)
    return ids


def hf_data_fields(model, *, tokenizer=None, image_root=None, max_tiles: int | None = None, **data) -> dict:
    """The ``RealDataConfig`` keyword arguments for ``model``'s samples (see ``RealDataConfig.from_hf``)."""
    images = model_images(model)
    for key in data:
        if key not in DATA_FIELDS:
            raise InputError(f"set by the checkpoint ({images.where}); from_hf takes only {', '.join(DATA_FIELDS)}",
                             source="RealDataConfig.from_hf", field=key)
    tokenizer = _tokenizer_of(images, tokenizer)
    ids = _token_ids(images, make_counter(tokenizer), tokenizer)
    if images.kind == "llava":  # one tile per image whatever the cap (a cap is for InternVL-style models)
        tiles = TileConfig(min_tiles=1, max_tiles=1, tile_size=images.tile_size, use_thumbnail=False)
    else:
        cap = images.max_tiles if max_tiles is None else max_tiles
        tiles = TileConfig(min_tiles=min(images.min_tiles, cap), max_tiles=cap, tile_size=images.tile_size)
    return dict(tokenizer=tokenizer, image_root=None if image_root is None else str(image_root), tiles=tiles,
                tokens_per_tile=images.tokens_per_tile, image_marker_tokens=images.markers,
                **dict(images.normalisation), **ids, **data)


def check_fits(dataset, model, *, source: str) -> None:
    """Refuse a dataset (a ``RealDataset``: its ``config`` and resolved token ids) whose samples ``model``
    would not take: tile size, tokens per tile, markers, image token and marker ids, one tile per Llava image,
    embedding rows. ``InputError`` naming the ``RealDataConfig`` field and what the model takes."""
    images = model_images(model)
    cfg = dataset.config
    fix = "build it with RealDataConfig.from_hf(<checkpoint folder>)"

    def refuse(field: str, have, want, why: str) -> None:
        raise InputError(f"the data has {field} {have}, the model takes {want} ({why}, {images.where}): {fix}",
                         source=source, field=field)

    if cfg.tiles.tile_size != images.tile_size:
        refuse("tiles.tile_size", cfg.tiles.tile_size, images.tile_size, "its vision image_size")
    if cfg.tokens_per_tile != images.tokens_per_tile:
        refuse("tokens_per_tile", cfg.tokens_per_tile, images.tokens_per_tile, "image tokens per tile")
    if cfg.image_marker_tokens != images.markers:
        why = "no markers around a Llava image" if images.kind == "llava" else \
            f"{IMAGE_START_TOKEN} and {IMAGE_END_TOKEN} around each image"
        refuse("image_marker_tokens", cfg.image_marker_tokens, images.markers, why)
    if dataset.image_token_id != images.image_token_id:
        refuse("image_token_id", dataset.image_token_id, images.image_token_id, "its config's image_token_id")
    if images.kind == "llava" and (cfg.tiles.max_tiles != 1 or cfg.tiles.use_thumbnail):
        refuse("tiles.max_tiles", cfg.tiles.max_tiles, 1, "one tile per Llava image, no thumbnail")
    if images.markers:
        counter = make_counter(cfg.tokenizer)
        for field, token in (("image_start_id", IMAGE_START_TOKEN), ("image_end_id", IMAGE_END_TOKEN)):
            want = counter.token_to_id(token)
            if want is None:
                raise InputError(f"{images.kind} wraps every image in {IMAGE_START_TOKEN} ... {IMAGE_END_TOKEN}; the "
                                 f"tokenizer has no {token} token", source=cfg.tokenizer, field="tokenizer")
            if getattr(dataset, field) != want:
                refuse(field, getattr(dataset, field), want, f"the tokenizer's {token}")
    if dataset.vocab_size_needed > images.vocab_size:
        raise InputError(f"the samples need {dataset.vocab_size_needed} token ids, the model's embedding has "
                         f"{images.vocab_size} rows ({images.where})", source=source, field="tokenizer")
