"""Measured layer profiles: the grid of shapes, the per-kind fits over ``(one, tiles, tokens, tokens_sq)``, the
JSON format and the cost table built from a profile. The measurement itself (running the reference trainer's
real modules, :mod:`omnibal.train.layers`) is :func:`omnibal.measure.profile.measure`; this module is pure.

Timing: CUDA events on a GPU; on a CPU the wall clock with a fixed torch thread count. Each shape is run
``warmup`` times untimed and ``repeats`` times timed; the median is kept as ``fwd_s``/``bwd_s``. On a machine
shared with other jobs, ``statistic="min"`` keeps the least disturbed run instead, ``statistic="cpu"`` the
median process CPU time (CPU only; with one torch thread it is the wall time the work would take on an
idle core, without the time other jobs took the core away) and ``cpu_min`` its minimum. All are recorded,
with the load average before and after. Memory: the bytes autograd saves for backward, measured with
``torch.autograd.graph.saved_tensors_hooks`` (exact and device-independent: unique storages, parameters
excluded, the layer's input included as in the analytic accounting); on a GPU also the peak of
``torch.cuda.max_memory_allocated`` above the pre-forward level.

Grid per kind (features that vary):

- ``vision_embed``, ``vision_block``, ``projector``: tiles (one micro-batch of ``tiles`` tiles).
- ``llm_embed``: tokens x (1 tile, or half of the tokens as image slots).
- ``llm_block``: tokens x attention-segment length (segments of equal length, the last one shorter): the
  fit separates the linear from the quadratic (``tokens_sq``) cost.
- ``lm_head``: tokens (every token a target).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omnibal.cost.analytic import analytic_cost_table, layer_param_bytes, layer_work
from omnibal.cost.fit import fit_linear
from omnibal.cost.hardware import HardwareSpec, get_hardware
from omnibal.cost.spec import LAYER_KINDS, ModelSpec
from omnibal.cost.table import FEATURES, LayerCostTable
from omnibal.errors import InputError
from omnibal.layout import Dtype
from omnibal.outputs import write_text

FORMAT = "omnibal-profile/1"
ONE, TILES, TOKENS, TOKENS_SQ = range(len(FEATURES))
FIT_COLUMNS: dict[str, tuple[int, ...]] = {
    "vision_embed": (ONE, TILES),
    "vision_block": (ONE, TILES),
    "projector": (ONE, TILES),
    "llm_embed": (ONE, TILES, TOKENS),
    "llm_block": (ONE, TOKENS, TOKENS_SQ),
    "lm_head": (ONE, TOKENS),
}
VISION_KINDS = ("vision_embed", "vision_block", "projector")
STATISTICS = ("median", "min", "cpu", "cpu_min")


@dataclass(frozen=True, kw_only=True)
class ProfileGrid:
    """Shapes to measure."""

    tiles: tuple[int, ...] = (1, 2, 4, 8, 12, 16)
    """Tiles per micro-batch for the vision layers and the projector."""
    tokens: tuple[int, ...] = (256, 512, 1024, 1536, 2048)
    """LLM tokens per micro-batch."""
    segments: tuple[int, ...] = (64, 256, 512, 1024)
    """Attention-segment lengths for ``llm_block`` (those <= tokens; tokens itself when none is)."""

    def __post_init__(self) -> None:
        for name in ("tiles", "tokens", "segments"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise InputError(f"must be a non-empty list of positive integers, got {values!r}",
                                 source="grid", field=name)

    def shapes(self, kind: str, spec: ModelSpec) -> list[dict[str, int]]:
        """The measurement points of ``kind``: dicts with tiles, tokens, segment (length)."""
        if kind in VISION_KINDS:
            return [dict(tiles=t, tokens=0, segment=0) for t in self.tiles]
        if kind == "llm_embed":  # two image-slot counts per token count, so tiles and tokens separate
            tpt = spec.llm_tokens_per_tile
            return [dict(tiles=t, tokens=n, segment=n) for n in self.tokens
                    for t in sorted({1, max(1, n // (2 * tpt))})]
        if kind == "lm_head":
            return [dict(tiles=0, tokens=n, segment=n) for n in self.tokens]
        out = []
        for n in self.tokens:
            for seg in sorted({s for s in self.segments if s <= n} or {n}):
                out.append(dict(tiles=0, tokens=n, segment=seg))
        return out

    def to_dict(self) -> dict[str, list[int]]:
        return {"tiles": list(self.tiles), "tokens": list(self.tokens), "segments": list(self.segments)}


CPU_GRID = ProfileGrid()
GPU_GRID = ProfileGrid(tiles=(1, 2, 4, 8, 16, 24, 32), tokens=(1024, 2048, 4096, 8192, 16384),
                       segments=(256, 1024, 2048, 4096, 8192))


def parse_device(text: str) -> str:
    """A measuring device: ``cpu``, ``cuda`` or ``cuda:N`` (InputError naming ``--device`` otherwise)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise InputError(f"must be cpu or cuda[:N], got {text!r}", source="--device", field="device")
    return text


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """What :func:`omnibal.measure.profile.measure` measures and how: the device, the grid of shapes, the
    layer kinds and the timing protocol. ``omnibal profile`` takes one flag per field."""

    device: str = field(default="cpu", metadata={"parse": parse_device, "metavar": "DEVICE"})
    """Device to measure on: `cpu`, or `cuda` / `cuda:N` for a GPU (timed with CUDA events)."""
    dtype: Dtype | None = None
    """Training dtype the layers run in (default: fp32 on cpu, bf16 on cuda)."""
    threads: int = 1
    """Torch CPU threads while measuring (on a CPU the timings are per this many threads)."""
    tiles: tuple[int, ...] | None = None
    """Tiles per micro-batch measured for the vision layers and the projector, e.g. 1,2,4,8 (default: the
    device's grid, `omnibal.cost.profile.CPU_GRID` or `GPU_GRID`)."""
    tokens: tuple[int, ...] | None = None
    """LLM tokens per micro-batch measured, e.g. 256,1024 (default: the device's grid)."""
    segments: tuple[int, ...] | None = None
    """Attention-segment lengths measured for `llm_block`, e.g. 64,256 (default: the device's grid)."""
    kinds: tuple[str, ...] = field(default=LAYER_KINDS, metadata={"metavar": "KINDS"})
    """Layer kinds to measure, comma-separated (default: all of them)."""
    warmup: int = 2
    """Untimed runs per shape before the timed ones."""
    repeats: int = 5
    """Timed runs per shape."""
    statistic: str = field(default="median", metadata={"choices": STATISTICS})
    """Which timing becomes the fitted one: `median` wall time; `min`: the least disturbed run; `cpu`: the
    median process CPU time (CPU only; robust when other jobs share the cores); `cpu_min`: its minimum."""
    seed: int = 0
    """Seed of the layers' weight initialisation."""

    def __post_init__(self) -> None:
        self.grid()  # a bad tiles / tokens / segments list is refused here, naming the field (the device,
        # dtype, kinds and statistic are checked where they are used: omnibal.measure.profile)

    def grid(self) -> ProfileGrid:
        """The shapes to measure: the given lists, the device's default grid for the others."""
        base = GPU_GRID if self.device.startswith("cuda") else CPU_GRID
        return ProfileGrid(tiles=self.tiles or base.tiles, tokens=self.tokens or base.tokens,
                           segments=self.segments or base.segments)


