"""Statistics in a model's units: the one conversion of per-sample tiles and tokens to what a model runs.

``omnibal plan``, ``simulate`` and ``balance`` (``omnibal.jobs.predict.job_stats``) and the trainer
(``omnibal.train.run``) all call :func:`model_stats`, so a sample has the same length for the planner and for
the run: two conversions drift apart (one re-counting the LLM tokens of each tile for the model, the other
taking the statistics' tokens per tile as they are), and the commands would then disagree by a multiple for the
same job.

Image conventions: a model expects the statistics in its own convention (:func:`model_convention`: LLaVA
models - a projector without a LayerNorm - one image per tile, others InternVL tiles). Statistics recorded
in the same layout, or InternVL statistics with one tile per image for a LLaVA model, are re-counted for the
model's tokens per tile (exact); another layout is an InputError naming both unless ``convert=True``
(``--convert-stats``) asks for :func:`omnibal.stats.table.convert_convention`. Statistics with no recorded
convention are read as ``unrecorded`` (default InternVL-1.5's: 448 px tiles, 256 tokens; the trainer's
``--stats-tokens-per-tile`` sets its tokens per tile), and :func:`model_stats` says so in the table's
``source``. A recorded convention always wins over ``unrecorded``.
"""

from __future__ import annotations

from dataclasses import replace

from omnibal.cost.spec import ModelSpec
from omnibal.errors import InputError
from omnibal.stats.table import (
    INTERNVL_CONVENTION,
    ImageConvention,
    SampleStats,
    convert_convention,
    one_tile_per_image,
)


def model_convention(spec: ModelSpec) -> ImageConvention:
    """The image convention ``spec`` consumes: LLaVA (mlp2x_gelu projector, no LayerNorm: one image, one tile)
    or InternVL tiles; tokens per tile from the spec."""
    layout = "internvl" if spec.projector_norm else "llava"
    return ImageConvention(layout, spec.llm_tokens_per_tile)


def model_stats(stats: SampleStats, spec: ModelSpec, *, convert: bool = False, flag: str = "--convert-stats",
                unrecorded: ImageConvention = INTERNVL_CONVENTION) -> SampleStats:
    """``stats`` with tiles and tokens as ``spec`` runs them (see the module docstring).

    Raises InputError naming both conventions when the layouts differ and ``convert`` is False; ``flag`` is
    the option that asks for the conversion (named in that message). ``unrecorded``: how statistics without a
    recorded convention were counted."""
    target = model_convention(spec)
    recorded = stats.convention
    source = recorded or unrecorded
    if recorded == target:
        return stats
    if recorded is None and source == target:  # the default reading is already the model's convention
        return replace(stats, convention=target)
    exact = source.layout == "internvl" and one_tile_per_image(stats)  # InternVL -> LLaVA changes no tile
    if source.layout != target.layout and not convert and not exact:
        said = source.describe() if recorded is not None else (
            f"no recorded convention, read as {unrecorded.describe()}")
        raise InputError(f"statistics are {said}; model {spec.name} expects {target.describe()}: make the "
                         f"statistics for this model (omnibal stats --convention {target}) or pass {flag} to convert "
                         "them", source=stats.source, field="convention")
    out = convert_convention(replace(stats, convention=source), target)
    if recorded is None:
        out = replace(out, source=f"{stats.source} (no recorded convention: read as {unrecorded}, "
                                  f"converted to {target})")
    return out


def convention_label(raw: SampleStats, spec: ModelSpec, unrecorded: ImageConvention = INTERNVL_CONVENTION) -> str:
    """How ``raw``'s convention was read and what ``spec`` runs, for reports: ``internvl/256 (not recorded:
    default) -> internvl/16``."""
    read = str(raw.convention) if raw.convention is not None else f"{unrecorded} (not recorded: default)"
    target = model_convention(spec)
    return read if raw.convention == target else f"{read} -> {target}"
