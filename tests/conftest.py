"""Shared test fixtures.

``shared_data``: the real InternVL-1.2M per-sample statistics that sit beside the project in
``../shared/data/internvl-1.2m-stats`` (CI always has them; a user's clone may not, so tests skip).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_STATS = Path(os.environ.get("OMNIBAL_SHARED_STATS", ROOT.parent / "shared" / "data" / "internvl-1.2m-stats"))
REAL_STATS_FILES = {
    "ai2d": "ai2d_train_12k_wh_token_lengths.json",
    "chartqa": "chartqa_train_18k_wh_token_lengths.json",
}


@pytest.fixture(scope="session")
def shared_stats_dir() -> Path:
    """Folder of the real statistics; skips the test when it is not beside the checkout."""
    if not all((SHARED_STATS / f).is_file() for f in REAL_STATS_FILES.values()):
        pytest.skip(f"real statistics not found at {SHARED_STATS} (they come with ../shared; CI has them)")
    return SHARED_STATS

