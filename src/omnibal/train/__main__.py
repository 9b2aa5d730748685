"""``python -m omnibal.train ARGS``: one rank of a run, for torchrun (``torchrun --nproc-per-node N -m
omnibal.train ...``); takes the same arguments as ``omnibal train``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from omnibal.cli import run_reporting_errors
    from omnibal.cli import train as cli_train

    parser = argparse.ArgumentParser(prog="python -m omnibal.train", description=cli_train.DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cli_train.add_arguments(parser)
    args = parser.parse_args(argv)
    return run_reporting_errors(cli_train.run, args, prog="omnibal.train")


if __name__ == "__main__":
    sys.exit(main())
