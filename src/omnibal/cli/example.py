"""``omnibal example``: write a small real dataset and two tiny random-init Hugging Face VLMs to train on"""

from __future__ import annotations

import argparse
import sys

from omnibal.cli.options import add_option
from omnibal.errors import InputError

HELP = "write a small real dataset (charts, text pages) and two tiny random-init HF VLMs to train on"
DESCRIPTION = (
    "Render bar/line/pie charts and text pages of many sizes and aspect ratios, write LLaVA/InternVL-style "
    "annotations whose answers come from what was drawn (1 to 3 turns; some records with two images, some "
    "with none), train a byte-level BPE tokenizer on their text, and save a tiny random-init "
    "LlavaForConditionalGeneration and InternVLForConditionalGeneration sized for it. Deterministic in "
    "--seed; a second run into the same folder replaces the first. Then train on it, e.g. `omnibal train "
    "--annotations DIR/annotations.jsonl --image-root DIR/images --tokenizer DIR/tokenizer --hf-model DIR/llava`."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_option(parser, "out", default="omnibal-example", metavar="DIR", help="output folder")
    parser.add_argument("--records", type=int, default=400, metavar="N", help="annotation records to write")
    add_option(parser, "seed", default=0, metavar="S", help="seed of the data, tokenizer and weights")


def run(args: argparse.Namespace) -> int:
    from omnibal.examples.real_example import make_real_example, prepare_output, train_command

    if args.seed < 0:
        raise InputError(f"must be >= 0, got {args.seed}", source="--seed")
    out = prepare_output(args.out, args.records, out_name="--out", records_name="--records")
    summary = make_real_example(out, num_records=args.records, seed=args.seed, progress=sys.stderr.isatty())
    kinds = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in summary["kinds"].items())
    print(f"wrote {summary['records']} records ({kinds}) with {summary['images']} images in {summary['seconds']:.1f} s")
    print(f"  {summary['annotations']}\n  {summary['image_root']}/")
    print(f"  {summary['tokenizer']}/  (byte-level BPE, {summary['vocab_size']} tokens)")
    for m in summary["models"].values():
        hist = " ".join(f"{t}:{n}" for t, n in m["tiles_per_sample"].items())
        print(f"  {m['path']}/  ({m['parameters'] / 1e6:.2f}M parameters, {m['tile_size']} px tiles, "
              f"{m['tokens_per_tile']} tokens per tile; tiles per sample {hist}; tokens per sample "
              f"{m['tokens']['min']}..{m['tokens']['max']}, mean {m['tokens']['mean']})")
    print(f"  {out / 'summary.json'}")
    print("next, train on it:")
    print(f"  {summary['train_command']}")
    print(f"  (or the InternVL model: {train_command(out, 'internvl')})")
    return 0
