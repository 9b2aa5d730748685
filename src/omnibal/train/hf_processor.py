"""The processor of a saved Hugging Face checkpoint: what ``AutoProcessor.from_pretrained`` needs beside the
weights (an image processor, the tokenizer with the model's image tokens named, the processor's own config).

A checkpoint that came with processor files keeps them (``hf_run`` copies them). One without, such as the tiny
models ``omnibal example`` makes, gets a processor that prepares images and text as the trainer did:

- Llava: a ``CLIPImageProcessor`` resizing each image to one tile of the tower's size (no crop), and a
  ``LlavaProcessor`` expanding ``<image>`` to the tower's patch count (CLIP's class token dropped by the
  ``default`` feature strategy, as the model does);
- InternVL: a ``GotOcr2ImageProcessor`` cutting dynamic-resolution tiles up to ``--max-tiles`` plus a
  thumbnail (the same grid rule as the trainer), and ``InternVLProcessor``'s config (``image_seq_length``
  tokens per tile between ``<img>`` and ``</img>``); the tokenizer names its start, end, context and video
  tokens. transformers 5 builds an InternVL processor only with torchvision installed (its video processor
  needs it); the files are written without it. A tokenizer without a ``<video>`` token gets its pad token as
  the video token, which no prompt holds: such a model takes images, not videos.

Both normalise with the checkpoint's mean and std (ImageNet's by default, as the trainer).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from omnibal.errors import InputError
from omnibal.outputs import write_text

BICUBIC = 3
"""PIL's resampling code for bicubic: the trainer resizes tiles with it."""


def load_tokenizer(path: str | Path, **kwargs):
    """The tokenizer of ``path`` (a folder with ``tokenizer_config.json``, or a ``tokenizer.json`` file or a
    folder holding one) as a transformers tokenizer; ``kwargs`` go to its constructor."""
    # optional dependency (the hf extra), imported where it is used
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path)
    try:
        if p.is_dir() and (p / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(p), local_files_only=True, **kwargs)
        return PreTrainedTokenizerFast(tokenizer_file=str(p / "tokenizer.json" if p.is_dir() else p), **kwargs)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot save the tokenizer with the model: {exc}", source=str(p), field="tokenizer") from None


@contextlib.contextmanager
def _quiet_transformers():
    """transformers warns that an image processor falls back to PIL without torchvision: true, and no news."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def save_processor(folder: str | Path, config, tokenizer: str | Path, *, max_tiles: int,
                   image_mean: tuple[float, ...], image_std: tuple[float, ...]) -> None:
    """Write the processor of a Llava or InternVL ``config`` (the model's ``PretrainedConfig``) and the
    tokenizer into ``folder`` (see the module docstring); other model types are left as they are."""
    if config.model_type == "llava":
        _save_llava(Path(folder), config, tokenizer, image_mean=image_mean, image_std=image_std)
    elif config.model_type == "internvl":
        _save_internvl(Path(folder), config, tokenizer, max_tiles=max_tiles, image_mean=image_mean,
                       image_std=image_std)


def _token(tok, token_id: int, source: str) -> str:
    token = tok.convert_ids_to_tokens(int(token_id))
    if token is None:
        raise InputError(f"the tokenizer has no token at the model's image_token_id {token_id}", source=source,
                         field="tokenizer")
    return token


def _save_llava(folder: Path, config, tokenizer, *, image_mean, image_std) -> None:
    import transformers as tf

    tok = load_tokenizer(tokenizer)
    vision = config.vision_config
    side = {"height": vision.image_size, "width": vision.image_size}
    with _quiet_transformers():
        images = tf.CLIPImageProcessor(size=side, crop_size=side, do_center_crop=False, resample=BICUBIC,
                                       image_mean=list(image_mean), image_std=list(image_std))
    # CLIP puts a class token before the patches; the "default" feature strategy drops it again
    extra = 1 if vision.model_type == "clip_vision_model" else 0
    processor = tf.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=vision.patch_size,
                                  vision_feature_select_strategy=config.vision_feature_select_strategy,
                                  image_token=_token(tok, config.image_token_id, str(tokenizer)),
                                  num_additional_image_tokens=extra)
    processor.save_pretrained(str(folder))


def _save_internvl(folder: Path, config, tokenizer, *, max_tiles: int, image_mean, image_std) -> None:
    import transformers as tf

    plain = load_tokenizer(tokenizer)
    vocab = plain.get_vocab()
    names = {"start_image_token": "<img>", "end_image_token": "</img>",
             "context_image_token": _token(plain, config.image_token_id, str(tokenizer)),
             "video_token": "<video>" if "<video>" in vocab else plain.pad_token}
    missing = [t for t in names.values() if t is None or t not in vocab]
    if missing:
        raise InputError(f"the tokenizer lacks {', '.join(map(str, missing))}, which InternVL's processor needs",
                         source=str(tokenizer), field="tokenizer")
    load_tokenizer(tokenizer, extra_special_tokens=names).save_pretrained(str(folder))
    height, width = config.vision_config.image_size
    with _quiet_transformers():
        images = tf.GotOcr2ImageProcessor(size={"height": height, "width": width}, crop_to_patches=True,
                                          min_patches=1, max_patches=max_tiles, resample=BICUBIC,
                                          image_mean=list(image_mean), image_std=list(image_std))
    videos = {"video_processor_type": "InternVLVideoProcessor", "size": {"height": height, "width": width},
              "resample": BICUBIC, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
              "do_normalize": True, "image_mean": list(image_mean), "image_std": list(image_std),
              "do_convert_rgb": True, "initial_shift": True, "do_sample_frames": False}
    doc = {"processor_class": "InternVLProcessor", "image_seq_length": int(config.image_seq_length),
           "image_processor": images.to_dict(), "video_processor": videos}
    write_text(folder / "processor_config.json", json.dumps(doc, indent=2) + "\n")
    _note_processor(folder / "tokenizer_config.json", "InternVLProcessor")


def _note_processor(path: Path, name: str) -> None:
    """The ``processor_class`` a processor's ``save_pretrained`` writes into the tokenizer's config."""
    doc = json.loads(path.read_text())
    doc["processor_class"] = name
    write_text(path, json.dumps(doc, indent=2) + "\n")
