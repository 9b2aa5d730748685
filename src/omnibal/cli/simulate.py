"""``omnibal simulate``: simulate DP x PP training steps of a plan and report time, bubbles and memory"""

from __future__ import annotations

import argparse

from omnibal.errors import NotBuiltError

HELP = "simulate DP x PP training steps of a plan and report time, bubbles and memory"
DESCRIPTION = HELP + " (not built yet: issue 4)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    raise NotBuiltError("issue 4")
