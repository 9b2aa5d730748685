"""``omnibal stats``: compute per-sample statistics (tiles, tokens, images) from annotations or convert stats files"""

from __future__ import annotations

import argparse

from omnibal.errors import NotBuiltError

HELP = "compute per-sample statistics (tiles, tokens, images) from annotations or convert stats files"
DESCRIPTION = HELP + " (not built yet: issue 2)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    raise NotBuiltError("issue 2")
