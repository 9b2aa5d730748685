"""A plan's engine files: each engine's export written by the integration that owns its format
(``omnibal.integrations.deepspeed``, ``megatron``, ``torchtitan``; the fields they hold are
``omnibal.plan.exports``'). The integrations are imported when an export is written: DeepSpeed's and
Megatron's import torch."""

from __future__ import annotations

from pathlib import Path

from omnibal.errors import InputError
from omnibal.plan.exports import EXPORT_ENGINES


def write_engine_export(engine: str, plan, out_dir: str | Path) -> list[Path]:
    """``engine``'s files for ``plan`` under ``out_dir`` (InputError when the engine cannot express it)."""
    if engine == "deepspeed":
        from omnibal.integrations.deepspeed import write_exports
    elif engine == "megatron":
        from omnibal.integrations.megatron import write_exports
    elif engine == "torchtitan":
        from omnibal.integrations.torchtitan import write_exports
    else:
        raise InputError(f"no export for {engine!r}; one of {', '.join(EXPORT_ENGINES)}", source="--engine",
                         field="engine")
    return write_exports(plan, out_dir)


def write_engine_exports(plan, out_dir: str | Path) -> tuple[dict, dict]:
    """The plan's engine files under ``out_dir`` (a plan for ``reference``: every engine that can express it).
    Returns ({engine: [paths]}, {engine: why not written})."""
    engines = EXPORT_ENGINES if plan.engine == "reference" else (plan.engine,)
    written, skipped = {}, {}
    for engine in engines:
        try:
            written[engine] = write_engine_export(engine, plan, out_dir)
        except InputError as exc:
            if plan.engine != "reference":
                raise  # the engine's own plan must be expressible: a bug, not a user choice
            skipped[engine] = str(exc)
    return written, skipped
