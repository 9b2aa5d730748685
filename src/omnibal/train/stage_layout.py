"""Which layers each pipeline stage (and model chunk) runs, and what it recomputes: a :class:`StageLayout`
from a plan file, from ``--stage-layers``, or from an even split.

A stage is a contiguous half-open range ``[start, end)`` of the model's layer chain (``ModelSpec.layers()``).
:mod:`omnibal.train.pipeline` runs the stages this module lays out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from omnibal.cost.spec import even_cuts
from omnibal.errors import InputError
from omnibal.plan.plan import Plan
from omnibal.validate import is_int


def even_split(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous ranges of :func:`omnibal.cost.spec.even_cuts` (counts differ by at most one, earlier stages
    get the extra): the same even split the planner and simulator use."""
    cuts = even_cuts(num_layers, num_stages)
    return tuple(zip(cuts[:-1], cuts[1:]))


def validate_stage_layers(ranges: Sequence[Sequence[int]], num_layers: int, *, source: str,
                          num_stages: int | None = None) -> tuple[tuple[int, int], ...]:
    """Check that ranges are non-empty, contiguous and cover exactly ``[0, num_layers)``."""
    out: list[tuple[int, int]] = []
    if num_stages is not None and len(ranges) != num_stages:
        raise InputError(f"{len(ranges)} stage ranges for {num_stages} pipeline stages", source=source,
                         field="stage_layers")
    expect = 0
    for s, rng in enumerate(ranges):
        if len(rng) != 2 or not all(is_int(v) for v in rng):
            raise InputError(f"a stage range is [start, end) of two integers, got {rng!r}", source=source,
                             record=f"stage {s}", field="stage_layers")
        start, end = int(rng[0]), int(rng[1])
        if start != expect:
            raise InputError(f"stage starts at layer {start}, expected {expect} (ranges must be contiguous "
                             f"from 0)", source=source, record=f"stage {s}", field="stage_layers")
        if end <= start:
            raise InputError(f"empty stage [{start}, {end})", source=source, record=f"stage {s}",
                             field="stage_layers")
        out.append((start, end))
        expect = end
    if expect != num_layers:
        raise InputError(f"stages cover layers [0, {expect}) but the model has {num_layers} layers",
                         source=source, field="stage_layers")
    return tuple(out)


def parse_stage_layers(text: str) -> tuple[tuple[int, int], ...]:
    """Parse ``--stage-layers "0:9,9:20"`` (half-open ranges)."""
    ranges = []
    for k, part in enumerate(p for p in text.split(",") if p.strip()):
        try:
            a, b = part.split(":")
            ranges.append((int(a), int(b)))
        except ValueError:
            raise InputError(f"expected START:END, got {part.strip()!r}", source="--stage-layers",
                             record=f"stage {k}") from None
    return tuple(ranges)


@dataclass(frozen=True)
class StageLayout:
    """Layer ranges and recompute sets of every stage, checked against the model's layer chain."""

    ranges: tuple[tuple[int, int], ...]
    recompute: tuple[tuple[str, ...], ...]
    """Per stage, the names of the layers recomputed whole in backward."""
    selective: tuple[tuple[str, ...], ...] = ()
    """Per stage, the names of the layers under selective recompute (:mod:`omnibal.train.recompute`;
    empty: none)."""
    num_chunks: int = 1
    """Model chunks per pipeline rank (an interleaved plan's: ``ranges`` are then its ``pp x num_chunks``
    virtual stages, virtual stage ``c * pp + d`` on rank ``d``)."""
    level_recompute: tuple[tuple[tuple[str, ...], ...], ...] = ()
    """Per level of a multi-level (HBP) schedule, per stage (per virtual stage when interleaved), the layers
    recomputed whole on that level's steps (empty: every step uses ``recompute``;
    :mod:`omnibal.train.level_recompute`)."""
    level_selective: tuple[tuple[tuple[str, ...], ...], ...] = ()
    """As ``level_recompute``, the layers under selective recompute."""

    def __post_init__(self) -> None:
        if not self.selective:
            object.__setattr__(self, "selective", tuple(() for _ in self.ranges))

    def names(self, layer_names: Sequence[str], stage: int) -> tuple[str, ...]:
        start, end = self.ranges[stage]
        return tuple(layer_names[start:end])


