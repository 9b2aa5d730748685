"""Argparse arguments generated from config dataclasses (omnibal.cli.fields)."""

from __future__ import annotations

import argparse
import dataclasses
import enum

import pytest

from omnibal.cli.fields import add_config_arguments, config_from_args, field_docs


class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    width: int = 1
    """Width."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Toy:
    inner: Inner = dataclasses.field(default_factory=Inner)
    """Nested: its fields appear flat."""
    max_tiles: int | None = None
    """Tile cap per image (100% of them)."""
    colour: Colour = Colour.RED
    """Which colour."""
    chunks: tuple[int, ...] = (1,)
    """Chunks per stage."""
    prefetch: bool = False
    """Load ahead."""
    num_steps: int = dataclasses.field(default=10, metadata={"flag": "--steps", "short": "-n"})
    """Optimizer steps."""
    hidden: str = dataclasses.field(default="x", metadata={"cli": False})
    """Not a flag."""


def _parser():
    p = argparse.ArgumentParser()
    return p, add_config_arguments(p, Toy)


def test_flags_help_and_types_come_from_the_fields():
    p, flags = _parser()
    assert flags == {"width": "--width", "max_tiles": "--max-tiles", "colour": "--colour",
                     "chunks": "--chunks", "prefetch": "--prefetch", "num_steps": "--steps"}
    text = p.format_help()
    assert "Tile cap per image (100% of them)." in text and "{red,blue}" in text and "-n" in text
    args = p.parse_args(["--max-tiles", "6", "--colour", "blue", "--chunks", "2,3", "--prefetch", "-n", "4",
                         "--width", "2"])
    assert (args.max_tiles, args.colour, args.chunks, args.prefetch, args.num_steps, args.width) == (
        6, "blue", (2, 3), True, 4, 2)
    with pytest.raises(SystemExit):
        p.parse_args(["--colour", "green"])


def test_unset_flags_keep_the_dataclass_defaults():
    p, _ = _parser()
    args = p.parse_args(["--no-prefetch"])
    assert vars(args) == {"prefetch": False}
    assert config_from_args(Toy, p.parse_args([])) == Toy()


def test_field_docs_reads_the_docstring_under_each_field():
    assert field_docs(Toy)["colour"] == "Which colour."
    assert field_docs(Toy)["hidden"] == "Not a flag."


def test_every_train_config_field_has_one_flag_and_every_flag_one_field():
    from omnibal.cli.fields import cli_fields, option_key
    from omnibal.cli.options import DeprecatedAlias
    from omnibal.cli.train import add_arguments
    from omnibal.train.config import TrainConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    dests = [a.dest for a in parser._actions if a.option_strings and not isinstance(a, (DeprecatedAlias,
                                                                                         argparse._HelpAction))]
    fields = [option_key(f) or f.name for f, _, _ in cli_fields(TrainConfig) if f.name not in ("tp_size",
                                                                                                 "zero_stage")]
    assert sorted(dests) == sorted([*fields, "nproc"])  # --nproc: the launcher's, not the run's
    assert len(set(dests)) == len(dests)


def test_train_flags_build_the_config_the_fields_describe():
    from omnibal.cli.train import add_arguments, train_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = train_config(parser.parse_args(["--steps", "3", "--stage-layers", "0:4", "--recompute", "a,b",
                                          "--schedule", "gpipe", "--batch-size", "2", "--log", "m.jsonl",
                                          "--convert-stats", "--dp", "2", "--threads", "2"]))
    assert (cfg.num_steps, cfg.stage_layers, cfg.recompute, cfg.pipeline_schedule, cfg.baseline_batch_size,
            cfg.log_path, cfg.convert_stats, cfg.layout.dp_size, cfg.torch_threads) == (
        3, ((0, 4),), (("a", "b"),), "gpipe", 2, "m.jsonl", True, 2, 2)
    assert train_config(parser.parse_args([])) == train_config(parser.parse_args([])).__class__()


def test_no_choice_list_is_defined_twice():
    """A StrEnum of omnibal.layout is the only spelling of its vocabulary: no string tuple/list/set literal
    with the same values elsewhere in src, and no Literal[...] of config fields."""
    import ast
    import pathlib

    import omnibal.layout as layout

    enums = {frozenset(m.value for m in o): name for name, o in vars(layout).items()
             if isinstance(o, type) and issubclass(o, enum.StrEnum) and o is not enum.StrEnum}
    root = pathlib.Path(layout.__file__).parent
    copies = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "layout.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                values = frozenset(e.value for e in node.elts)
                if values in enums:
                    copies.append(f"{path.relative_to(root)}:{node.lineno} repeats {enums[values]}")
    assert copies == []
    assert "Literal" not in (root / "train" / "config.py").read_text()
