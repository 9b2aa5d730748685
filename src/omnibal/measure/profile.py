"""Measure a layer profile: run each layer kind of the reference trainer's model (the real modules, through
:class:`omnibal.measure.runner.LayerRunner`) over the grid of :mod:`omnibal.cost.profile`, time forward and
backward, record the bytes autograd saves, and fit the result into the profile format that module reads.

What to measure and how is a :class:`omnibal.cost.profile.ProfileConfig`. Timing: CUDA events on a GPU; on a
CPU the wall clock with a fixed torch thread count. Each shape is run ``warmup`` times untimed and ``repeats``
times timed; ``statistic`` picks which figure becomes ``fwd_s``/``bwd_s`` (see
:data:`omnibal.cost.profile.STATISTICS`); all are recorded, with the load average before and after.
"""

from __future__ import annotations

import datetime as _dt
import os
import sys
from typing import Any

import torch
from tqdm import tqdm

from omnibal.cost.analytic import DTYPE_BYTES
from omnibal.cost.profile import FORMAT, STATISTICS, Point, ProfileConfig, fit_profile, grid_points
from omnibal.cost.spec import LAYER_KINDS, ModelSpec
from omnibal.errors import InputError
from omnibal.measure.machine import cpu_name, load_average
from omnibal.measure.runner import LayerRunner
from omnibal.validate import check_positive_int

__all__ = ["ProfileConfig", "measure", "measure_points"]


def device_info(device: str, threads: int) -> dict[str, Any]:
    """The device a measurement ran on: a CUDA device's name and memory, or the CPU, its threads and cores."""
    if device.startswith("cuda"):
        idx = torch.device(device).index or 0
        return {"type": "cuda", "name": torch.cuda.get_device_name(idx),
                "memory_bytes": torch.cuda.get_device_properties(idx).total_memory}
    return {"type": "cpu", "name": cpu_name(), "threads": threads, "cpu_count": os.cpu_count()}


def _check_measure_args(device: str, dtype: str | None, kinds, repeats: int, threads: int) -> str:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("CUDA is not available on this machine", source="device", field="device")
    if not (device == "cpu" or device.startswith("cuda")):
        raise InputError(f"unknown device {device!r}; use cpu or cuda[:N]", source="device", field="device")
    dtype = dtype or ("bf16" if device.startswith("cuda") else "fp32")
    if dtype not in DTYPE_BYTES:
        raise InputError(f"unknown dtype {dtype!r}; use bf16, fp16 or fp32", source="dtype", field="dtype")
    for kind in kinds:
        if kind not in LAYER_KINDS:
            raise InputError(f"unknown layer kind {kind!r}; known: {', '.join(LAYER_KINDS)}", source="kinds",
                             field="kinds")
    check_positive_int(repeats, "repeats")
    check_positive_int(threads, "threads")
    return dtype


def measure_points(spec: ModelSpec, points: list[Point], *, device: str = "cpu", dtype: str | None = None,
                   threads: int = 1, warmup: int = 2, repeats: int = 5, progress: bool = False,
                   seed: int = 0, statistic: str = "median", runner: LayerRunner | None = None) -> list[dict[str, Any]]:
    """Measure each point on the real layer modules; one row per point (seconds, saved bytes). ``runner``:
    the :class:`LayerRunner` to measure with (e.g. over a Hugging Face chain, or under autocast); default:
    the reference model's layers of ``spec`` in ``dtype``."""
    if statistic not in STATISTICS:
        raise InputError(f"must be one of {', '.join(STATISTICS)}, got {statistic!r}", source="statistic",
                         field="statistic")
    dtype = _check_measure_args(device, dtype, {p.kind for p in points}, repeats, threads)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    runner = runner or LayerRunner(spec, device=device, dtype=dtype, seed=seed)
    rows = []
    try:
        bar = tqdm(points, desc="profile", unit="shape", disable=not progress, file=sys.stderr)
        for point in bar:
            tokens = int(sum(point.lengths))
            bar.set_postfix_str(f"{point.kind} {point.tiles} tiles {tokens} tokens")
            carry = runner.carry(point.kind, point.tiles, list(point.lengths))
            times = runner.time(point.kind, carry, warmup=warmup, repeats=repeats)
            key = statistic if not statistic.startswith("cpu") or "fwd_cpu_s" in times else "median"
            row = dict(kind=point.kind, tiles=point.tiles, tokens=tokens,
                       segments=_compress_lengths(point.lengths), features=point.features.tolist(),
                       fwd_s=times[f"fwd_{key}_s"], bwd_s=times[f"bwd_{key}_s"], **times,
                       saved_bytes=runner.saved_bytes(point.kind, carry))
            peak = runner.peak_bytes(point.kind, carry)
            if peak is not None:
                row["peak_bytes"] = peak
            rows.append(row)
    finally:
        torch.set_num_threads(old_threads)
    return rows


def _compress_lengths(lengths: tuple[int, ...]) -> list[list[int]]:
    """Run-length form [[length, count], ...] (a 16k-token grid point has up to 256 equal segments)."""
    out: list[list[int]] = []
    for n in lengths:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return out


def measure(spec: ModelSpec, config: ProfileConfig | None = None, *, progress: bool = False) -> dict[str, Any]:
    """Measure every kind of ``config`` (default: :class:`ProfileConfig`'s defaults) over its grid and fit it;
    returns the profile (JSON-able dict, see :func:`omnibal.cost.profile.save_profile` and docs/cost.md for
    the format). ``progress``: a progress bar on stderr."""
    c = config or ProfileConfig()
    dtype = _check_measure_args(c.device, c.dtype, c.kinds, c.repeats, c.threads)
    grid = c.grid()
    load_before = load_average()
    started = _dt.datetime.now(_dt.timezone.utc)
    rows = measure_points(spec, grid_points(grid, spec, c.kinds), device=c.device, dtype=dtype, threads=c.threads,
                          warmup=c.warmup, repeats=c.repeats, progress=progress, seed=c.seed, statistic=c.statistic)
    profile = {
        "format": FORMAT,
        "model": {"name": spec.name, "fingerprint": spec.fingerprint(), "spec": spec.to_dict()},
        "device": device_info(c.device, c.threads),
        "dtype": dtype,
        "threads": c.threads,
        "torch_version": torch.__version__,
        "created": started.isoformat(timespec="seconds"),
        "seconds": round((_dt.datetime.now(_dt.timezone.utc) - started).total_seconds(), 2),
        "load_average": {"before": load_before, "after": load_average()},
        "warmup": c.warmup,
        "repeats": c.repeats,
        "statistic": c.statistic,
        "grid": grid.to_dict(),
        "measurements": rows,
    }
    profile["fit"] = fit_profile(rows)
    return profile
