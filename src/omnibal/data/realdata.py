"""Real data: LLaVA / InternVL-style annotations + images + a local tokenizer -> training samples.

A record (one line of ``.jsonl`` or one entry of a ``.json`` list), as :mod:`omnibal.stats.annotations`
reads it::

    {"id": "s1", "image": "a.png" | ["a.png", "b.png"],
     "conversations": [{"from": "human", "value": "<image>\\nWhat is shown?"}, {"from": "gpt", "value": "A cat."}]}

Each sample is built exactly the way ``omnibal stats`` counts it, so its sizes equal the statistics row
(tested): images are cut into InternVL dynamic-resolution tiles (:mod:`omnibal.stats.tiles`; EXIF
rotation applied unless ``apply_exif=False``; a thumbnail tile when the grid has more than one tile),
normalised with the ImageNet mean/std; every turn's text is tokenized on its own (the ``<image>``
placeholders removed, no special tokens), preceded by ``tokens_per_turn`` template tokens, the whole sample by
``tokens_per_sample``; each image becomes ``image_marker_tokens`` markers around ``tokens_per_tile`` image
tokens per tile, put where its placeholder was (at the start of the first turn when the record has none).
A text-only sample carries one dummy tile (zeros) that fills no token slot, like InternVL's.
Labels: the text tokens of assistant turns (``from`` = ``gpt`` / ``assistant``); everything else is ignored.

The image and marker token ids default to the tokenizer's own ``<IMG_CONTEXT>``, ``<img>``, ``</img>``
tokens when it has them, else (and the template id always) to ids just past its vocabulary
(:attr:`RealDataset.vocab_size_needed` says how many embedding rows the model needs).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from omnibal.data.collate import IGNORE_INDEX
from omnibal.errors import InputError
from omnibal.stats.table import SampleStats, hash_key, index_keys
from omnibal.stats.tiles import TileConfig, choose_grids

IMAGE_PLACEHOLDER = "<image>"
IMAGE_CONTEXT_TOKEN, IMAGE_START_TOKEN, IMAGE_END_TOKEN = "<IMG_CONTEXT>", "<img>", "</img>"  # InternVL's
ASSISTANT_ROLES = ("gpt", "assistant")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True, kw_only=True)
class RealDataConfig:
    """How annotation records become samples (keep it equal to the ``omnibal stats`` settings)."""

    tokenizer: str
    """Local tokenizer: a ``tokenizer.json`` file or a folder holding one."""
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
    image_token_id: int | None = None
    """Id of an image slot (None: the tokenizer's ``<IMG_CONTEXT>``, else its vocabulary size)."""
    image_start_id: int | None = None
    """Id of the opening image marker (None: ``<img>``, else vocabulary size + 1)."""
    image_end_id: int | None = None
    """Id of the closing image marker (None: ``</img>``, else vocabulary size + 2)."""
    template_token_id: int | None = None
    """Id written into template slots (None: vocabulary size + 3)."""


    @classmethod
    def like_stats(cls, annotation_config, **overrides) -> "RealDataConfig":
        """The settings of an ``omnibal.stats.annotations.AnnotationConfig`` (same tokenizer, tile rule, token
        layout), so the samples have exactly the sizes ``omnibal stats`` computed with it."""
        a = annotation_config
        if a.tokenizer is None:
            raise InputError("the statistics were made with the token estimate; samples need a real tokenizer",
                             source="AnnotationConfig", field="tokenizer")
        fields = dict(tokenizer=str(a.tokenizer), image_root=a.image_root, tiles=a.tiles,
                      tokens_per_tile=a.tokens.tokens_per_tile, image_marker_tokens=a.tokens.image_marker_tokens,
                      tokens_per_turn=a.tokens.tokens_per_turn, tokens_per_sample=a.tokens.tokens_per_sample,
                      count_dummy_tile=a.count_dummy_tile, split_max_tiles=a.split_max_tiles, apply_exif=a.apply_exif)
        fields.update(overrides)
        return cls(**fields)


class RealDataset(Dataset):
    """Map-style dataset over one annotation file; ``dataset[i]`` has the collator's sample format
    (:mod:`omnibal.data.collate`) plus ``key`` (the same fingerprint ``omnibal stats`` gives the row)."""

    def __init__(self, annotation_file: str | os.PathLike, config: RealDataConfig) -> None:
        self.path = Path(annotation_file)
        self.config = config
        self.records, self.locators = _read_records(self.path)
        self.image_root = Path(config.image_root) if config.image_root else self.path.parent
        self._tokenizer = _load_tokenizer(config.tokenizer)
        base = self._tokenizer.get_vocab_size(with_added_tokens=True)

        def pick(value, token: str | None, offset: int) -> int:
            if value is not None:
                return int(value)
            own = self._tokenizer.token_to_id(token) if token else None
            return own if own is not None else base + offset

        self.image_token_id = pick(config.image_token_id, IMAGE_CONTEXT_TOKEN, 0)
        self.image_start_id = pick(config.image_start_id, IMAGE_START_TOKEN, 1)
        self.image_end_id = pick(config.image_end_id, IMAGE_END_TOKEN, 2)
        self.template_token_id = pick(config.template_token_id, None, 3)
        self.vocab_size_needed = max(base, self.image_token_id + 1, self.image_start_id + 1, self.image_end_id + 1,
                                     self.template_token_id + 1)

    def __len__(self) -> int:
        return len(self.records)

    def __getstate__(self):  # DataLoader workers: the Rust tokenizer pickles through its JSON form
        state = dict(self.__dict__)
        state["_tokenizer"] = self._tokenizer.to_str()
        return state

    def __setstate__(self, state):
        from tokenizers import Tokenizer

        state["_tokenizer"] = Tokenizer.from_str(state["_tokenizer"])
        self.__dict__.update(state)

    def key(self, index: int) -> int:
        rec = self.records[index]
        if rec.get("id") is not None:
            return hash_key(f"{self.path.name}#{rec['id']}")
        return int(index_keys(self.path.name, 1, start=index)[0])  # the same key `omnibal stats` gives

    def __getitem__(self, index: int) -> dict:
        cfg = self.config
        rec = self.records[index]
        where = dict(source=str(self.path), record=self.locators[index])
        convs = rec.get("conversations")
        if not isinstance(convs, list) or not convs:
            raise InputError("must be a non-empty list of {from, value} turns", field="conversations", **where)
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
            enc = self._tokenizer.encode(text, add_special_tokens=False)
            starts = [s for s, _ in enc.offsets]
            target = turn.get("from") in ASSISTANT_ROLES
            turn_ids: list[int] = [self.template_token_id] * cfg.tokens_per_turn
            turn_labels: list[int] = [IGNORE_INDEX] * cfg.tokens_per_turn
            at = 0
            for cut, block in zip(cuts, inserted):
                stop = next((k for k in range(at, len(starts)) if starts[k] >= cut), len(starts))
                turn_ids += enc.ids[at:stop] + block
                turn_labels += (enc.ids[at:stop] if target else [IGNORE_INDEX] * (stop - at)) + [IGNORE_INDEX] * len(block)
                at = stop
            turn_ids += enc.ids[at:]
            turn_labels += enc.ids[at:] if target else [IGNORE_INDEX] * (len(enc.ids) - at)
            ids += turn_ids
            labels += turn_labels
        if tiles_per_image:
            pixels = torch.cat(tiles_per_image)
        else:
            n = 1 if cfg.count_dummy_tile else 0
            pixels = torch.zeros(n, 3, cfg.tiles.tile_size, cfg.tiles.tile_size)
        if not ids:
            raise InputError("no tokens (empty conversation)", field="conversations", **where)
        return {"pixel_values": pixels, "input_ids": torch.tensor(ids, dtype=torch.int64),
                "labels": torch.tensor(labels, dtype=torch.int64), "index": index, "key": self.key(index)}

    def _image_block(self, num_tiles: int) -> list[int]:
        m = self.config.image_marker_tokens
        return ([self.image_start_id] * (m - m // 2) + [self.image_token_id] * (num_tiles * self.config.tokens_per_tile)
                + [self.image_end_id] * (m // 2))

    def _load_tiles(self, rel: str, num_images: int, where: dict) -> torch.Tensor:
        from PIL import Image, ImageOps, UnidentifiedImageError

        cfg = self.config
        path = Path(rel) if os.path.isabs(rel) else self.image_root / rel
        try:
            with Image.open(path) as img:
                img = ImageOps.exif_transpose(img) if cfg.apply_exif else img
                img = img.convert("RGB")
        except FileNotFoundError:
            raise InputError(f"image not found: {path}", field="image", **where) from None
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
        arr = (arr - np.array(IMAGENET_MEAN, np.float32)) / np.array(IMAGENET_STD, np.float32)
        return torch.from_numpy(np.ascontiguousarray(arr.transpose(0, 3, 1, 2)))

    @functools.cached_property
    def stats(self) -> SampleStats:
        """Per-sample sizes (what the balancer and the trainer read); see :meth:`measure_stats`."""
        return self.measure_stats()

    def measure_stats(self) -> SampleStats:
        """Sizes of every sample, by building it (slow: decodes every image; ``omnibal stats`` reads headers).
        Used to check that the two agree."""
        samples = [self[i] for i in range(len(self))]
        images = [0 if r.get("image") is None else 1 if isinstance(r["image"], str) else len(r["image"])
                  for r in self.records]
        return SampleStats.from_arrays(tiles=[s["pixel_values"].shape[0] for s in samples],
                                       tokens=[len(s["input_ids"]) for s in samples], images=images,
                                       keys=np.array([s["key"] for s in samples], dtype=np.uint64), source=str(self.path))


def _read_records(path: Path) -> tuple[list[dict], list[str]]:
    """Records and their locators (``line N`` of a .jsonl file, ``index N`` of a .json list)."""
    if not path.is_file():
        raise InputError("annotation file not found", source=str(path))
    text = path.read_text(encoding="utf-8")
    records, locators = [], []
    if path.suffix == ".jsonl":
        for line_no, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"malformed JSON: {exc.msg}", source=str(path), record=f"line {line_no}") from None
                if not isinstance(rec, dict):
                    raise InputError("expected a JSON object", source=str(path), record=f"line {line_no}")
                records.append(rec)
                locators.append(f"line {line_no}")
        return records, locators
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"malformed JSON: {exc.msg} (line {exc.lineno})", source=str(path)) from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise InputError("a .json annotation file must hold a list of records (objects)", source=str(path))
    return data, [f"index {i}" for i in range(len(data))]


def _load_tokenizer(path: str):
    from tokenizers import Tokenizer

    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise InputError("tokenizer.json not found", source=str(p), field="tokenizer")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust library raises plain Exceptions for malformed files
        raise InputError(f"not a tokenizer.json: {exc}", source=str(file), field="tokenizer") from None
    if tok.get_vocab_size(with_added_tokens=True) < 32:
        raise InputError("tokenizer vocabulary below 32 tokens: the file did not load as intended",
                         source=str(file), field="tokenizer")
    return tok
