"""``omnibal profile``: time forward/backward of each layer kind on this device and fit the cost model"""

from __future__ import annotations

import argparse

from omnibal.errors import NotBuiltError

HELP = "time forward/backward of each layer kind on this device and fit the cost model"
DESCRIPTION = HELP + " (not built yet: issue 4)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    raise NotBuiltError("issue 4")
