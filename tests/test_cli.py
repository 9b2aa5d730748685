import subprocess
import sys

import pytest

from omnibal.cli import COMMANDS, main


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    assert f"omnibal {name}" in capsys.readouterr().out


def test_console_script_module_entry():
    out = subprocess.run([sys.executable, "-m", "omnibal", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("omnibal ")
