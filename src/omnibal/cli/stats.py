"""``omnibal stats``: per-sample statistics (tiles, tokens, images) from annotations, or from/to stats files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omnibal.cli import _HelpFormatter
from omnibal.cli.fields import add_config_arguments, config_from_args
from omnibal.cli.options import add_option
from omnibal.errors import InputError
from omnibal.stats.io import FORMATS

HF_SET = ("min_tiles", "tile_size", "use_thumbnail", "tokens_per_tile", "image_marker_tokens", "convention")
"""Settings ``--hf-model`` sets (their flags are refused beside it); ``--max-tiles`` may narrow an InternVL
checkpoint's cap."""

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


class _Formatter(argparse.RawDescriptionHelpFormatter, _HelpFormatter):
    """The subcommands' help (defaults where they tell something), the description's layout kept."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The modes, one flag per :class:`omnibal.stats.annotations.AnnotationConfig` field (its docstring is the
    help; ``--on-error`` also applies to reading a stats file), ``--hf-model`` and ``--convention``, then the
    outputs."""
    from omnibal.stats.annotations import AnnotationConfig

    parser.formatter_class = _Formatter
    parser.add_argument("annotations", nargs="*", metavar="ANNOTATION", help="annotation files (.json or .jsonl)")
    mode = parser.add_argument_group("other modes (instead of annotation files)")
    mode.add_argument("--summary", metavar="FILE", help="summarise an existing stats file")
    mode.add_argument("--convert", metavar="IN", help="convert stats file IN to --out")
    mode.add_argument("--synthetic", type=int, metavar="N",
                      help="generate the synthetic InternVL-like mixture of N samples")
    add_option(mode, "seed", default=0, help="seed of --synthetic (default 0)")

    tiles, tokens = AnnotationConfig().tiles, AnnotationConfig().tokens
    ann = parser.add_argument_group("annotations (omnibal.stats.annotations.AnnotationConfig)", (
        f"Image settings without --hf-model (InternVL-1.5's):\n  --min-tiles {tiles.min_tiles} --max-tiles "
        f"{tiles.max_tiles} --tile-size {tiles.tile_size} --{'' if tiles.use_thumbnail else 'no-'}thumbnail "
        f"--tokens-per-tile {tokens.tokens_per_tile} --image-marker-tokens {tokens.image_marker_tokens}."))
    add_config_arguments(ann, AnnotationConfig)
    add_option(ann, "hf_model", help="count as this Llava / InternVL checkpoint takes its samples (reads its "
               "config.json and preprocessor_config.json): sets the tile size, tokens per tile, tile cap (--max-tiles "
               "may narrow it), thumbnail and image markers, and the tokenizer unless --tokenizer is given")
    ann.add_argument("--convention", metavar="LAYOUT[/N]", help="image convention the stats are made in and record: "
                     "internvl[/tokens per tile] (dynamic tiles, the default) or llava[/N] (one 336 px image = one "
                     "tile of 576 tokens: sets --max-tiles 1 --tile-size 336 --tokens-per-tile 576 --no-thumbnail); "
                     "with --convert: convert the input to it")

    out = parser.add_argument_group("output")
    add_option(out, "out", metavar="FILE", help="write the statistics here (.jsonl, .json, .parquet)")
    out.add_argument("--format", choices=FORMATS, help="format of --out (default: by extension)")
    out.add_argument("--input-format", choices=FORMATS, help="format of --summary/--convert input (default: detected)")
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
        stats, load_report = read_stats(path, format=args.input_format, on_error=_on_error(args))
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


def _on_error(args: argparse.Namespace) -> str:
    """``--on-error``, else the annotation config's default."""
    from omnibal.stats.annotations import AnnotationConfig

    return getattr(args, "on_error", AnnotationConfig.on_error)


def _from_annotations(args: argparse.Namespace):
    from omnibal.stats.annotations import AnnotationConfig, compute_stats

    if args.hf_model:
        config = _hf_config(args)
    else:
        _annotation_convention(args)
        config = config_from_args(AnnotationConfig, args, progress=not args.quiet)
    if config.image_root and not Path(config.image_root).is_dir():
        raise InputError("not a folder", source="--image-root")
    return compute_stats(args.annotations, config)  # records the convention (stats.annotations)


def _hf_config(args: argparse.Namespace):
    """``--hf-model``: the checkpoint's own image settings (``RealDataConfig.from_hf``, as ``omnibal train``);
    the data's settings (template tokens, dummy tile, EXIF, ...) and the run's from the flags."""
    from omnibal.cli.fields import cli_fields, flag_of
    from omnibal.data.realdata import RealDataConfig
    from omnibal.stats.annotations import AnnotationConfig

    flags = {f.name: flag_of(f) for f, _, _ in cli_fields(AnnotationConfig)} | {"convention": "--convention"}
    for name in HF_SET:
        value = getattr(args, name, None)  # generated flags are absent unless given
        if value is not None:
            flag = "--no-" + flags[name][2:] if value is False else flags[name]
            raise InputError("set by --hf-model (the checkpoint's own); leave it out", source=flag)
    given = config_from_args(AnnotationConfig, args, progress=not args.quiet)  # checks the values given
    data_config = RealDataConfig.from_hf(
        args.hf_model, tokenizer=given.tokenizer, image_root=given.image_root,
        max_tiles=getattr(args, "max_tiles", None), tokens_per_turn=given.tokens.tokens_per_turn,
        tokens_per_sample=given.tokens.tokens_per_sample,
        count_dummy_tile=given.count_dummy_tile, split_max_tiles=given.split_max_tiles, apply_exif=given.apply_exif,
        allow_outside_root=given.allow_outside_root)  # fmt: skip
    return data_config.annotation_config(workers=given.workers, chunk_size=given.chunk_size,
                                         on_error=given.on_error, progress=given.progress)


def _annotation_convention(args: argparse.Namespace) -> None:
    """``--convention``: ``llava`` sets the tile options to one image, one tile; tokens per tile (in ``args``)."""
    from omnibal.stats.table import ImageConvention

    if not args.convention:
        return
    conv = ImageConvention.parse(args.convention, source="--convention")
    if conv.layout == "llava":
        args.min_tiles, args.max_tiles, args.tile_size, args.use_thumbnail = 1, 1, 336, False
    args.tokens_per_tile = conv.tokens_per_tile
