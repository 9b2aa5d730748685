"""The code passes `ruff check` under pyproject.toml's settings ([tool.ruff], [tool.ruff.lint]); commit
subjects made since the rule was written are at most 72 characters (CONTRIBUTING.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

SUBJECTS_SINCE = "809e949cd9bec3c75cdd478d743d832f260c38e5"
"""The last commit before the subject rule (CONTRIBUTING.md): commits after it are checked, earlier ones not."""
MAX_SUBJECT = 72


def test_ruff_check_is_clean():
    pytest.importorskip("ruff", reason="ruff is not installed (the test extras pin it: pip install -e .[test])")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "benchmarks"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ruff check found problems:\n{proc.stdout}{proc.stderr}"


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=60)


def test_new_commit_subjects_are_at_most_72_characters():
    if shutil.which("git") is None or _git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        pytest.skip("not a git checkout")
    if _git("merge-base", "--is-ancestor", SUBJECTS_SINCE, "HEAD").returncode != 0:
        pytest.skip("the base commit of the subject rule is not in this checkout's history (a shallow clone?)")
    log = _git("log", "--no-merges", "--format=%h %s", f"{SUBJECTS_SINCE}..HEAD")
    assert log.returncode == 0, log.stderr
    long = [line for line in log.stdout.splitlines() if len(line.partition(" ")[2]) > MAX_SUBJECT]
    assert not long, f"commit subjects over {MAX_SUBJECT} characters (CONTRIBUTING.md: put the rest in the body):\n" \
        + "\n".join(long)
