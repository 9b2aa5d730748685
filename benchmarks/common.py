"""What every benchmark shares: where the repository, its results and ``../shared`` are, the provenance
written into every result, and writing a result (JSON + markdown) into ``benchmarks/results``.

``../shared`` (the real statistics) is found one way: ``$OMNIBAL_SHARED``, else the folder ``shared`` beside
the checkout (``/work/shared`` for ``/work/main`` and for ``/work/wt-*`` alike). The statistics folder alone
can be pointed elsewhere with ``$OMNIBAL_SHARED_STATS``, as for the tests (tests/conftest.py).
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from omnibal.measure.machine import cpu_name, load_average

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SHARED = Path(os.environ.get("OMNIBAL_SHARED", ROOT.parent / "shared"))
SHARED_STATS = Path(os.environ.get("OMNIBAL_SHARED_STATS", SHARED / "data" / "internvl-1.2m-stats"))
STATS_FILES = ("ai2d_train_12k_wh_token_lengths.json", "chartqa_train_18k_wh_token_lengths.json")
"""The two real statistics files the CPU benchmarks draw their samples from."""


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def provenance() -> dict[str, Any]:
    """Where a result comes from: git commit and whether the tree had uncommitted changes, machine, CPU
    count, load average, Python and torch versions, and the date (UTC)."""
    return {
        "git_commit": _git("rev-parse", "HEAD") or None,
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "machine": platform.node(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_average": load_average(),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),  # not imported: a benchmark may measure its own memory
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def load_1min() -> float:
    """The 1-minute load average now (0.0 where the OS has none)."""
    return (load_average() or [0.0])[0]


def logger(name: str):
    """``log(msg)``: a progress line on stderr, with the load average at that moment."""

    def log(msg: str) -> None:
        print(f"[{name}] {msg} (load {load_1min():.2f})", file=sys.stderr, flush=True)

    return log


def write_result(name: str, doc: dict, markdown: str | None = None, *, out: Path = RESULTS) -> Path:
    """Write ``out/NAME.json`` (``doc`` with the :func:`provenance` under ``provenance``) and, when given,
    ``out/NAME.md`` (the markdown, ending with one provenance line). Returns the JSON path."""
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    path = out / f"{name}.json"
    path.write_text(json.dumps({**doc, "provenance": prov}, indent=1, default=float) + "\n")
    if markdown is not None:
        commit = (prov["git_commit"] or "unknown")[:10] + (" (dirty)" if prov["git_dirty"] else "")
        load = prov["load_average"]
        line = (f"Measured at git {commit} on {prov['machine']} ({prov['cpu']}, {prov['cpu_count']} CPUs), load "
                f"average {load[0] if load else 'n/a'}, torch {prov['torch']}, {prov['date']}.")
        (out / f"{name}.md").write_text(markdown.rstrip("\n") + "\n\n" + line + "\n")
    return path
