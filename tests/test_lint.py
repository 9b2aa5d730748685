"""The code passes `ruff check` under pyproject.toml's settings ([tool.ruff], [tool.ruff.lint]); commit
subjects made since the rule was written are at most 72 characters; docstrings say what and why, not
measured figures or history (CONTRIBUTING.md)."""

from __future__ import annotations

import ast
import re
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


HISTORY_OR_FIGURES = re.compile(
    r"\bissue \d+|\b(?:was|were) (?:up to )?\d|\bonce (?:diverged|took|was)\b|\d+(?:\.\d+)?\s*GPU days"
    r"|\d+(?:\.\d+)?x (?:faster|slower|over)\b")
"""What a lab notebook says and a docstring should not: an issue number, a past value, a measured figure."""

CITED_FIGURES = {"src/omnibal/plan/ablation.py"}
"""Modules whose docstring quotes the OmniBal paper's published figures: the reference they reproduce, not a
measurement of ours."""


def _string_statements(path: Path):
    """Every docstring and attribute docstring (a string statement) of a module, with its line."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value


def test_docstrings_carry_no_figures_or_history():
    found = []
    for path in sorted((REPO_ROOT / "src" / "omnibal").rglob("*.py")):
        rel = path.relative_to(REPO_ROOT).as_posix()
        if rel in CITED_FIGURES:
            continue
        for line, text in _string_statements(path):
            found += [f"{rel}:{line}: ...{m.group(0)}..." for m in HISTORY_OR_FIGURES.finditer(text)]
    assert not found, "docstrings with figures or history (they belong in benchmarks/results and the docs):\n" \
        + "\n".join(found)


def test_the_history_pattern_catches_what_it_names():
    for text in ("see issue 21", "once diverged by up to 6.6x", "368.0-377.6 GPU days", "was 33.9 s", "1.4x faster"):
        assert HISTORY_OR_FIGURES.search(text), text
    for text in ("the issue with padding", "what was measured", "GPU days of the job", "a 2x2 mesh"):
        assert not HISTORY_OR_FIGURES.search(text), text
