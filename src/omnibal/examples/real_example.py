"""A small real training set and two tiny random-init Hugging Face VLMs to train on (``omnibal example``).

``make_real_example(out_dir)`` writes::

    out_dir/annotations.jsonl  LLaVA/InternVL records (format: omnibal.stats.annotations), image paths
                               relative to out_dir/images
    out_dir/images/            charts/*.png (matplotlib bar, line and pie charts), pages/*.png (Pillow text)
    out_dir/tokenizer/         byte-level BPE trained on the records' own text (tokenizer.json + config)
    out_dir/llava/             LlavaForConditionalGeneration: CLIP 56 px tiles of 14 px patches + Llama
    out_dir/internvl/          InternVLForConditionalGeneration: 64 px tiles of 8 px patches + Qwen2, with a
                               preprocessor_config.json (tile cap 6)
    out_dir/summary.json       what ``make_real_example`` returns

Answers are computed from what was drawn (bar values, the page's lines). Aspect ratios are picked so
InternVL's tile rule (6 tiles + thumbnail) gives 1 to 7 tiles per image; records have 1 to 3 turns, short
and long answers, one image, two or none: sizes vary, so balancing matters. 16 LLM tokens per tile in both
models. Deterministic in the seed. Built in a hidden folder inside ``out_dir``, then renamed into place: a
second run replaces the first whole; other files in ``out_dir`` are left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from omnibal.data.realdata import IMAGENET_MEAN, IMAGENET_STD
from omnibal.errors import InputError
from omnibal.examples.render import pair_qa, render, text_qa
from omnibal.outputs import write_text
from omnibal.stats.annotations import AnnotationConfig, compute_stats
from omnibal.stats.tiles import TileConfig
from omnibal.stats.tokens import TokenConfig
from omnibal.validate import is_int

__all__ = ["INTERNVL", "LLAVA", "MAX_TILES", "SPECIAL_TOKENS", "TinyVLM", "make_real_example", "prepare_output"]

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<image>", "<IMG_CONTEXT>", "<img>", "</img>")
MAX_TILES = 6  # InternVL tile rule used for the sizes: up to 6 tiles + 1 thumbnail
MAX_RECORDS = 100_000
VOCAB_SIZE = 1536  # BPE target; a small corpus may stop merging earlier
OUTPUTS = ("annotations.jsonl", "images", "tokenizer", "llava", "internvl", "summary.json")
KINDS = ("bar", "line", "pie", "page", "two_images", "text")
KIND_WEIGHTS = (0.2, 0.15, 0.12, 0.38, 0.08, 0.07)
TURN_WEIGHTS = (0.45, 0.35, 0.2)  # 1, 2 or 3 question/answer turns
@dataclass(frozen=True, kw_only=True)
class TinyVLM:
    """Shape of one tiny random-init checkpoint."""

    kind: str
    """``llava`` (CLIP vision + Llama) or ``internvl`` (InternViT + Qwen2, pixel shuffle 0.5)."""
    image_size: int
    """Vision input side in pixels: the tile size of the InternVL tile rule."""
    patch_size: int
    """Vision patch side in pixels."""
    image_token: str
    """The special token whose id marks image slots (the config's ``image_token_id``)."""
    vision_hidden: int = 64
    """Vision encoder width."""
    vision_layers: int = 2
    """Vision encoder layers (all of them are read: ``vision_feature_layer=-1``)."""
    text_hidden: int = 128
    """Language model width."""
    text_layers: int = 2
    """Language model layers."""
    vision_heads: int = 4
    """Vision attention heads."""
    text_heads: int = 4
    """Language model attention heads."""
    text_kv_heads: int = 2
    """Language model key/value heads."""
    mlp_ratio: int = 2
    """MLP width over model width, in both towers."""

    @property
    def tokens_per_tile(self) -> int:  # one per patch; a quarter of that after InternVL's pixel shuffle
        patches = (self.image_size // self.patch_size) ** 2
        return patches // 4 if self.kind == "internvl" else patches

    @property
    def image_marker_tokens(self) -> int:  # <img> and </img> around each InternVL image; none for Llava
        return 0 if self.kind == "llava" else 2

    @property
    def tiles(self) -> TileConfig:
        """How ``omnibal train`` feeds it images (omnibal.train.hf_run): InternVL dynamic tiles (6 + thumbnail,
        ``<img>`` ``</img>`` around each image); Llava (LLaVA-1.5) one resized tile per image, no markers."""
        if self.kind == "llava":
            return TileConfig(min_tiles=1, max_tiles=1, tile_size=self.image_size, use_thumbnail=False)
        return TileConfig(max_tiles=MAX_TILES, tile_size=self.image_size)


LLAVA = TinyVLM(kind="llava", image_size=56, patch_size=14, image_token="<image>")
INTERNVL = TinyVLM(kind="internvl", image_size=64, patch_size=8, image_token="<IMG_CONTEXT>")
MODELS = (LLAVA, INTERNVL)




def prepare_output(out_dir, num_records, *, out_name: str = "out_dir", records_name: str = "num_records") -> Path:
    """Check the arguments and create the output folder; InputError naming ``out_name`` / ``records_name``."""
    out = Path(out_dir)
    if not is_int(num_records) or not 1 <= num_records <= MAX_RECORDS:
        raise InputError(f"must be a whole number in [1, {MAX_RECORDS}], got {num_records!r}", source=records_name)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} exists and is not a folder", source=out_name)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the folder {out}: {exc}", source=out_name) from None
    return out


