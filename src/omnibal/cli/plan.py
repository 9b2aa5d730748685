"""``omnibal plan``: plan data caps, pipeline partition and per-stage recompute for a model on a cluster"""

from __future__ import annotations

import argparse

from omnibal.errors import NotBuiltError

HELP = "plan data caps, pipeline partition and per-stage recompute for a model on a cluster"
DESCRIPTION = HELP + " (not built yet: issue 5)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    raise NotBuiltError("issue 5")
