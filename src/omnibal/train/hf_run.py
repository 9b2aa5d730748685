"""A user's own model and data in the reference trainer: a local Hugging Face checkpoint, annotations,
images and a tokenizer in; an HF checkpoint that ``from_pretrained`` loads out.

    model = load_hf_chain("ckpt/")                          # Llava / InternVL, wrapped as a layer chain
    data = real_data_config(cfg, model)                     # tile rule and token layout of that model
    stats = real_stats(cfg, data)                           # what `omnibal stats` computes with those settings
    dataset = RealDataset(cfg.annotations_path, data, stats=stats)
    ...
    export_hf(trainer, model, "out/", tokenizer="tok/", model_dir="ckpt/")   # collective: every rank calls it

The samples follow the checkpoint's conventions, read by ``RealDataConfig.from_hf``
(:mod:`omnibal.data.hf_conventions`, which ``omnibal stats --hf-model`` and the HF Trainer integration use too):
a Llava image is one tile of the vision tower's size (no dynamic tiling, no marker tokens), an InternVL image
is cut into dynamic-resolution tiles of its size with a thumbnail and wrapped in ``<img>`` ... ``</img>``;
image slots carry the config's ``image_token_id``, which the tokenizer must have, and pixels are normalised
with the checkpoint's ``preprocessor_config.json`` mean and std when it has one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from omnibal.cost.hf_spec import load_hf_config
from omnibal.data.hf_conventions import DEFAULT_MAX_TILES, IMAGE_END_TOKEN, IMAGE_START_TOKEN, model_images
from omnibal.data.realdata import IMAGENET_MEAN, IMAGENET_STD, RealDataConfig
from omnibal.errors import InputError
from omnibal.stats.annotations import annotation_convention, compute_stats
from omnibal.stats.io import load_stats
from omnibal.stats.tiles import TileConfig
from omnibal.stats.tokens import make_counter
from omnibal.train.collectives import barrier, gather_objects
from omnibal.train.hf_adapter import from_hf
from omnibal.train.hf_processor import load_tokenizer, save_processor
from omnibal.train.hf_weights import check_weights

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json", "chat_template.jinja")
"""Files of the input checkpoint copied into every saved model, so its processor loads as before."""


def load_hf_chain(path: str | os.PathLike):
    """The checkpoint in ``path`` (fp32, local files only) wrapped by :func:`omnibal.train.hf_adapter.from_hf`."""
    # optional dependency (the hf extra), imported where it is used
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    load_hf_config(path)  # a clear error for a folder that is not an HF model
    hf_logging.disable_progress_bar()  # one bar per rank per load says nothing
    check_weights(path)  # a cut-short weight file is named, not a safetensors traceback
    try:
        model = AutoModelForImageTextToText.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"cannot load the checkpoint: {first}", source=str(path), field="hf_model") from None
    return from_hf(model)


def real_data_config(cfg, model) -> RealDataConfig:
    """How annotation records become samples for ``model`` with the run's tokenizer, image root and tile cap:
    for an HF chain what its checkpoint takes (``RealDataConfig.from_hf``, the one owner of those
    conventions), for the reference VLM its tile size and tokens per tile."""
    if getattr(model, "hf_model", None) is not None:
        return RealDataConfig.from_hf(cfg.hf_model, tokenizer=cfg.tokenizer_path, image_root=cfg.image_root,
                                      max_tiles=cfg.max_tiles)
    spec = model.spec
    counter = make_counter(cfg.tokenizer_path)
    markers = 2 if counter.token_to_id(IMAGE_START_TOKEN) is not None \
        and counter.token_to_id(IMAGE_END_TOKEN) is not None else 0
    if counter.vocab_size > spec.llm.vocab_size:
        raise InputError(f"the tokenizer has {counter.vocab_size} tokens, the model's embedding only "
                         f"{spec.llm.vocab_size} rows", source=str(cfg.tokenizer_path), field="tokenizer")
    tiles = TileConfig(max_tiles=cfg.max_tiles or DEFAULT_MAX_TILES, tile_size=spec.vision.image_size)
    return RealDataConfig(tokenizer=str(cfg.tokenizer_path), image_root=cfg.image_root, tiles=tiles,
                          tokens_per_tile=spec.llm_tokens_per_tile, image_marker_tokens=markers)


def real_stats(cfg, data: RealDataConfig, notify=None):
    """The run's statistics: ``--stats`` (made by ``omnibal stats`` with the same settings; joined by key and
    checked sample by sample) or computed now from the annotations. ``notify(line)``: told each bad record
    ``--on-error skip`` left out (one line each, the first ones, then how many more)."""
    if cfg.stats_path is not None:
        stats = load_stats(cfg.stats_path)
        made, wanted = stats.convention, annotation_convention(data.annotation_config())
        if made is not None and made != wanted:
            raise InputError(f"made for {made.describe()}, the model takes {wanted.describe()}: make them with "
                             "this model's settings (omnibal stats --hf-model DIR for a checkpoint)",
                             source=str(cfg.stats_path), field="convention")
    else:
        stats, report = compute_stats(cfg.annotations_path, data.annotation_config(on_error=cfg.on_error))
        if report.num_skipped and notify is not None:
            for error in report.errors:
                notify(f"skipped record (--on-error skip): {error}")
            if report.num_skipped > len(report.errors):
                notify(f"skipped {report.num_skipped - len(report.errors):,} more records of "
                       f"{cfg.annotations_path} (--on-error skip)")
    return stats


def _stage_state(trainer, chain) -> dict[str, torch.Tensor] | None:
    """This stage's trained tensors under their HF names (dp rank 0 of each stage; None elsewhere)."""
    if trainer.world.dp_rank != 0:
        return None
    names = {id(p): n for n, p in chain.hf_model.named_parameters(remove_duplicate=False)}
    return {names[id(p)]: p.detach().to("cpu", copy=True) for p in trainer.stage_module.parameters()}