def make_real_example(out_dir, *, num_records: int = 400, seed: int = 0, progress: bool = False) -> dict:
    """Write the dataset, tokenizer and both models into ``out_dir`` (see the module docstring); returns
    the summary (paths, counts, tile histograms and token statistics per model, seconds taken)."""
    started = time.perf_counter()
    if not is_int(seed) or seed < 0:
        raise InputError(f"must be a whole number >= 0, got {seed!r}", source="seed")
    out = prepare_output(out_dir, num_records)
    stage = Path(tempfile.mkdtemp(prefix=".omnibal-example-", dir=out))
    try:
        rng = np.random.default_rng(seed)
        for sub in ("charts", "pages"):
            (stage / "images" / sub).mkdir(parents=True)
        bar = tqdm(range(num_records), desc="omnibal example", unit="record", file=sys.stderr, leave=False,
                   disable=not progress)
        records = [make_record(i, rng, stage / "images") for i in bar]
        write_text(stage / "annotations.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        fast = save_tokenizer([t["value"] for r in records for t in r["conversations"]], stage / "tokenizer")
        params = {m.kind: save_model(m, fast, stage / m.kind, seed=seed) for m in MODELS}
        summary = _summarize(stage, out, records, params, seed)
        summary["seconds"] = round(time.perf_counter() - started, 2)
        write_text(stage / "summary.json", json.dumps(summary, indent=2) + "\n")
        _publish(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return summary


def _publish(stage: Path, out: Path) -> None:
    """Rename each output into ``out``, moving a previous one aside first (into the stage, removed after)."""
    for name in OUTPUTS:
        target = out / name
        if target.is_symlink() or target.exists():
            os.replace(target, stage / f".old-{name}")
        os.replace(stage / name, target)


# -- records ------------------------------------------------------------------------------------------
def make_record(index: int, rng: np.random.Generator, images_dir: Path) -> dict:
    """One annotation record (its images rendered under ``images_dir``); its id is ``{kind}-{index}``."""
    kind = KINDS[rng.choice(len(KINDS), p=KIND_WEIGHTS)]
    rec: dict = {"id": f"{kind}-{index:05d}"}
    if kind == "text":
        rec["conversations"] = conversation(rng, text_qa(rng), "")
        return rec
    if kind == "two_images":
        first, second = (render(KINDS[rng.choice(4)], rng, images_dir, f"{index:05d}{s}") for s in "ab")
        rec["image"] = [first.path, second.path]
        rec["conversations"] = conversation(rng, pair_qa(first, second), "Image 1: <image>\nImage 2: <image>\n")
    else:
        drawn = render(kind, rng, images_dir, f"{index:05d}")
        rec["image"] = drawn.path
        rec["conversations"] = conversation(rng, drawn.qa, "<image>\n")
    return rec


def conversation(rng: np.random.Generator, qa: list, prefix: str) -> list[dict]:
    """1 to 3 distinct question/answer turns from ``qa``; ``prefix`` (the image placeholders) opens the first."""
    n = min(len(qa), 1 + int(rng.choice(len(TURN_WEIGHTS), p=TURN_WEIGHTS)))
    turns = []
    for j, k in enumerate(rng.choice(len(qa), size=n, replace=False)):
        question, answer = qa[int(k)]
        turns += [{"from": "human", "value": (prefix if j == 0 else "") + question}, {"from": "gpt", "value": answer}]
    return turns


# -- tokenizer and models ---------------------------------------------------------------------------
def save_tokenizer(texts: list[str], folder: Path, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE on ``texts``, save it for ``tokenizers`` and ``AutoTokenizer``; returns the
    transformers tokenizer."""
    # optional dependency (the hf extra), imported where it is used
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   extra_special_tokens=list(SPECIAL_TOKENS[3:]))
    fast.save_pretrained(folder)
    return fast


def build_model(spec: TinyVLM, vocab_size: int, token_ids: dict):
    """A random-init (current torch RNG) Llava or InternVL model of ``spec``'s shape, float32."""
    # optional dependency (the hf extra), imported where it is used
    import transformers as tf

    text = dict(hidden_size=spec.text_hidden, intermediate_size=spec.mlp_ratio * spec.text_hidden,
                num_attention_heads=spec.text_heads, num_hidden_layers=spec.text_layers,
                num_key_value_heads=spec.text_kv_heads, vocab_size=vocab_size,
                max_position_embeddings=4096, pad_token_id=token_ids["<pad>"], bos_token_id=token_ids["<s>"],
                eos_token_id=token_ids["</s>"], tie_word_embeddings=False)
    vision = dict(hidden_size=spec.vision_hidden, intermediate_size=spec.mlp_ratio * spec.vision_hidden,
                  num_attention_heads=spec.vision_heads, num_hidden_layers=spec.vision_layers)
    common = dict(image_token_id=token_ids[spec.image_token], image_seq_length=spec.tokens_per_tile,
                  vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=False)
    if spec.kind == "llava":
        cfg = tf.LlavaConfig(vision_config=tf.CLIPVisionConfig(image_size=spec.image_size, patch_size=spec.patch_size,
                                                               projection_dim=spec.vision_hidden, **vision),
                             text_config=tf.LlamaConfig(**text), **common)
        return tf.LlavaForConditionalGeneration(cfg).float()
    side = [spec.image_size] * 2
    cfg = tf.InternVLConfig(vision_config=tf.InternVLVisionConfig(image_size=side, patch_size=[spec.patch_size] * 2,
                                                                  **vision),
                            text_config=tf.Qwen2Config(**text), downsample_ratio=0.5, **common)
    return tf.InternVLForConditionalGeneration(cfg).float()


def save_model(spec: TinyVLM, tokenizer, folder: Path, *, seed: int) -> int:
    """Build ``spec`` from ``seed`` (the caller's torch RNG is left alone), save it and the tokenizer into
    ``folder``; returns its parameter count."""
    # optional dependency (the hf extra), imported where it is used
    from transformers.utils import logging as hf_logging

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(spec, len(tokenizer), ids)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(folder)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(folder)
    if spec.kind == "internvl":
        save_image_processor(spec, folder)
    return sum(p.numel() for p in model.parameters())


def save_image_processor(spec: TinyVLM, folder: Path) -> None:
    """InternVL's ``preprocessor_config.json`` (``GotOcr2ImageProcessor``, what ``AutoImageProcessor`` loads): its
    tile size, tile cap and ImageNet normalisation, so the checkpoint itself says how its images are cut
    (``RealDataConfig.from_hf`` reads it)."""
    doc = {"image_processor_type": "GotOcr2ImageProcessor", "processor_class": "InternVLProcessor",
           "crop_to_patches": True, "min_patches": 1, "max_patches": MAX_TILES,
           "size": {"height": spec.image_size, "width": spec.image_size}, "do_resize": True, "resample": 3,
           "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
           "image_mean": list(IMAGENET_MEAN), "image_std": list(IMAGENET_STD)}
    write_text(folder / "preprocessor_config.json", json.dumps(doc, indent=2) + "\n")


# -- summary ------------------------------------------------------------------------------------------
def _spread(values) -> dict:
    v = np.asarray(values, dtype=np.float64)
    return {"min": int(v.min()), "mean": round(float(v.mean()), 1), "p50": int(np.percentile(v, 50)),
            "p90": int(np.percentile(v, 90)), "max": int(v.max()), "total": int(v.sum())}


def _histogram(values) -> dict:
    keys, counts = np.unique(np.asarray(values), return_counts=True)
    return {int(k): int(c) for k, c in zip(keys, counts)}


def train_command(out: Path, model: str = "llava") -> str:
    """The ``omnibal train`` command for one of the models (InternVL: with the tile cap the summary used)."""
    tiles = f" --max-tiles {MAX_TILES}" if model == "internvl" else ""
    return (f"omnibal train --annotations {out / 'annotations.jsonl'} --image-root {out / 'images'} "
            f"--tokenizer {out / 'tokenizer'} --hf-model {out / model}{tiles}")


def _summarize(stage: Path, out: Path, records: list, params: dict, seed: int) -> dict:
    """Counts, and per model the tiles and sequence lengths per sample as ``omnibal stats`` counts them
    with the model's tile rule and token layout (:attr:`TinyVLM.tiles`)."""
    # optional dependency (the hf extra), imported where it is used
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(stage / "tokenizer" / "tokenizer.json"))
    text_tokens = [sum(len(tok.encode(t["value"].replace("<image>", ""), add_special_tokens=False).ids)
                       for t in r["conversations"]) for r in records]
    per_model = {}
    for m in MODELS:
        cfg = AnnotationConfig(image_root=str(stage / "images"), tokenizer=str(stage / "tokenizer" / "tokenizer.json"),
                               tiles=m.tiles, tokens=TokenConfig(tokens_per_tile=m.tokens_per_tile,
                                                                 image_marker_tokens=m.image_marker_tokens))
        stats, _ = compute_stats(stage / "annotations.jsonl", cfg)
        per_model[m.kind] = {"path": str(out / m.kind), "tile_size": m.image_size, "patch_size": m.patch_size,
                             "tokens_per_tile": m.tokens_per_tile, "image_marker_tokens": m.image_marker_tokens,
                             "image_token": m.image_token,
                             "image_token_id": tok.token_to_id(m.image_token), "parameters": params[m.kind],
                             "tiles_per_sample": _histogram(stats.tiles), "tiles": _spread(stats.tiles),
                             "tokens": _spread(stats.tokens)}
    return {
        "out_dir": str(out), "annotations": str(out / "annotations.jsonl"), "image_root": str(out / "images"),
        "tokenizer": str(out / "tokenizer"), "records": len(records), "seed": seed,
        "images": sum(1 if isinstance(r["image"], str) else len(r["image"]) for r in records if "image" in r),
        "kinds": {k: sum(r["id"].rsplit("-", 1)[0] == k for r in records) for k in KINDS},
        "turns": _histogram([len(r["conversations"]) // 2 for r in records]),
        "vocab_size": tok.get_vocab_size(with_added_tokens=True), "text_tokens": _spread(text_tokens),
        "models": per_model, "train_command": train_command(out),
    }  # fmt: skip