def load_plan_layout(path: str | Path, layer_names: Sequence[str], *, pp_size: int,
                     model_name: str | None = None) -> StageLayout:
    """Stage ranges and recompute sets of a plan file, read by :meth:`omnibal.plan.plan.Plan.load` (the one
    plan reader, fuzz-tested: every field typed and range-checked, an InputError naming the file and field)
    and checked against this run: the plan's model (``inputs.model``), one stage per pipeline stage, and each
    stage's ``modules`` equal to the model's layer names for its range. A key the plan format does not have
    (a misspelt ``recompute``, say) is refused, not ignored."""
    src = str(path)
    plan = Plan.load(path)
    raw = json.loads(Path(path).read_bytes())  # Plan.load parsed it: valid JSON
    if raw.get("model", plan.inputs.model) != plan.inputs.model:
        raise InputError(f"model {raw['model']!r:.60} differs from inputs.model {plan.inputs.model!r}", source=src,
                         field="model")
    if model_name is not None and plan.inputs.model != model_name:
        raise InputError(f"plan was made for model {plan.inputs.model!r}, this run trains {model_name!r}",
                         source=src, field="inputs.model")
    checked = validate_stage_layers([list(st.layers) for st in plan.stages], len(layer_names), source=src,
                                    num_stages=pp_size * plan.inputs.num_chunks)
    for s, ((start, end), stage) in enumerate(zip(checked, plan.stages)):
        own = tuple(layer_names[start:end])
        if stage.modules != own:
            raise InputError(f"plan names modules {list(stage.modules)} for layers [{start}, {end}) but the model "
                             f"has {list(own)}", source=src, record=f"stages[{s}]", field="modules")
    return StageLayout(checked, tuple(tuple(st.recompute) for st in plan.stages),
                       tuple(tuple(st.selective) for st in plan.stages), num_chunks=plan.inputs.num_chunks)


def resolve_layout(layer_names: Sequence[str], *, pp_size: int, mode: str,
                   stage_layers: Sequence[Sequence[int]] | None = None,
                   recompute: Sequence[Sequence[str]] | None = None, plan_path: str | None = None,
                   model_name: str | None = None, recomputable: Sequence[str] | None = None,
                   selective: Sequence[Sequence[str]] | None = None) -> StageLayout:
    """The stage layout of a run. Precedence: explicit ranges > plan (offline mode) > even split.

    Recompute: explicit sets (whole layers ``recompute``, selective ``selective``) > plan sets (offline mode)
    > every recomputable layer recomputed whole (baseline: InternVL's default) > none.
    """
    num_layers = len(layer_names)
    plan = None
    if plan_path is not None and mode == "offline":
        plan = load_plan_layout(plan_path, layer_names, pp_size=pp_size, model_name=model_name)
    if stage_layers is not None:
        ranges = validate_stage_layers(stage_layers, num_layers, source="--stage-layers", num_stages=pp_size)
    elif plan is not None:
        ranges = plan.ranges
    else:
        ranges = even_split(num_layers, pp_size)
    none = tuple(() for _ in ranges)
    if recompute is not None or selective is not None:
        sets = _explicit_sets(recompute, layer_names, ranges, "--recompute")
        sel = _explicit_sets(selective, layer_names, ranges, "--selective")
    elif plan is not None and stage_layers is None:
        sets, sel = plan.recompute, plan.selective
    elif mode == "baseline":
        allowed = set(recomputable if recomputable is not None else layer_names)
        sets, sel = tuple(tuple(n for n in layer_names[a:b] if n in allowed) for a, b in ranges), none
    else:
        sets, sel = none, none
    for s, (whole, part) in enumerate(zip(sets, sel)):
        both = sorted(set(whole) & set(part))
        if both:
            raise InputError(f"layers both recomputed whole and selectively: {both}", source="--selective",
                             record=f"stage {s}")
    chunks = plan.num_chunks if plan is not None and stage_layers is None else 1  # the plan's virtual stages
    return StageLayout(tuple(ranges), sets, sel, num_chunks=chunks)


def layout_schedule(layout: StageLayout, schedule: str) -> str:
    """The pipeline schedule a layout runs: ``interleaved`` for several chunks per rank (what a ``1f1b`` run
    of an interleaved plan becomes), else ``schedule``; GPipe with chunks is refused."""
    if layout.num_chunks == 1:
        return schedule
    if schedule == "gpipe":
        raise InputError(f"the plan runs {layout.num_chunks} model chunks per stage (interleaved 1F1B); it cannot run "
                         "under GPipe", source="--pp-schedule", field="pp_schedule")
    return "interleaved"


def _explicit_sets(given, layer_names: Sequence[str], ranges, flag: str) -> tuple[tuple[str, ...], ...]:
    """Per-stage layer names given on the command line (None: none), each checked to be in its stage."""
    if given is None:
        return tuple(() for _ in ranges)
    sets = tuple(tuple(r) for r in given)
    if len(sets) != len(ranges):
        raise InputError(f"{len(sets)} stages of names for {len(ranges)} stages", source=flag)
    for s, names in enumerate(sets):
        own = layer_names[ranges[s][0]:ranges[s][1]]
        bad = [n for n in names if n not in own]
        if bad:
            raise InputError(f"names layers not in stage {s}: {bad}", source=flag, record=f"stage {s}")
    return sets
