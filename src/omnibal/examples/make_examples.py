"""Make the example set: images of chosen sizes, an annotation JSONL, and a tiny BPE tokenizer.

Deterministic: running it again writes the same annotations and tokenizer (image bytes may differ across
Pillow versions; their sizes do not). Images are flat colour with a few shapes, so even a 3000x3000 PNG is
a few kilobytes. Usage: ``python -m omnibal.examples.make_examples [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

from omnibal.outputs import write_text

# name -> (stored width, stored height, format, EXIF orientation or None). The expected tiles (InternVL
# rule, max 12 + thumbnail) are worked out by hand in tests/test_stats_examples.py.
IMAGES = {
    "square_448.png": (448, 448, "PNG", None),
    "wide_1920x1080.png": (1920, 1080, "PNG", None),
    "tall_300x900.png": (300, 900, "PNG", None),
    "tiny_16x16.png": (16, 16, "PNG", None),
    "tiny_40x30.png": (40, 30, "PNG", None),
    "chart_800x600.png": (800, 600, "PNG", None),
    "large_3000x3000.png": (3000, 3000, "PNG", None),
    "photo_1000x750.jpg": (1000, 750, "JPEG", None),
    "rotated_640x200_exif6.jpg": (640, 200, "JPEG", 6),
    "strip_4000x300.png": (4000, 300, "PNG", None),
}

WORDS = (
    "the a this that chart diagram photo document page table figure image picture plot graph bar line "
    "axis value label title legend color red blue green yellow black white large small tall wide left "
    "right top bottom middle corner shows shown contains includes has have is are was were be been of "
    "in on at by for with from to and or but not what which how many much where when why who question "
    "answer describe explain count read text number year percent price total average highest lowest "
    "increase decrease between during after before each every first second third last people person "
    "man woman child dog cat car tree house road sky water mountain city street building room window "
    "door table chair book paper pen cup food plate market store train bus bicycle boat animal bird "
    "flower grass river lake beach sun cloud rain snow night day morning evening summer winter data "
    "sales revenue growth rate share market population region country company product month week "
    "science experiment cell plant energy food chain layer process cycle stage arrow points part whole"
).split()

CONVERSATIONS = [
    ("square_448.png", "What is shown in the image?", "A small square picture with a red circle on a flat background."),
    ("wide_1920x1080.png", "Describe the scene in detail.",
     "A wide landscape frame: a blue band of sky above a green field, with a yellow sun near the top right corner."),
    ("tall_300x900.png", "Read the text on the banner.",
     "The tall banner has three coloured blocks stacked from top to bottom."),
    ("tiny_16x16.png", "What colour is this icon?", "The icon is a single flat green square."),
    ("tiny_40x30.png", "What does this thumbnail show?",
     "A tiny orange rectangle; it is too small to show any detail."),
    ("chart_800x600.png", "Which bar is the highest in the chart?",
     "The third bar, labelled 2023, is the highest at about 75 percent."),
    ("large_3000x3000.png", "Is there anything in the centre of this large image?",
     "Yes, a dark square sits in the middle of a pale grey field."),
    ("photo_1000x750.jpg", "How many shapes are in the photo?",
     "There are two shapes: a rectangle on the left and a circle on the right."),
    ("rotated_640x200_exif6.jpg", "Which way is the image oriented?",
     "It is a portrait strip; the camera stored it sideways and marked the rotation in its metadata."),
    ("strip_4000x300.png", "What is this long strip?",
     "A very wide panorama strip with alternating light and dark segments."),
]


def draw_images(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for name, (w, h, fmt, orientation) in IMAGES.items():
        bg = tuple(rng.randrange(120, 240) for _ in range(3))
        img = Image.new("RGB", (w, h), bg)
        draw = ImageDraw.Draw(img)
        fg = tuple(rng.randrange(0, 120) for _ in range(3))
        draw.rectangle([w // 4, h // 4, w // 2, h // 2], fill=fg)
        draw.ellipse([w // 2, h // 2, w * 3 // 4, h * 3 // 4], fill=tuple(255 - c for c in fg))
        kwargs = {"optimize": True}
        if fmt == "JPEG":
            kwargs["quality"] = 60
        if orientation is not None:
            exif = Image.Exif()
            exif[0x0112] = orientation
            kwargs["exif"] = exif.tobytes()
        img.save(out / name, fmt, **kwargs)


def annotations() -> list[dict]:
    recs = []
    for i, (img, q, a) in enumerate(CONVERSATIONS):
        recs.append({"id": f"single-{i}", "image": f"images/{img}",
                     "conversations": [{"from": "human", "value": f"<image>\n{q}"}, {"from": "gpt", "value": a}]})
    recs.append({"id": "multi-0", "image": ["images/square_448.png", "images/wide_1920x1080.png"],
                 "conversations": [{"from": "human", "value": "Image 1: <image>\nImage 2: <image>\nWhat differs?"},
                                   {"from": "gpt", "value": "The first is a small square, the second a wide scene."}]})
    recs.append({"id": "multi-1",
                 "image": ["images/tall_300x900.png", "images/tiny_16x16.png", "images/chart_800x600.png"],
                 "conversations": [{"from": "human", "value": "<image><image><image>\nWhich image is a chart?"},
                                   {"from": "gpt", "value": "The third one."},
                                   {"from": "human", "value": "And which is the smallest?"},
                                   {"from": "gpt", "value": "The second, a 16 pixel icon."}]})
    recs.append({"id": "text-0", "conversations": [
        {"from": "human", "value": "Explain what a pipeline bubble is in distributed training."},
        {"from": "gpt", "value": "When a model is split into stages across devices, the first micro-batch must pass "
                                 "through every stage before the last stage has work; the idle time at the start and "
                                 "end of each step is the bubble. More micro-batches per step make it a smaller "
                                 "share."}]})
    recs.append({"id": "text-1", "conversations": [
        {"from": "human", "value": "Give me three words that rhyme with light."},
        {"from": "gpt", "value": "Night, bright and kite."}]})
    # the size is given, so the (absent) file is never opened: how large datasets skip header reads
    recs.append({"id": "given-size-0", "image": "images/not_on_disk.jpg", "width": 800, "height": 600,
                 "conversations": [{"from": "human", "value": "<image>\nWhat is in this picture?"},
                                   {"from": "gpt", "value": "A chart with four bars."}]})  # fmt: skip
    return recs


def english_corpus(num_sentences: int = 3000, seed: int = 0) -> list[str]:
    """Generated English-like sentences from a small word list: enough for a 2k BPE vocabulary."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(5, 18))]
        s = " ".join(words)
        out.append(s[0].upper() + s[1:] + rng.choice([".", "?", ".", "!"]))
    return out


def train_tokenizer(texts: list[str], path: Path, vocab_size: int = 2048) -> None:
    # optional dependency (the hf extra), imported where it is used
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<img>", "</img>", "<IMG_CONTEXT>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer)
    write_text(path, tok.to_str(pretty=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args(argv)
    draw_images(args.out / "images")
    recs = annotations()
    write_text(args.out / "annotations.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    texts = [t["value"] for r in recs for t in r["conversations"]] + english_corpus()
    train_tokenizer(texts, args.out / "tokenizer.json")
    print(f"wrote {len(IMAGES)} images, {len(recs)} annotations and tokenizer.json to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
