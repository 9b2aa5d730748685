"""The README's test command and .ci/run must not drift apart."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n.*?```(?:bash|sh)\n(.*?)```", text, re.S)
    assert block, "README has no '## Quick start' bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_has_exactly_two_commands_and_ci_runs_the_test_one():
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci, "the README's test command must appear verbatim in .ci/run"
    assert "torch==2.13.0" in commands[0] and "torch==2.13.0" in commands[1]


def test_every_test_named_in_the_guarantees_exists():
    """docs/guarantees.md maps each promise to named tests: every name must be a test in that file."""
    text = (ROOT / "docs" / "guarantees.md").read_text()
    missing, named = [], 0
    for line in text.splitlines():
        current = None
        for ref in re.findall(r"`([^`]+)`", line):
            m = re.fullmatch(r"(test_\w+\.py)(?:::(\w+))?", ref) or re.fullmatch(r"::(\w+)", ref)
            if m is None:
                continue
            if ref.startswith("::"):
                file, name = current, m.group(1)
            else:
                file, name = m.group(1), m.group(2)
                current = file
            path = ROOT / "tests" / file if file else None
            if path is None or not path.is_file():
                missing.append(f"{file}::{name}")
                continue
            named += 1
            if name and not re.search(rf"^def {name}\(", path.read_text(), re.M):
                missing.append(f"{file}::{name}")
    assert named > 40 and not missing, missing


def test_what_the_readmes_commands_write_is_ignored_by_git():
    """The README's commands left ``omnibal-out/``, ``ex/`` and ``stats.jsonl`` untracked in the checkout."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["omnibal-out/plan.json", "ex/annotations.jsonl", "ex/finetuned/config.json", "stats.jsonl",
             "stats.parquet", "omnibal-example/summary.json", "simulate-report/report.md"]
    out = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert sorted(out.stdout.split()) == sorted(paths), out.stdout + out.stderr
