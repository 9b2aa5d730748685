"""``omnibal profile``: time forward/backward of each layer kind on this device and fit the cost model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omnibal.cli.fields import add_config_arguments, config_from_args
from omnibal.cli.options import add_option
from omnibal.errors import InputError

HELP = "time forward/backward of each layer kind on this device and fit the cost model"
DESCRIPTION = (
    "Time forward and backward of every layer kind of the reference model (the real omnibal.train modules) "
    "over a grid of micro-batch shapes, record the activation bytes saved for backward, fit per-kind "
    "coefficients over (one, tiles, tokens, tokens_sq) and write a JSON profile that "
    "omnibal.cost.cost_table_from_profile loads. Example: omnibal profile --model tiny -o profile.json"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model (``--model`` or ``--spec``), one flag per :class:`omnibal.cost.profile.ProfileConfig` field
    (its docstring is the help), then the outputs."""
    from omnibal.cost.profile import ProfileConfig

    model = parser.add_mutually_exclusive_group()
    add_option(model, "model", default=None, help="model preset (default: tiny); see omnibal.cost.presets")
    model.add_argument("--spec", type=Path, default=None, help="model spec JSON (ModelSpec.to_dict())")
    add_config_arguments(parser.add_argument_group("measurement (omnibal.cost.profile.ProfileConfig)"),
                         ProfileConfig)
    g = parser.add_argument_group("output")
    add_option(g, "out", type=Path, default=None, help="profile JSON to write (default: "
               "profile_<model>_<device>.json)")
    add_option(g, "quiet", help="no progress bar, no table")


def run(args: argparse.Namespace) -> int:
    from omnibal.cost.presets import get_model_preset
    from omnibal.cost.profile import ProfileConfig, save_profile
    from omnibal.cost.spec import ModelSpec
    from omnibal.measure.profile import measure

    config = config_from_args(ProfileConfig, args)
    if args.spec is not None:
        try:
            spec = ModelSpec.from_dict(json.loads(args.spec.read_text()), source=str(args.spec))
        except FileNotFoundError:
            raise InputError("no such file", source=str(args.spec), field="--spec") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"not JSON: {exc}", source=str(args.spec), record=f"line {exc.lineno}") from None
    else:
        spec = get_model_preset(args.model or "tiny")
    profile = measure(spec, config, progress=not args.quiet and sys.stderr.isatty())
    out = args.out or Path(f"profile_{spec.name}_{config.device.replace(':', '')}.json")
    save_profile(profile, out)
    if not args.quiet:
        print(format_fit_table(profile))
        print(f"wrote {out} ({len(profile['measurements'])} shapes in {profile['seconds']:.0f} s, "
              f"load average {profile['load_average']['before']} -> {profile['load_average']['after']})")
    return 0


def format_fit_table(profile: dict) -> str:
    """Markdown table: per kind, fitted coefficients and in-sample fit errors."""
    from omnibal.tables import markdown_table

    rows = [["kind", "pass", "one (ms)", "per tile (ms)", "per token (us)", "per token^2 (ns)", "mean err", "max err"]]
    for kind, entry in profile["fit"].items():
        for name in ("fwd_time", "bwd_time"):
            c = entry[name]["coef"]
            rows.append([kind, name[:3], f"{c[0] * 1e3:.3f}", f"{c[1] * 1e3:.3f}", f"{c[2] * 1e6:.3f}",
                         f"{c[3] * 1e9:.4f}", f"{entry[name]['mean_rel_error']:.1%}",
                         f"{entry[name]['max_rel_error']:.1%}"])
    return markdown_table(rows, right=range(2, 8))
