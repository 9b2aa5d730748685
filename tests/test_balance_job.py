"""run_balance_job: omnibal balance as a library call, and the command line generated from its config."""

from __future__ import annotations

import json

import pytest

from omnibal.cli import main
from omnibal.data.balance import BalanceConfig
from omnibal.errors import InputError
from omnibal.jobs.balance import BalanceJobConfig, run_balance_job
from omnibal.layout import Layout
from test_balance_cli import _write_token_lengths


def test_the_library_call_writes_the_schedule_the_command_line_writes(tmp_path):
    stats = tmp_path / "stats.json"
    _write_token_lengths(stats)
    out, mjson = tmp_path / "cli.json", tmp_path / "m.json"
    assert main(["balance", "--stats", str(stats), "--dp", "4", "--microbatches", "2", "--seed", "3", "--epoch", "1",
                 "--target-samples", "3", "--out", str(out), "--metrics-json", str(mjson), "--quiet"]) == 0
    result = run_balance_job(BalanceJobConfig(stats_path=str(stats), layout=Layout(dp_size=4, num_microbatches=2),
                                              seed=3, epoch=1, balance=BalanceConfig(target_samples=3.0)))
    result.schedule.to_json(tmp_path / "lib.json")
    assert (tmp_path / "lib.json").read_bytes() == out.read_bytes()
    assert json.loads(mjson.read_text()) == json.loads(json.dumps(result.metrics))
    assert (result.schedule.dp_size, result.schedule.num_microbatches, len(result.stats)) == (4, 2, 400)


def test_the_command_lines_layout_is_four_microbatches_and_dp_is_required(tmp_path, capsys):
    stats = tmp_path / "stats.json"
    _write_token_lengths(stats, n=100)
    out = tmp_path / "s.json"
    assert main(["balance", "--stats", str(stats), "--dp", "2", "--out", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())["num_microbatches"] == 4
    assert main(["balance", "--stats", str(stats), "--microbatches", "2", "--quiet"]) == 2
    assert "--dp: field 'dp_size': required" in capsys.readouterr().err
    with pytest.raises(TypeError, match="layout"):  # a library caller names its layout too
        BalanceJobConfig(stats_path=str(stats))


@pytest.mark.parametrize(("args", "named"), [(["--dp", "0"], "--dp: field 'dp_size': must be a positive integer"),
                                             (["--dp", "2", "--microbatches", "0"], "--microbatches"),
                                             (["--dp", "2", "--profile", "p.json"], "--profile: field 'profile_path'"),
                                             (["--dp", "8", "--target-samples", "0.01"], "--target-samples")])
def test_bad_job_settings_are_named_by_their_flags(tmp_path, capsys, args, named):
    stats = tmp_path / "stats.json"
    _write_token_lengths(stats, n=100)
    assert main(["balance", "--stats", str(stats), *args, "--quiet"]) == 2  # --dp 0 was a ZeroDivisionError
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1, err


def test_library_errors_name_the_config_field(tmp_path):
    stats = tmp_path / "stats.json"
    _write_token_lengths(stats, n=100)
    layout = Layout(dp_size=8, num_microbatches=4)
    with pytest.raises(InputError, match="give at least 1 / .* = 0.03125") as err:
        run_balance_job(BalanceJobConfig(stats_path=str(stats), layout=layout,
                                         balance=BalanceConfig(target_samples=0.01)))
    assert (err.value.source, err.value.field) == (None, "target_samples")
    with pytest.raises(InputError, match="a profile describes one model") as err:
        run_balance_job(BalanceJobConfig(stats_path=str(stats), layout=layout, profile_path="p.json"))
    assert err.value.field == "profile_path"
