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
