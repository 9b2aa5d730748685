"""``omnibal report``: render a markdown + PNG report from plan/simulation/training outputs"""

from __future__ import annotations

import argparse
from pathlib import Path

from omnibal.cli.options import add_option

HELP = "render a markdown + PNG report from plan/simulation/training outputs"
DESCRIPTION = (
    "Render report.md and PNGs from a plan.json written by `omnibal plan` (its ablation.json beside it is "
    "picked up), optionally with an `omnibal simulate` summary JSON and a training metrics log (JSON lines "
    "with step_time_s) to compare the prediction with them."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", nargs="?", default="omnibal-out/plan.json",
                        help="plan.json, or the folder holding it")
    parser.add_argument("--ablation", default=None, metavar="FILE",
                        help="ablation.json (default: the one beside the plan, if any)")
    parser.add_argument("--simulate", default=None, metavar="FILE", help="omnibal simulate summary JSON")
    parser.add_argument("--train", default=None, metavar="FILE",
                        help="training metrics log (omnibal train --metrics-log)")
    add_option(parser, "out", default=None, metavar="DIR", help="output folder (default: the plan's folder)")


def run(args: argparse.Namespace) -> int:
    from omnibal.errors import InputError
    from omnibal.jobs.plan_report import render_report
    from omnibal.outputs import check_dir

    path = Path(args.plan)
    if path.is_dir():
        path = path / "plan.json"
    if not path.is_file():
        raise InputError("no such file", source=str(path), field="plan")
    check_dir(args.out if args.out is not None else path.parent, "--out")
    files = render_report(path, args.out, ablation_path=args.ablation, simulate_path=args.simulate,
                          train_path=args.train)
    print(f"wrote {files['report']} and {sum(1 for k in files if k.startswith('png:'))} PNGs")
    return 0
