"""``omnibal`` command line: one module per subcommand under ``omnibal.cli``.

Each subcommand module defines ``HELP`` (one line), ``DESCRIPTION``, ``add_arguments(parser)`` and
``run(args) -> int``. Modules import heavy dependencies (torch, matplotlib) inside ``run`` so that
``omnibal --help`` stays fast.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import sys

from omnibal import __version__
from omnibal.errors import InputError, OmnibalError

# Order is the data flow: (example ->) stats -> balance -> profile -> plan -> simulate -> train -> report.
COMMANDS = ("example", "stats", "balance", "profile", "plan", "simulate", "train", "report")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` only where it tells something: not to flags, not to options whose default is
    resolved later (None), not where the help already names the default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or isinstance(action.default, bool) or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnibal",
        description="Balance data, pipeline partition and memory for distributed VLM training (OmniBal).",
    )
    parser.add_argument("--version", action="version", version=f"omnibal {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        mod = importlib.import_module(f"omnibal.cli.{name}")
        p = sub.add_parser(
            name,
            help=mod.HELP,
            description=getattr(mod, "DESCRIPTION", mod.HELP),
            formatter_class=_HelpFormatter,
            allow_abbrev=False,  # one spelling per knob: no prefix of it, nor of a removed spelling, works
        )
        mod.add_arguments(p)
        plain_choices(p)
        p.set_defaults(_run=mod.run)
    return parser


def plain_choices(parser: argparse.ArgumentParser) -> None:
    """Every ``choices`` of ``parser`` as plain strings: argparse's "invalid choice" error lists the choices
    by ``repr``, which for a ``StrEnum`` member is ``<Engine.REFERENCE: 'reference'>``, not the word to type."""
    for action in parser._actions:
        if action.choices is not None and not isinstance(action.choices, dict):
            action.choices = [c.value if isinstance(c, enum.Enum) else c for c in action.choices]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_reporting_errors(args._run, args, prog=f"omnibal {args.command}")


def run_reporting_errors(run, args: argparse.Namespace, *, prog: str) -> int:
    """Run a command, turning omnibal's errors into one line on stderr and an exit code
    (2 bad input, 1 other omnibal error, 130 interrupted)."""
    try:
        return int(run(args) or 0)
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OmnibalError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.filename is None:  # not about a path: a real failure, with its traceback
            raise
        # a path the command was given (or one under it) cannot be read or written: one line, not a traceback
        print(f"{prog}: error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