def export_hf(trainer, chain, out_dir: str | os.PathLike, *, tokenizer: str, model_dir: str,
              max_tiles: int = 12) -> Path | None:
    """Write the model as trained so far as an HF checkpoint folder (weights, config, tokenizer, and the input
    checkpoint's processor files, or where it has none a processor made to prepare inputs as the trainer did:
    :mod:`omnibal.train.hf_processor`, with ``max_tiles`` per image). Collective: every rank calls it; each
    stage's dp rank 0 contributes its tensors and global rank 0 writes the folder, atomically replacing what
    ``out_dir`` held."""
    parts = gather_objects(trainer.world, _stage_state(trainer, chain), "saving the HF model")
    written = None
    if trainer.world.rank == 0:
        hf = chain.hf_model
        with torch.no_grad():
            for part in parts:
                for name, tensor in (part or {}).items():
                    hf.get_parameter(name).copy_(tensor)
        written = _write_folder(hf, Path(out_dir), tokenizer=tokenizer, model_dir=model_dir, max_tiles=max_tiles)
    barrier(trainer.world, "saving the HF model")
    return written


def _write_folder(hf, out: Path, *, tokenizer: str, model_dir: str, max_tiles: int) -> Path:
    if out.exists() and not out.is_dir():
        raise InputError("exists and is not a folder", source=str(out), field="save_dir")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        hf.save_pretrained(str(tmp))
        load_tokenizer(tokenizer).save_pretrained(str(tmp))
        copied = [name for name in PROCESSOR_FILES if (Path(model_dir) / name).is_file()]
        for name in copied:
            shutil.copy2(Path(model_dir) / name, tmp / name)
        if "processor_config.json" not in copied:  # AutoProcessor needs it: one that prepares inputs as we did
            norm = {"image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD,
                    **dict(model_images(model_dir).normalisation)}
            save_processor(tmp, hf.config, tokenizer, max_tiles=max_tiles, **norm)
        out.mkdir(parents=True, exist_ok=True)
        new = {item.name for item in tmp.iterdir()}
        for item in sorted(tmp.iterdir()):
            os.replace(item, out / item.name)  # per file atomic: a reader sees the old or the new file
        for stale in out.glob("model*.safetensors*"):  # shards of an earlier save that this one does not have
            if stale.name not in new:
                stale.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
