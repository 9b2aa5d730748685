"""Real data: LLaVA / InternVL-style annotations + images + a local tokenizer -> training samples.

A record (one line of ``.jsonl`` or one entry of a ``.json`` list), as :mod:`omnibal.stats.annotations`
reads it::

    {"id": "s1", "image": "a.png" | ["a.png", "b.png"],
     "conversations": [{"from": "human", "value": "<image>\\nWhat is shown?"}, {"from": "gpt", "value": "A cat."}]}

Each sample is built exactly the way ``omnibal stats`` counts it, so its sizes equal the statistics row
(tested): images are cut into InternVL dynamic-resolution tiles (:mod:`omnibal.stats.tiles`; EXIF
rotation applied unless ``apply_exif=False``; a thumbnail tile when the grid has more than one tile),
normalised with ``image_mean`` / ``image_std`` (ImageNet's by default); every turn's text is tokenized on its
own (the ``<image>`` placeholders removed, no special tokens), preceded by ``tokens_per_turn`` template tokens,
the whole sample by ``tokens_per_sample``; each image becomes ``image_marker_tokens`` markers around
``tokens_per_tile`` image tokens per tile, put where its placeholder was (at the start of the first turn when
the record has none).
A text-only sample carries one dummy tile (zeros) that fills no token slot, like InternVL's.
Labels: the text tokens of assistant turns (``from`` = ``gpt`` / ``assistant``); everything else is ignored.

The image and marker token ids default to the tokenizer's own ``<IMG_CONTEXT>``, ``<img>``, ``</img>``
tokens when it has them, else (and the template id always) to ids just past its vocabulary
(:attr:`RealDataset.vocab_size_needed` says how many embedding rows the model needs).

For a Hugging Face checkpoint, ``RealDataConfig.from_hf(folder)`` sets what the model takes (tile size,
tokens per tile, tile cap, ``<img>`` / ``</img>`` markers, token ids, normalisation;
:mod:`omnibal.data.hf_conventions`), and ``RealDataset.check_model(model)`` refuses a hand-made config that
does not match it.

One reader, one tokenizer loader, one key: records are read by :func:`omnibal.stats.annotations.iter_records`
and checked by :func:`omnibal.stats.records.parse_record` (what ``omnibal stats`` does), the tokenizer is
loaded by :func:`omnibal.stats.tokens.make_counter`, image paths outside the image root are refused the same
way, and every sample has the key ``omnibal stats`` gives its row. Given the statistics (``stats=``), the
dataset follows *their* rows: ``dataset[i]`` is the record whose key is ``stats.keys[i]``, whatever records
``omnibal stats --on-error skip`` left out, and a sample whose sizes differ from its row is refused.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.data import Dataset

from omnibal.data.collate import IGNORE_INDEX
from omnibal.data.hf_conventions import (
    IMAGE_CONTEXT_TOKEN,
    IMAGE_END_TOKEN,
    IMAGE_START_TOKEN,
    check_fits,
    hf_data_fields,
)
from omnibal.errors import InputError
from omnibal.stats.annotations import AnnotationConfig, compute_stats, iter_records, record_keys
from omnibal.stats.records import RecordError, check_inside, parse_json_line, parse_record
from omnibal.stats.table import SampleStats
from omnibal.stats.tiles import TileConfig, choose_grids, open_image_file
from omnibal.stats.tokens import TokenConfig, make_counter

IMAGE_PLACEHOLDER = "<image>"
__all__ = ["IMAGE_CONTEXT_TOKEN", "IMAGE_END_TOKEN", "IMAGE_PLACEHOLDER", "IMAGE_START_TOKEN", "RealDataConfig",
           "RealDataset"]
ASSISTANT_ROLES = ("gpt", "assistant")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True, kw_only=True)
class RealDataConfig:
    """How annotation records become samples (keep it equal to the ``omnibal stats`` settings). For a Hugging
    Face checkpoint, :meth:`from_hf` fills in what the model takes (tile size, tokens per tile, tile cap,
    markers, token ids); set by hand, the fields must match the model (``RealDataset.check_model``)."""

    tokenizer: str
    """Local tokenizer: a ``tokenizer.json`` file or a tokenizer folder (as ``omnibal stats --tokenizer``)."""
    image_root: str | None = None
    """Folder image paths are relative to (None: the annotation file's folder)."""
    tiles: TileConfig = field(default_factory=TileConfig)
    """InternVL dynamic-resolution settings; ``tile_size`` must be the model's image size."""
    tokens_per_tile: int = 256
    """LLM image tokens per tile (the model's ``llm_tokens_per_tile``)."""
    image_marker_tokens: int = 2
    """Marker tokens around each image's tokens (InternVL's ``<img>`` ... ``</img>``)."""
    tokens_per_turn: int = 0
    """Chat-template tokens before each turn."""
    tokens_per_sample: int = 0
    """Template tokens once per sample (system prompt, BOS)."""
    count_dummy_tile: bool = True
    """Text-only samples carry one dummy tile through the vision encoder."""
    split_max_tiles: bool = False
    """Multi-image samples: each image gets at most ``max(1, max_tiles // num_images)`` tiles."""
    apply_exif: bool = True
    """Rotate by the EXIF orientation before tiling (False: InternVL's loader, raw pixels)."""
    allow_outside_root: bool = False
    """Accept image paths leading outside the image root (refused by default, as by ``omnibal stats``)."""
    image_mean: tuple[float, float, float] = IMAGENET_MEAN
    """Per-channel mean the pixels are normalised by (the model's image processor's ``image_mean``)."""
    image_std: tuple[float, float, float] = IMAGENET_STD
    """Per-channel standard deviation (the image processor's ``image_std``)."""
    image_token_id: int | None = None
    """Id of an image slot (None: the tokenizer's ``<IMG_CONTEXT>``, else its vocabulary size)."""
    image_start_id: int | None = None
    """Id of the opening image marker (None: ``<img>``, else vocabulary size + 1)."""
    image_end_id: int | None = None
    """Id of the closing image marker (None: ``</img>``, else vocabulary size + 2)."""
    template_token_id: int | None = None
    """Id written into template slots (None: vocabulary size + 3)."""

    def annotation_config(self, **overrides) -> AnnotationConfig:
        """The ``omnibal stats`` settings that count exactly these samples' sizes."""
        fields = dict(image_root=self.image_root, tokenizer=self.tokenizer, tiles=self.tiles,
                      tokens=TokenConfig(tokens_per_tile=self.tokens_per_tile,
                                         image_marker_tokens=self.image_marker_tokens,
                                         tokens_per_turn=self.tokens_per_turn,
                                         tokens_per_sample=self.tokens_per_sample),
                      count_dummy_tile=self.count_dummy_tile, split_max_tiles=self.split_max_tiles,
                      apply_exif=self.apply_exif, allow_outside_root=self.allow_outside_root)
        fields.update(overrides)
        return AnnotationConfig(**fields)

    @classmethod
    def from_hf(cls, model, *, tokenizer=None, image_root=None, max_tiles: int | None = None,
                **data) -> RealDataConfig:
        """The samples a Llava / InternVL checkpoint takes (:mod:`omnibal.data.hf_conventions`): ``model`` is
        its folder (``config.json``, and ``preprocessor_config.json`` when there is one), a transformers config
        or a model. ``tokenizer`` defaults to the folder's own; ``max_tiles`` to the checkpoint's
        ``max_patches`` (InternVL; 12 without one; a Llava image is one tile whatever it says). ``data``: the
        fields that describe the data, not the model (``tokens_per_turn``, ``tokens_per_sample``, ``count_dummy_tile``,
        ``split_max_tiles``, ``apply_exif``, ``allow_outside_root``, ``template_token_id``)."""
        return cls(**hf_data_fields(model, tokenizer=tokenizer, image_root=image_root, max_tiles=max_tiles, **data))

    @classmethod
    def like_stats(cls, annotation_config, **overrides) -> RealDataConfig:
        """The settings of an ``omnibal.stats.annotations.AnnotationConfig`` (same tokenizer, tile rule, token
        layout), so the samples have exactly the sizes ``omnibal stats`` computed with it."""
        a = annotation_config
        if a.tokenizer is None:
            raise InputError("the statistics were made with the token estimate; samples need a real tokenizer",
                             source="AnnotationConfig", field="tokenizer")
        fields = dict(tokenizer=str(a.tokenizer), image_root=a.image_root, tiles=a.tiles,
                      tokens_per_tile=a.tokens.tokens_per_tile, image_marker_tokens=a.tokens.image_marker_tokens,
                      tokens_per_turn=a.tokens.tokens_per_turn, tokens_per_sample=a.tokens.tokens_per_sample,
                      count_dummy_tile=a.count_dummy_tile, split_max_tiles=a.split_max_tiles, apply_exif=a.apply_exif,
                      allow_outside_root=a.allow_outside_root)
        fields.update(overrides)
        return cls(**fields)


class RealDataset(Dataset):
    """Map-style dataset over one annotation file; ``dataset[i]`` has the collator's sample format
    (:mod:`omnibal.data.collate`) plus ``key`` (the same fingerprint ``omnibal stats`` gives the row).

    ``stats``: the file's statistics (``omnibal stats`` with the same settings, or :attr:`stats`); the
    dataset then has their rows, joined by key. Without it, every record of the file, which must all be
    valid."""

    def __init__(self, annotation_file: str | os.PathLike, config: RealDataConfig, *,
                 stats: SampleStats | None = None) -> None:
        self.path = Path(annotation_file)
        self.config = config
        self.image_root = Path(config.image_root) if config.image_root else self.path.parent
        self._tokenizer = make_counter(config.tokenizer)
        self.records, self.locators, self.keys = _read_records(self.path, strict=stats is None)
        if stats is not None:
            self._follow_stats(stats)
        self._stats = stats
        base = self._tokenizer.vocab_size

        def pick(value, token: str | None, offset: int) -> int:
            if value is not None:
                return int(value)
            own = self._tokenizer.token_to_id(token) if token else None
            return own if own is not None else base + offset

        self.image_token_id = pick(config.image_token_id, IMAGE_CONTEXT_TOKEN, 0)
        self.image_start_id = pick(config.image_start_id, IMAGE_START_TOKEN, 1)
        self.image_end_id = pick(config.image_end_id, IMAGE_END_TOKEN, 2)
        self.template_token_id = pick(config.template_token_id, None, 3)
        used = [self.image_token_id]  # ids that never occur in a sample need no embedding row
        used += [self.image_start_id, self.image_end_id] if config.image_marker_tokens else []
        used += [self.template_token_id] if config.tokens_per_turn or config.tokens_per_sample else []
        self.vocab_size_needed = max(base, *(i + 1 for i in used))

    def _follow_stats(self, stats: SampleStats) -> None:
        """Reorder the records to the statistics' rows (by key, one sorted lookup); every row must find its
        record."""
        keys = np.asarray(self.keys, np.uint64)
        want = np.asarray(stats.keys, np.uint64)
        order = np.argsort(keys, kind="stable")
        if len(keys):
            rows = order[np.minimum(np.searchsorted(keys[order], want), len(keys) - 1)]
            missing = keys[rows] != want
        else:
            rows, missing = np.zeros(0, np.int64), np.ones(len(want), bool)
        if missing.any():
            r = int(np.argmax(missing))
            raise InputError(f"statistics row {r} (key {int(want[r])}) matches no valid record of the annotation "
                             f"file: the statistics were made from another file", source=str(self.path),
                             record=f"row {r}", field="key")
        self.records = [self.records[i] for i in rows.tolist()]
        self.locators = [self.locators[i] for i in rows.tolist()]
        self.keys = keys[rows]

    def check_model(self, model) -> None:
        """Refuse a Hugging Face ``model`` (folder, config or model) that would not take these samples: an
        ``InputError`` naming the ``RealDataConfig`` field (tile size, tokens per tile, markers, token ids)
        and what the model takes, before any forward pass."""
        check_fits(self, model, source=f"RealDataConfig of {self.path}")

    def __len__(self) -> int:
        return len(self.records)

    def key(self, index: int) -> int:
        return int(self.keys[index])

    def __getitem__(self, index: int) -> dict:
        cfg = self.config
        rec = self.records[index]
        where = dict(source=str(self.path), record=self.locators[index])
        convs = rec["conversations"]  # checked by parse_record when the file was read
        images = rec.get("image")
        images = [] if images is None else [images] if isinstance(images, str) else list(images)
        num_placeholders = sum(str(t.get("value", "")).count(IMAGE_PLACEHOLDER) for t in convs
                               if isinstance(t, dict))
        if num_placeholders not in (0, len(images)):
            raise InputError(f"{num_placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but {len(images)} image(s)",
                             field="conversations", **where)
        tiles_per_image = [self._load_tiles(p, len(images), where) for p in images]
        # image blocks go where their placeholders are; with none, at the start of the first turn (InternVL)
        blocks = [self._image_block(t.shape[0]) for t in tiles_per_image]
        ids: list[int] = [self.template_token_id] * cfg.tokens_per_sample
        labels: list[int] = [IGNORE_INDEX] * cfg.tokens_per_sample
        next_block = 0
        for t, turn in enumerate(convs):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise InputError(f"turn {t} must be an object with a string 'value'", field="conversations", **where)
            pieces = turn["value"].split(IMAGE_PLACEHOLDER)
            text = "".join(pieces)
            cuts = list(np.cumsum([len(p) for p in pieces[:-1]]))  # placeholder positions in the text
            if t == 0 and num_placeholders == 0 and blocks:
                cuts, inserted = [0] * len(blocks), blocks
            else:
                inserted = blocks[next_block:next_block + len(cuts)]
                next_block += len(cuts)
            enc_ids, starts = self._tokenizer.encode(text)
            target = turn.get("from") in ASSISTANT_ROLES
            turn_ids: list[int] = [self.template_token_id] * cfg.tokens_per_turn
            turn_labels: list[int] = [IGNORE_INDEX] * cfg.tokens_per_turn
            at = 0
            for cut, block in zip(cuts, inserted):
                stop = next((k for k in range(at, len(starts)) if starts[k] >= cut), len(starts))
                turn_ids += enc_ids[at:stop] + block
                turn_labels += ((enc_ids[at:stop] if target else [IGNORE_INDEX] * (stop - at))
                                + [IGNORE_INDEX] * len(block))
                at = stop
            turn_ids += enc_ids[at:]
            turn_labels += enc_ids[at:] if target else [IGNORE_INDEX] * (len(enc_ids) - at)
            ids += turn_ids
            labels += turn_labels
        if tiles_per_image:
            pixels = torch.cat(tiles_per_image)
        else:
            n = 1 if cfg.count_dummy_tile else 0
            pixels = torch.zeros(n, 3, cfg.tiles.tile_size, cfg.tiles.tile_size)
        if not ids:
            raise InputError("no tokens (empty conversation)", field="conversations", **where)
        if self._stats is not None and (pixels.shape[0], len(ids)) != (int(self._stats.tiles[index]),
                                                                        int(self._stats.tokens[index])):
            raise InputError(f"the record builds {pixels.shape[0]} tiles / {len(ids)} tokens, its statistics row "
                             f"{index} says {int(self._stats.tiles[index])} / {int(self._stats.tokens[index])}: "
                             "the statistics were made with other settings (tile rule, tokenizer, tokens per "
                             "tile)", field="tokens", **where)
        return {"pixel_values": pixels, "input_ids": torch.tensor(ids, dtype=torch.int64),
                "labels": torch.tensor(labels, dtype=torch.int64), "index": index, "key": self.key(index)}

    def _image_block(self, num_tiles: int) -> list[int]:
        m = self.config.image_marker_tokens
        return ([self.image_start_id] * (m - m // 2) + [self.image_token_id] * (num_tiles * self.config.tokens_per_tile)
                + [self.image_end_id] * (m // 2))

    def _load_tiles(self, rel: str, num_images: int, where: dict) -> torch.Tensor:
        cfg = self.config
        path = Path(rel) if os.path.isabs(rel) else self.image_root / rel
        if not cfg.allow_outside_root:
            check_inside(str(path), rel, os.path.realpath(self.image_root), {}, where["source"], where["record"])
        try:
            with open_image_file(path, **where) as f, Image.open(f) as img:  # a FIFO or device is refused
                img = ImageOps.exif_transpose(img) if cfg.apply_exif else img
                img = img.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise InputError(f"unreadable image {path}: {exc}", field="image", **where) from None
        tcfg = cfg.tiles
        if cfg.split_max_tiles and num_images > 1:
            cap = max(1, tcfg.max_tiles // num_images)
            tcfg = TileConfig(min_tiles=min(tcfg.min_tiles, cap), max_tiles=cap, tile_size=tcfg.tile_size,
                              use_thumbnail=tcfg.use_thumbnail)
        cols, rows = (int(x[0]) for x in choose_grids([img.width], [img.height], tcfg))
        s = tcfg.tile_size
        resized = img.resize((cols * s, rows * s), Image.Resampling.BICUBIC)
        crops = [resized.crop((c * s, r * s, (c + 1) * s, (r + 1) * s)) for r in range(rows) for c in range(cols)]
        if tcfg.use_thumbnail and len(crops) > 1:
            crops.append(img.resize((s, s), Image.Resampling.BICUBIC))
        arr = np.stack([np.asarray(c, dtype=np.float32) for c in crops]) / 255.0
        arr = (arr - np.array(cfg.image_mean, np.float32)) / np.array(cfg.image_std, np.float32)
        return torch.from_numpy(np.ascontiguousarray(arr.transpose(0, 3, 1, 2)))

    @functools.cached_property
    def stats(self) -> SampleStats:
        """Per-sample sizes (what the balancer and the trainer read): the statistics given, else
        ``omnibal stats`` of the file with the same settings (image headers only; fast)."""
        if self._stats is not None:
            return self._stats
        return compute_stats(self.path, self.config.annotation_config())[0]

    def measure_stats(self) -> SampleStats:
        """Sizes of every sample, by building it (slow: decodes every image; ``omnibal stats`` reads headers).
        Used to check that the two agree."""
        samples = [self[i] for i in range(len(self))]
        images = [0 if r.get("image") is None else 1 if isinstance(r["image"], str) else len(r["image"])
                  for r in self.records]
        return SampleStats.from_arrays(tiles=[s["pixel_values"].shape[0] for s in samples],
                                       tokens=[len(s["input_ids"]) for s in samples], images=images,
                                       keys=np.array([s["key"] for s in samples], dtype=np.uint64),
                                       source=str(self.path))


def _read_records(path: Path, *, strict: bool) -> tuple[list[dict], list[str], np.ndarray]:
    """Valid records, their locators (``line N`` / ``index N``) and keys, read and checked as ``omnibal stats``
    reads them. ``strict``: the first bad record raises (no statistics say which ones were skipped);
    otherwise bad records are left out (a statistics row that needs one is refused by the key join)."""
    if not path.is_file():
        raise InputError("annotation file not found", source=str(path))
    records, locators, indices, id_keys, has_id = [], [], [], [], []
    for locator, index, payload in iter_records(path):
        try:
            rec = parse_json_line(payload) if isinstance(payload, bytes) else payload
            parsed = parse_record(rec, path.name)
        except RecordError as exc:
            if strict:
                raise InputError(exc.message, source=str(path), record=locator, field=exc.field) from None
            continue
        records.append(rec)
        locators.append(locator)
        indices.append(index)
        id_keys.append(parsed["key"] or 0)
        has_id.append(parsed["key"] is not None)
    keys = record_keys(path.name, np.asarray(indices, np.int64), np.asarray(id_keys, np.uint64), np.asarray(has_id))
    unique, first, counts = np.unique(keys, return_index=True, return_counts=True)
    if len(unique) < len(keys):
        dup = int(unique[np.argmax(counts > 1)])
        where = [locators[i] for i in np.flatnonzero(keys == dup)[:2]]
        raise InputError(f"records {where[0]} and {where[1]} have the same id: ids must be unique so that "
                         "statistics rows join their records", source=str(path), record=where[1], field="id")
    return records, locators, keys
