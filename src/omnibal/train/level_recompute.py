"""Per-level recompute of a multi-level (HBP) schedule: each level's own recompute set on every stage.

``omnibal plan --hbp`` chooses, per level, the least recompute that fits that level's micro-batches (short
levels recompute less) and writes it into the training schedule (``meta.hbp.level_recompute``: per level,
the chain's layer names recomputed whole; ``level_selective``: selectively). A layer set is independent of
the partition, so the trainer splits it by its own stage ranges (:func:`level_layout`) and, before every
step, puts the step's level's set on its stage (:class:`LevelRecompute`): the stage's ``granularity`` is
read at every layer call, so the switch costs nothing.

    layout = level_layout(layout, layer_names, level_recompute=[["llm.blocks.0"], []], source="schedule.json")
    levels = LevelRecompute(layout, schedule, stage_indices=[pp_rank])   # an interleaved rank: its chunks'
    levels.apply(stage_module, schedule, step)        # before the step's forward
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from torch import nn

from omnibal.errors import InputError
from omnibal.train.stage import apply_checkpointing


def level_layout(layout, layer_names: Sequence[str], *, level_recompute: Sequence[Sequence[str]],
                 level_selective: Sequence[Sequence[str]] | None = None, source: str = "schedule"):
    """``layout`` (a :class:`omnibal.train.stage_layout.StageLayout`) with per-level, per-stage sets: each
    level's whole-chain names split by the layout's stage ranges. Names the model lacks, a layer both
    recomputed whole and selectively, or lists of different lengths are an InputError naming ``source``."""
    selective = [() for _ in level_recompute] if level_selective is None else level_selective
    if len(selective) != len(level_recompute):
        raise InputError(f"{len(level_recompute)} levels of recompute sets but {len(selective)} of selective sets",
                         source=source, field="level_selective")
    known = set(layer_names)
    whole_sets, part_sets = [], []
    for level, (whole, part) in enumerate(zip(level_recompute, selective)):
        for field, names in (("level_recompute", whole), ("level_selective", part)):
            bad = sorted(set(names) - known)
            if bad:
                raise InputError(f"names layers the model does not have: {bad[:4]}", source=source,
                                 record=f"level {level}", field=field)
        both = sorted(set(whole) & set(part))
        if both:
            raise InputError(f"layers both recomputed whole and selectively: {both[:4]}", source=source,
                             record=f"level {level}", field="level_selective")
        whole_sets.append(_per_stage(layout.ranges, layer_names, set(whole)))
        part_sets.append(_per_stage(layout.ranges, layer_names, set(part)))
    return replace(layout, level_recompute=tuple(whole_sets), level_selective=tuple(part_sets))


def _per_stage(ranges, layer_names: Sequence[str], chosen: set) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(n for n in layer_names[a:b] if n in chosen) for a, b in ranges)


class LevelRecompute:
    """Puts the recompute set of each step's level on one rank's stage (see the module docstring): its
    layout stages ``stage_indices``, one per model chunk (an interleaved rank holds several)."""

    def __init__(self, layout, schedule, *, stage_indices: Sequence[int]) -> None:
        self.whole = [[sets[i] for i in stage_indices] for sets in layout.level_recompute]
        self.part = [[sets[i] for i in stage_indices] for sets in layout.level_selective] \
            if layout.level_selective else [[() for _ in stage_indices] for _ in self.whole]
        self.current: int | None = None
        """The level whose set is on the stage now (None: the layout's own set)."""
        self.check(schedule)

    def check(self, schedule) -> None:
        """The schedule must be multi-level with as many levels as there are sets."""
        source = getattr(schedule, "source", "schedule")
        level_sp = getattr(schedule, "level_sp", None)
        if getattr(schedule, "levels", None) is None or level_sp is None:
            raise InputError("per-level recompute sets need a multi-level (HBP) schedule", source=source,
                             field="levels")
        if len(level_sp) != len(self.whole):
            raise InputError(f"the schedule has {len(level_sp)} levels but {len(self.whole)} per-level recompute "
                             "sets were given", source=source, field="level_recompute")

    def level_of(self, schedule, step: int) -> int:
        return int(schedule.levels[step])

    def apply(self, stage, schedule, step: int) -> int:
        """Put ``step``'s level's sets on ``stage`` (one :class:`omnibal.train.stage.Stage`, or an
        ``nn.ModuleList`` of its chunks) when the level changed; returns the level."""
        level = self.level_of(schedule, step)
        if level != self.current:
            chunks = list(stage) if isinstance(stage, nn.ModuleList) else [stage]
            assert len(chunks) == len(self.whole[level]), "one recompute set per chunk of the stage"
            for chunk, whole, part in zip(chunks, self.whole[level], self.part[level]):
                apply_checkpointing(chunk, whole, part)
            self.current = level
        return level


def schedule_level_layout(layout, schedule, layer_names: Sequence[str], *, model_name: str, notify=None):
    """``layout`` with the per-level recompute sets a multi-level schedule records (``meta.hbp``, written by
    ``omnibal plan --hbp`` for its model): unchanged when it records none, or when they were chosen for
    another model (``notify(line)`` is told: every level then runs the layout's sets)."""
    meta = (getattr(schedule, "meta", None) or {}).get("hbp") or {}
    if meta.get("level_recompute") is None or getattr(schedule, "levels", None) is None:
        return layout
    if meta.get("model") != model_name:
        if notify is not None:
            notify(f"the schedule's per-level recompute sets were planned for model {meta.get('model')!r}; this run "
                   f"trains {model_name!r}: every level runs the stage layout's recompute sets")
        return layout
    return level_layout(layout, layer_names, level_recompute=meta["level_recompute"],
                        level_selective=meta.get("level_selective"), source=getattr(schedule, "source", "schedule"))
