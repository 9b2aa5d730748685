"""``omnibal report``: render a markdown + PNG report from plan/simulation/training outputs"""

from __future__ import annotations

import argparse

from omnibal.errors import NotBuiltError

HELP = "render a markdown + PNG report from plan/simulation/training outputs"
DESCRIPTION = HELP + " (not built yet: issue 5)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    raise NotBuiltError("issue 5")
