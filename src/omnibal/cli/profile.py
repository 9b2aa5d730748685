"""``omnibal profile``: time forward/backward of each layer kind on this device and fit the cost model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omnibal.cli.options import add_option
from omnibal.cost.profile import STATISTICS
from omnibal.errors import InputError

HELP = "time forward/backward of each layer kind on this device and fit the cost model"
DESCRIPTION = (
    "Time forward and backward of every layer kind of the reference model (the real omnibal.train modules) "
    "over a grid of micro-batch shapes, record the activation bytes saved for backward, fit per-kind "
    "coefficients over (one, tiles, tokens, tokens_sq) and write a JSON profile that "
    "omnibal.cost.cost_table_from_profile loads. Example: omnibal profile --model tiny -o profile.json"
)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group()
    add_option(model, "model", default=None, help="model preset (default: tiny); see omnibal.cost.presets")
    model.add_argument("--spec", type=Path, default=None, help="model spec JSON (ModelSpec.to_dict())")
    add_option(parser, "out", type=Path, default=None, help="profile JSON to write (default: "
               "profile_<model>_<device>.json)")
    add_option(parser, "device", default="cpu", choices=None, help="cpu or cuda[:N]")
    add_option(parser, "dtype", default=None, help="training dtype (default: fp32 on cpu, bf16 on cuda)")
    add_option(parser, "threads", default=1, help="torch CPU threads while measuring")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per shape")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per shape")
    parser.add_argument("--statistic", default="median", choices=STATISTICS,
                        help="what to fit: median wall time; min: the least disturbed run; cpu: median process "
                             "CPU time (CPU only; robust when other jobs share the cores); cpu_min: its minimum")
    parser.add_argument("--tiles", type=_int_list, default=None, help="tiles grid, e.g. 1,2,4,8")
    parser.add_argument("--tokens", type=_int_list, default=None, help="LLM tokens grid, e.g. 256,1024")
    parser.add_argument("--segments", type=_int_list, default=None, help="attention segment lengths grid")
    parser.add_argument("--kinds", default=None, help="comma-separated layer kinds (default: all six)")
    add_option(parser, "seed", default=0, help="weight init seed")
    add_option(parser, "quiet", help="no progress bar, no table")


def run(args: argparse.Namespace) -> int:
    from omnibal.cost.presets import get_model_preset
    from omnibal.cost.profile import CPU_GRID, GPU_GRID, ProfileGrid, save_profile
    from omnibal.cost.spec import LAYER_KINDS, ModelSpec
    from omnibal.measure.profile import measure

    if args.spec is not None:
        try:
            spec = ModelSpec.from_dict(json.loads(args.spec.read_text()), source=str(args.spec))
        except FileNotFoundError:
            raise InputError("no such file", source=str(args.spec), field="--spec") from None
        except json.JSONDecodeError as exc:
            raise InputError(f"not JSON: {exc}", source=str(args.spec), record=f"line {exc.lineno}") from None
    else:
        spec = get_model_preset(args.model or "tiny")
    base = GPU_GRID if args.device.startswith("cuda") else CPU_GRID
    grid = ProfileGrid(tiles=args.tiles or base.tiles, tokens=args.tokens or base.tokens,
                       segments=args.segments or base.segments)
    kinds = tuple(k.strip() for k in args.kinds.split(",")) if args.kinds else LAYER_KINDS
    progress = not args.quiet and sys.stderr.isatty()
    profile = measure(spec, device=args.device, dtype=args.dtype, threads=args.threads, grid=grid, kinds=kinds,
                      warmup=args.warmup, repeats=args.repeats, progress=progress, seed=args.seed,
                      statistic=args.statistic)
    out = args.out or Path(f"profile_{spec.name}_{args.device.replace(':', '')}.json")
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
