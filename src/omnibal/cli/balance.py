"""``omnibal balance``: pack samples into balanced micro-batches and assign them to (step, dp_rank, micro-batch)"""

from __future__ import annotations

import argparse

from omnibal.errors import NotBuiltError

HELP = "pack samples into balanced micro-batches and assign them to (step, dp_rank, micro-batch)"
DESCRIPTION = HELP + " (not built yet: issue 3)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    raise NotBuiltError("issue 3")
