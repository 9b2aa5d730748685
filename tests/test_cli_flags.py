"""Every subcommand spells a knob the same way, and the removed spellings are gone."""

from __future__ import annotations

import argparse
from collections import defaultdict

import pytest

from omnibal.cli import COMMANDS, build_parser
from omnibal.cli import train as cli_train
from omnibal.cli.options import OPTIONS


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {name: sub.choices[name] for name in COMMANDS}
    torchrun = argparse.ArgumentParser(prog="torchrun -m omnibal train")  # what torchrun runs on every rank
    cli_train.add_arguments(torchrun)
    parsers["torchrun -m omnibal train"] = torchrun
    return parsers


def _spellings(parser: argparse.ArgumentParser) -> dict[str, frozenset]:
    """dest -> flags of every optional argument but --help."""
    flags = defaultdict(set)
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            flags[action.dest].update(action.option_strings)
    return {dest: frozenset(f) for dest, f in flags.items()}


PARSERS = _subparsers()


def test_a_knob_has_one_spelling_across_subcommands():
    seen: dict[str, tuple[str, tuple]] = {}
    clashes = []
    for name, parser in PARSERS.items():
        for dest, spelling in _spellings(parser).items():
            first = seen.setdefault(dest, (name, spelling))
            if first[1] != spelling:
                clashes.append(f"{dest}: {first[0]} {sorted(first[1])} vs {name} {sorted(spelling)}")
    assert not clashes, "\n".join(clashes)


def test_a_flag_names_one_knob_across_subcommands():
    dests = defaultdict(set)
    for parser in PARSERS.values():
        for dest, flags in _spellings(parser).items():
            for flag in flags:
                dests[flag].add(dest)
    assert {flag: d for flag, d in dests.items() if len(d) > 1} == {}


def test_every_shared_option_is_declared_once_and_used():
    used = set()
    for parser in PARSERS.values():
        used |= set(_spellings(parser))
    assert set(OPTIONS) <= used  # a declared option no subcommand takes is dead
    for dest, opt in OPTIONS.items():  # no subcommand spells a shared knob on its own
        for parser in PARSERS.values():
            spelling = _spellings(parser).get(dest)
            if spelling is not None:  # a bool field's --no- form is the flag's own
                assert spelling - {"--no-" + opt.flag[2:]} == frozenset((opt.flag, *opt.short)), dest


REMOVED = ("--preset", "--dp-size", "--num-microbatches", "--balance", "--method", "--synthetic-samples",
           "--pipeline-schedule", "--baseline-batch-size", "--output")
"""Spellings deprecated for one release and then removed (CHANGELOG.md)."""


@pytest.mark.parametrize("name", list(COMMANDS))
def test_the_removed_spellings_are_refused(name, capsys):
    parser = PARSERS[name]
    taken = {flag for flags in _spellings(parser).values() for flag in flags}
    assert taken.isdisjoint(REMOVED)
    for flag in ("--dp-size", "--balance"):  # --balance: a prefix of --balance-method, no abbreviation either
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "2"])
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_train_pp_schedule_is_the_pipeline_schedule_and_a_file_is_refused(capsys):
    parser = PARSERS["torchrun -m omnibal train"]
    args = parser.parse_args(["--pp-schedule", "gpipe"])
    assert (args.pp_schedule, hasattr(args, "schedule_file"), capsys.readouterr().err) == ("gpipe", False, "")
    for value in ("sched.json", "interleaved"):  # a file is --schedule-file; a schedule the trainer does not run
        with pytest.raises(SystemExit):
            parser.parse_args(["--pp-schedule", value])


@pytest.mark.parametrize("name", list(COMMANDS))
def test_schedule_alone_is_no_pipeline_schedule_flag(name, capsys):
    """``--schedule`` was the pipeline schedule's flag; "schedule" alone now means the balancer's output."""
    parser = PARSERS[name]
    with pytest.raises(SystemExit):
        parser.parse_args(["--schedule", "1f1b"])
    assert "unrecognized arguments: --schedule" in capsys.readouterr().err
