"""Every subcommand spells a knob the same way, and the old spellings still work with a warning."""

from __future__ import annotations

import argparse
from collections import defaultdict

import pytest

from omnibal.cli import COMMANDS, build_parser
from omnibal.cli import train as cli_train
from omnibal.cli.options import OPTIONS, DeprecatedAlias


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    root = build_parser()
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {name: sub.choices[name] for name in COMMANDS}
    torchrun = argparse.ArgumentParser(prog="torchrun -m omnibal train")  # what torchrun runs on every rank
    cli_train.add_arguments(torchrun)
    parsers["torchrun -m omnibal train"] = torchrun
    return parsers


def _spellings(parser: argparse.ArgumentParser) -> dict[str, tuple[frozenset, frozenset]]:
    """dest -> (flags, deprecated aliases) of every optional argument but --help."""
    flags, aliases = defaultdict(set), defaultdict(set)
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        (aliases if isinstance(action, DeprecatedAlias) else flags)[action.dest].update(action.option_strings)
    return {dest: (frozenset(flags[dest]), frozenset(aliases[dest])) for dest in flags.keys() | aliases.keys()}


PARSERS = _subparsers()


def test_a_knob_has_one_spelling_across_subcommands():
    seen: dict[str, tuple[str, tuple]] = {}
    clashes = []
    for name, parser in PARSERS.items():
        for dest, spelling in _spellings(parser).items():
            first = seen.setdefault(dest, (name, spelling))
            if first[1] != spelling:
                clashes.append(f"{dest}: {first[0]} {sorted(first[1][0])} (aliases {sorted(first[1][1])}) vs {name} "
                               f"{sorted(spelling[0])} (aliases {sorted(spelling[1])})")
    assert not clashes, "\n".join(clashes)


def test_a_flag_names_one_knob_across_subcommands():
    dests = defaultdict(set)
    for parser in PARSERS.values():
        for dest, (flags, aliases) in _spellings(parser).items():
            for flag in flags | aliases:
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
            if spelling is not None:
                assert spelling == (frozenset((opt.flag, *opt.short)), frozenset(opt.aliases)), dest


def _value_for(action: argparse.Action) -> list[str]:
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(list(action.choices)[-1])]
    return ["3" if action.type in (int, float) else "x.json"]


ALIASES = [(name, action) for name, parser in PARSERS.items() for action in parser._actions
           if isinstance(action, DeprecatedAlias)]


def test_the_renamed_knobs_have_aliases():
    names = {a.option_strings[0] for _, a in ALIASES}
    assert {"--preset", "--dp-size", "--num-microbatches", "--balance", "--method", "--synthetic-samples",
            "--pipeline-schedule", "--baseline-batch-size", "--output"} <= names


@pytest.mark.parametrize("name,alias", ALIASES, ids=[f"{n}:{a.option_strings[0]}" for n, a in ALIASES])
def test_an_old_spelling_still_works_and_warns(name, alias, capsys):
    parser = PARSERS[name]
    value = _value_for(alias)
    old = parser.parse_args([alias.option_strings[0], *value])
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{alias.option_strings[0]} is deprecated" in err and alias.new_flag in err
    new = parser.parse_args([alias.new_flag, *value])
    assert capsys.readouterr().err == ""
    assert getattr(old, alias.dest) == getattr(new, alias.dest)
    assert getattr(old, alias.dest) != parser.get_default(alias.dest)  # it did store something


def test_train_schedule_is_the_pipeline_schedule_and_a_file_is_refused(capsys):
    parser = PARSERS["torchrun -m omnibal train"]
    args = parser.parse_args(["--schedule", "gpipe"])
    assert (args.schedule, hasattr(args, "schedule_file"), capsys.readouterr().err) == ("gpipe", False, "")
    for value in ("sched.json", "interleaved"):  # a file is --schedule-file; a schedule the trainer does not run
        with pytest.raises(SystemExit):
            parser.parse_args(["--schedule", value])