@dataclass(frozen=True)
class Point:
    """One measurement: a layer kind on a micro-batch of ``tiles`` tiles and attention segments ``lengths``."""

    kind: str
    tiles: int
    lengths: tuple[int, ...]

    @property
    def features(self) -> np.ndarray:
        return np.array([1.0, self.tiles, float(sum(self.lengths)), float(sum(n * n for n in self.lengths))])


def segment_lengths(tokens: int, segment: int) -> list[int]:
    """``tokens`` cut into attention segments of ``segment`` tokens, the last one shorter."""
    full, rest = divmod(tokens, segment)
    return [segment] * full + ([rest] if rest else [])


def grid_points(grid: ProfileGrid, spec: ModelSpec, kinds: tuple[str, ...]) -> list[Point]:
    return [Point(kind, sh["tiles"], tuple(segment_lengths(sh["tokens"], sh["segment"])) if sh["tokens"] else ())
            for kind in kinds for sh in grid.shapes(kind, spec)]


def fit_profile(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: non-negative fits of forward time, backward time and saved bytes over its feature columns,
    with their in-sample relative errors."""
    fits: dict[str, Any] = {}
    for kind in LAYER_KINDS:
        sel = [r for r in rows if r["kind"] == kind]
        if not sel:
            continue
        feats = np.array([r["features"] for r in sel])
        cols = FIT_COLUMNS[kind]
        entry: dict[str, Any] = {"columns": [FEATURES[c] for c in cols]}
        for key, name in (("fwd_s", "fwd_time"), ("bwd_s", "bwd_time"), ("saved_bytes", "act_bytes")):
            values = np.array([r[key] for r in sel], dtype=np.float64)
            if not np.any(values > 0):
                entry[name] = {"coef": [0.0] * len(FEATURES), "mean_rel_error": 0.0, "max_rel_error": 0.0}
                continue
            res = fit_linear(feats, values, cols)
            entry[name] = {"coef": res.coef.tolist(), "mean_rel_error": res.mean_rel_error,
                           "max_rel_error": res.max_rel_error}
        fits[kind] = entry
    return fits


# ----------------------------------------------------------------------------------------- load / use
def save_profile(profile: dict[str, Any], path: str | Path) -> None:
    write_text(path, json.dumps(profile, indent=1) + "\n")


def load_profile(path: str | Path, spec: ModelSpec | None = None) -> dict[str, Any]:
    """Read a profile; with ``spec``, refuse one measured on another model (InputError naming the field)."""
    path = Path(path)
    try:
        profile = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError("no such file", source=str(path), field="path") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"not JSON: {exc}", source=str(path), record=f"line {exc.lineno}") from None
    if not isinstance(profile, dict) or profile.get("format") != FORMAT:
        raise InputError(f"not an omnibal profile (expected format {FORMAT!r})", source=str(path), field="format")
    for key in ("model", "fit", "dtype", "measurements"):
        if key not in profile:
            raise InputError("missing", source=str(path), field=key)
    if spec is not None:
        check_profile_model(profile, spec, source=str(path))
    return profile


def check_profile_model(profile: dict[str, Any], spec: ModelSpec, *, source: str = "profile") -> None:
    model = profile["model"]
    if model.get("fingerprint") != spec.fingerprint():
        raise InputError(f"profile was measured on model {model.get('name')!r} (fingerprint "
                         f"{model.get('fingerprint')}), not on {spec.name!r} ({spec.fingerprint()})",
                         source=source, field="model.fingerprint")
    if model.get("name") != spec.name:
        raise InputError(f"profile was measured on model {model.get('name')!r}, not {spec.name!r} (same shape; "
                         "rename the spec or the profile's model.name if that is intended)",
                         source=source, field="model.name")


def cost_table_from_profile(spec: ModelSpec, profile: dict[str, Any], *, hardware: HardwareSpec | None = None,
                            tp_size: int = 1, tp_vision: bool = True, stack="omnibal") -> LayerCostTable:
    """A :class:`LayerCostTable` whose times and activation bytes are the profile's fits (per kind);
    checkpoint, boundary and parameter bytes come from the analytic model in the profile's dtype.

    A profile is measured on one device. For ``tp_size > 1`` (needs ``hardware``) each fitted coefficient is
    scaled by the analytic model's ratio (tensor-parallel / single-device, per layer and feature) and the
    tensor-parallel communication time is the analytic one on ``hardware``.
    """
    check_profile_model(profile, spec)
    if tp_size != 1 and hardware is None:
        raise InputError("tensor parallelism needs the hardware (its links and rates)", source="hardware",
                         field="hardware")
    fits = profile["fit"]
    kinds = [layer.kind for layer in spec.layers()]
    missing = sorted(set(kinds) - set(fits))
    if missing:
        raise InputError(f"profile has no fit for layer kinds {missing}", source="profile", field="fit")
    dtype = profile["dtype"]

    def coef(name: str) -> np.ndarray:
        return np.array([fits[k][name]["coef"] for k in kinds], dtype=np.float64)

    fwd, bwd, act = coef("fwd_time"), coef("bwd_time"), coef("act_bytes")
    tp_comm = None
    work = layer_work(spec, dtype=dtype, tp_size=tp_size, tp_vision=tp_vision)
    if tp_size != 1:
        single = analytic_cost_table(spec, hardware, dtype=dtype)
        split = analytic_cost_table(spec, hardware, dtype=dtype, tp_size=tp_size, tp_vision=tp_vision)
        for mine, name in ((fwd, "fwd_time"), (bwd, "bwd_time"), (act, "act_bytes")):
            one, many = getattr(single, name), getattr(split, name)
            mine *= np.divide(many, one, out=np.ones_like(one), where=one > 0)
        tp_comm = split.tp_comm_time
    act[~work.trainable] = 0.0
    bwd[~work.trainable] = 0.0
    param, grad, optim = layer_param_bytes(spec, dtype=dtype, tp_size=tp_size, tp_vision=tp_vision, stack=stack)
    # selective recompute from the analytic model: the bytes it keeps, and its share of the forward time
    shape = analytic_cost_table(spec, hardware or get_hardware("h100"), dtype=dtype, tp_size=tp_size,
                                tp_vision=tp_vision, stack=stack)
    share = np.divide(shape.sel_fwd_time, shape.fwd_time, out=np.zeros_like(fwd), where=shape.fwd_time > 0)
    ckpt = np.minimum(work.ckpt_bytes, act)
    return LayerCostTable(
        names=tuple(layer.name for layer in spec.layers()), kinds=tuple(kinds), fwd_time=fwd, bwd_time=bwd,
        act_bytes=act, ckpt_bytes=ckpt, sel_act_bytes=np.clip(shape.sel_act_bytes, ckpt, act),
        sel_fwd_time=fwd * share, out_bytes=work.out_bytes, working_copies=shape.working_copies,
        param_bytes=param, grad_bytes=grad, optim_bytes=optim, tp_comm_time=tp_comm,
    )
