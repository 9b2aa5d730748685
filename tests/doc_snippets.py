"""The Python snippet of a docs/engines/*.md page, run as written, and the export it reads.

Each page has one ```python block that reads ``omnibal-out/exports/...`` and leaves a few names to the user
(``layers``, ``model``, ...); :func:`run_snippet` executes the block unchanged in a folder holding that export,
with those names bound. :func:`write_tiny_exports` writes the tiny preset's 2-stage plan for an engine there (a
second or so; the pages' own ``omnibal plan`` lines plan the default 128-GPU job, which takes ~25 s each)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = {"vision_layers": 5, "decoder_layers": 6}
"""The tiny preset's chain (``omnibal.cost.presets``): 5 ViT blocks, 6 decoder layers."""


def engine_snippet(engine: str) -> str:
    """The one ```python block of ``docs/engines/<engine>.md``."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "engines" / f"{engine}.md").read_text(), flags=re.S)
    assert len(blocks) == 1, f"docs/engines/{engine}.md has {len(blocks)} python blocks; the test runs exactly one"
    return blocks[0]


def write_tiny_exports(engine: str, folder: Path) -> list[Path]:
    """``omnibal plan --engine <engine>``'s files for the tiny preset on 2 pipeline stages, into
    ``folder/omnibal-out/exports``."""
    import importlib

    from omnibal.jobs.plan_config import PlanJobConfig
    from omnibal.jobs.plan_job import run_plan_job
    from omnibal.layout import Layout
    from omnibal.plan.search import SearchConfig

    zero_stage = 0 if engine == "torchtitan" else 1
    plan = run_plan_job(PlanJobConfig(preset="tiny", engine=engine, num_gpus=2,
                                      layout=Layout(dp_size=1, pp_size=2, zero_stage=zero_stage, num_microbatches=4),
                                      num_samples=2000, search=SearchConfig(radius=1, top_k=2, sample_steps=8))).plan
    module = importlib.import_module(f"omnibal.integrations.{engine}")
    return module.write_exports(plan, Path(folder) / "omnibal-out" / "exports")


def run_snippet(engine: str, folder: Path, **names) -> dict:
    """Execute the page's snippet unchanged with the working directory ``folder`` and ``names`` bound; returns
    its namespace."""
    code = compile(engine_snippet(engine), f"docs/engines/{engine}.md", "exec")
    namespace = {"__name__": f"docs_engines_{engine}", **names}
    here = os.getcwd()
    os.chdir(folder)
    try:
        exec(code, namespace)
    finally:
        os.chdir(here)
    return namespace
