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
    dp_size: int = 1
    """Data-parallel size."""


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
    assert flags == {"dp_size": "--dp-size", "max_tiles": "--max-tiles", "colour": "--colour",
                     "chunks": "--chunks", "prefetch": "--prefetch", "num_steps": "--steps"}
    text = p.format_help()
    assert "Tile cap per image (100% of them)." in text and "{red,blue}" in text and "-n" in text
    args = p.parse_args(["--max-tiles", "6", "--colour", "blue", "--chunks", "2,3", "--prefetch", "-n", "4",
                         "--dp-size", "2"])
    assert (args.max_tiles, args.colour, args.chunks, args.prefetch, args.num_steps, args.dp_size) == (
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
