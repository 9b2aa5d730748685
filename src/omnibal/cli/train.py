"""``omnibal train``: run the reference DP x PP trainer (baseline or omnibal mode) on a plan"""

from __future__ import annotations

import argparse

from omnibal.errors import NotBuiltError

HELP = "run the reference DP x PP trainer (baseline or omnibal mode) on a plan"
DESCRIPTION = HELP + " (not built yet: issue 6)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    raise NotBuiltError("issue 6")
