"""``omnibal stats``: per-sample statistics (tiles, tokens, images) from annotations, or from/to stats files."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from omnibal.cli.options import add_option
from omnibal.errors import InputError
from omnibal.stats.io import FORMATS

MODEL_DEFAULTS = {"min_tiles": 1, "max_tiles": 12, "tile_size": 448, "tokens_per_tile": 256, "image_marker_tokens": 2}
"""Image settings without ``--hf-model`` (InternVL-1.5's); with it, the checkpoint sets them."""
HF_SET = ("min_tiles", "tile_size", "no_thumbnail", "tokens_per_tile", "image_marker_tokens", "convention")
"""Flags ``--hf-model`` sets (refused beside it); ``--max-tiles`` may narrow an InternVL checkpoint's cap."""

HELP = "compute per-sample statistics (tiles, tokens, images) from annotations or convert stats files"
DESCRIPTION = """\
Compute per-sample statistics (vision tiles, LLM tokens, images) and print their summary.

Four modes (annotations counted with explicit settings or a checkpoint's):
  omnibal stats ANNOTATION... --image-root DIR [--tokenizer PATH] --out stats.jsonl
      from LLaVA/InternVL-style annotation files (.json list or .jsonl); tiles by the InternVL
      dynamic-resolution rule from image headers (or the record's width/height), tokens with a local
      Hugging Face tokenizer, or a labelled estimate without one
  omnibal stats ANNOTATION... --image-root DIR --hf-model CKPT --out stats.jsonl
      the same with the tile size, tokens per tile, tile cap and image markers of a Llava / InternVL
      checkpoint (and its tokenizer unless --tokenizer is given): what `omnibal train --hf-model`,
      `omnibal plan --hf-model` and RealDataConfig.from_hf count
  omnibal stats --summary FILE            summarise an existing stats file
  omnibal stats --convert IN --out OUT    convert between stats formats (jsonl, json, parquet, token-lengths)
  omnibal stats --synthetic N --seed S --out FILE
                                          write the synthetic InternVL-like mixture

Stats formats are chosen by extension (.jsonl, .json, .parquet) or --format; 'token-lengths' is the
public OmniBal format (a JSON list of {vit_num, token_num, image_flags})."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("annotations", nargs="*", metavar="ANNOTATION", help="annotation files (.json or .jsonl)")
    mode = parser.add_argument_group("other modes (instead of annotation files)")
    mode.add_argument("--summary", metavar="FILE", help="summarise an existing stats file")
    mode.add_argument("--convert", metavar="IN", help="convert stats file IN to --out")
    mode.add_argument("--synthetic", type=int, metavar="N",
                      help="generate the synthetic InternVL-like mixture of N samples")
    add_option(mode, "seed", default=0, help="seed of --synthetic (default 0)")

    ann = parser.add_argument_group("annotations")
    add_option(ann, "image_root", help="folder image paths are relative to (default: each annotation file's folder)")
    add_option(ann, "tokenizer", help="local tokenizer.json or tokenizer folder (default: the --hf-model "
               "checkpoint's, else a labelled estimate)")
    add_option(ann, "hf_model", help="count as this Llava / InternVL checkpoint takes its samples (reads its "
               "config.json and preprocessor_config.json): sets the tile size, tokens per tile, tile cap, thumbnail "
               "and image markers")
    ann.add_argument("--min-tiles", type=int, help=f"smallest tile grid (default {MODEL_DEFAULTS['min_tiles']})")
    ann.add_argument("--max-tiles", type=int, help="largest tile grid, thumbnail not counted (default: the "
                     f"--hf-model checkpoint's max_patches, else {MODEL_DEFAULTS['max_tiles']})")
    ann.add_argument("--tile-size", type=int, help=f"tile side in pixels (default {MODEL_DEFAULTS['tile_size']})")
    ann.add_argument("--no-thumbnail", action="store_true", help="no thumbnail tile for multi-tile images")
    ann.add_argument("--tokens-per-tile", type=int,
                     help=f"LLM tokens per tile (default {MODEL_DEFAULTS['tokens_per_tile']})")
    ann.add_argument("--image-marker-tokens", type=int,
                     help=f"tokens around each image, <img></img> (default {MODEL_DEFAULTS['image_marker_tokens']})")
    ann.add_argument("--tokens-per-turn", type=int, default=0, help="chat-template tokens per turn (default 0)")
    ann.add_argument("--tokens-per-sample", type=int, default=0,
                     help="tokens once per sample, e.g. a system prompt (default 0)")
    ann.add_argument("--no-dummy-tile", action="store_true",
                     help="text-only samples get 0 tiles instead of InternVL's dummy tile")
    ann.add_argument("--split-max-tiles", action="store_true",
                     help="multi-image samples: max-tiles // images per image (InternVL2)")
    ann.add_argument("--ignore-exif", action="store_true", help="do not swap sides for EXIF orientations 5-8")
    ann.add_argument("--allow-outside-root", action="store_true",
                     help="accept image paths leading outside the image root (../, absolute, symlinks)")
    ann.add_argument("--convention", metavar="LAYOUT[/N]", help="image convention the stats are made in and record: "
                     "internvl[/tokens per tile] (dynamic tiles, the default) or llava[/N] (one 336 px image = one "
                     "tile of 576 tokens: sets --max-tiles 1 --tile-size 336 --tokens-per-tile 576, no thumbnail); "
                     "with --convert: convert the input to it")
    ann.add_argument("--workers", type=int, default=0, help="worker processes (default 0: one per available core)")
    ann.add_argument("--chunk-size", type=int, default=256, help="records per worker task (default 256)")

    out = parser.add_argument_group("output")
    add_option(out, "out", metavar="FILE", help="write the statistics here (.jsonl, .json, .parquet)")
    out.add_argument("--format", choices=FORMATS, help="format of --out (default: by extension)")
    out.add_argument("--input-format", choices=FORMATS, help="format of --summary/--convert input (default: detected)")
    add_option(out, "on_error", default="raise",
               help="stop at the first bad record, or skip bad records and report them (default raise)")
    out.add_argument("--report", metavar="FILE", help="write the summary (and the run report) as JSON")
    out.add_argument("--plot", metavar="PNG", help="write histograms of tiles and tokens as a PNG")
    add_option(out, "quiet", help="no progress bar and no summary table")


def run(args: argparse.Namespace) -> int:
    from omnibal.stats.io import read_stats, save_stats
    from omnibal.stats.summary import plot_histograms, summarize

    modes = [m for m, on in (("annotations", bool(args.annotations)), ("--summary", args.summary is not None),
                             ("--convert", args.convert is not None), ("--synthetic", args.synthetic is not None))
             if on]
    if len(modes) != 1:
        raise InputError(
            "give annotation files, or exactly one of --summary, --convert, --synthetic"
            + (f" (got {', '.join(modes)})" if modes else ""),
            source="arguments",
        )
    mode = modes[0]
    if args.hf_model and mode != "annotations":
        raise InputError("applies to annotation files (it sets how their images are counted)", source="--hf-model")
    if mode in ("--convert", "--synthetic") and not args.out:
        raise InputError(f"{mode} needs --out", source="--out")
    from omnibal.outputs import check_file, check_image, write_text

    check_file(args.out, "--out")  # every output path before any work: none fails after another is written
    if args.out:
        from omnibal.stats.io import output_format

        output_format(args.out, args.format)
    check_file(args.report, "--report")
    check_image(args.plot, "--plot")  # before any work: a bad path never fails after another output is written

    extra: dict = {}
    if mode == "--summary" or mode == "--convert":
        path = args.summary or args.convert
        stats, load_report = read_stats(path, format=args.input_format, on_error=args.on_error)
        if load_report.num_skipped:
            print(f"omnibal stats: warning: {load_report.summary()}", file=sys.stderr)
        extra["load"] = {"source": load_report.source, "format": load_report.format,
                         "num_records": load_report.num_records, "num_skipped": load_report.num_skipped,
                         "errors": [str(e) for e in load_report.errors]}  # fmt: skip
    elif mode == "--synthetic":
        from omnibal.stats.synthetic import synthetic_internvl_mixture

        if args.synthetic < 1:
            raise InputError(f"must be >= 1, got {args.synthetic}", source="--synthetic")
        stats = synthetic_internvl_mixture(args.synthetic, seed=args.seed)
    else:
        stats, report = _from_annotations(args)
        extra["run"] = report.to_dict()
        if report.token_count_method == "estimate":
            print(
                "omnibal stats: warning: no --tokenizer given: text tokens are an ESTIMATE "
                "(ceil(ascii chars / 4) + non-ascii chars); pass a local tokenizer for exact counts",
                file=sys.stderr,
            )
        if report.num_skipped:
            print(f"omnibal stats: warning: skipped {report.num_skipped:,} invalid record(s) (--on-error skip):",
                  file=sys.stderr)  # fmt: skip
            for err in report.errors:
                print(f"  {err}", file=sys.stderr)
            if report.num_skipped > len(report.errors):
                print(f"  ... and {report.num_skipped - len(report.errors):,} more", file=sys.stderr)
        if not args.quiet:
            print(report.summary().splitlines()[0], file=sys.stderr)

    if args.convention and mode in ("--convert", "--synthetic"):
        from omnibal.stats.table import ImageConvention, convert_convention

        stats = convert_convention(stats, ImageConvention.parse(args.convention, source="--convention"))
    if args.out:
        written = save_stats(stats, args.out, format=args.format)
        print(f"wrote {len(stats):,} rows to {written}", file=sys.stderr)
    summary = summarize(stats)
    if not args.quiet:
        print(summary.to_text())
    if args.report:
        write_text(args.report, json.dumps({"summary": summary.to_dict(), **extra}, indent=2) + "\n")
    if args.plot:
        plot_histograms(stats, args.plot)
    return 0


def _from_annotations(args: argparse.Namespace):
    from omnibal.stats.annotations import AnnotationConfig, compute_stats
    from omnibal.stats.tiles import TileConfig
    from omnibal.stats.tokens import TokenConfig

    workers = args.workers or _available_cores()
    if workers < 1:
        raise InputError(f"must be >= 0, got {args.workers}", source="--workers")
    run = dict(workers=workers, chunk_size=args.chunk_size, on_error=args.on_error, progress=not args.quiet)
    data = dict(tokens_per_turn=args.tokens_per_turn, tokens_per_sample=args.tokens_per_sample,
                count_dummy_tile=not args.no_dummy_tile, split_max_tiles=args.split_max_tiles,
                apply_exif=not args.ignore_exif, allow_outside_root=args.allow_outside_root)
    if args.image_root and not Path(args.image_root).is_dir():
        raise InputError("not a folder", source="--image-root")
    if args.hf_model:
        return compute_stats(args.annotations, _hf_config(args, data, run))
    _annotation_convention(args)
    for name, value in MODEL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    config = AnnotationConfig(
        image_root=args.image_root,
        tokenizer=args.tokenizer,
        tiles=TileConfig(min_tiles=args.min_tiles, max_tiles=args.max_tiles, tile_size=args.tile_size,
                         use_thumbnail=not args.no_thumbnail),
        tokens=TokenConfig(tokens_per_tile=args.tokens_per_tile, image_marker_tokens=args.image_marker_tokens,
                           tokens_per_turn=args.tokens_per_turn, tokens_per_sample=args.tokens_per_sample),
        **{k: v for k, v in data.items() if k not in ("tokens_per_turn", "tokens_per_sample")},
        **run,
    )  # fmt: skip
    return compute_stats(args.annotations, config)  # records the convention (stats.annotations)


def _hf_config(args: argparse.Namespace, data: dict, run: dict):
    """``--hf-model``: the checkpoint's own image settings (``RealDataConfig.from_hf``, as ``omnibal train``)."""
    from omnibal.data.realdata import RealDataConfig

    for name in HF_SET:
        if getattr(args, name) not in (None, False):
            flag = "--" + name.replace("_", "-")
            raise InputError("set by --hf-model (the checkpoint's own); leave it out", source=flag)
    data_config = RealDataConfig.from_hf(args.hf_model, tokenizer=args.tokenizer, image_root=args.image_root,
                                         max_tiles=args.max_tiles, **data)
    return data_config.annotation_config(**run)


def _annotation_convention(args: argparse.Namespace) -> None:
    """``--convention``: ``llava`` sets the tile options to one image, one tile; tokens per tile (in ``args``)."""
    from omnibal.stats.table import ImageConvention

    if not args.convention:
        return
    conv = ImageConvention.parse(args.convention, source="--convention")
    if conv.layout == "llava":
        args.min_tiles, args.max_tiles, args.tile_size, args.no_thumbnail = 1, 1, 336, True
    args.tokens_per_tile = conv.tokens_per_tile


def _available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)
