"""A plan's outputs are one unit (issue 37, item 6): written into a temporary folder and swapped in whole, so an
interrupted ``omnibal plan`` leaves the earlier plan as it was and no file of an earlier run stays beside a new
one (``omnibal.outputs.staged_dir``)."""

from __future__ import annotations

import os

import pytest

from omnibal.cli import main
from omnibal.errors import InputError
from omnibal.outputs import check_replaceable_dir, staged_dir

PLAN = ["plan", "--model", "tiny", "--samples", "2000", "--gpus", "8", "--pp", "2", "--pack-microbatches", "none",
        "--search-steps", "16", "--quiet"]


def _snapshot(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_staged_folder_replaces_the_old_one_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    with staged_dir(out) as tmp:
        (tmp / "a.txt").write_text("1")
        (tmp / "old.png").write_text("x")
    assert _snapshot(out) == {"a.txt": b"1", "old.png": b"x"}
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())
    with pytest.raises(KeyboardInterrupt):
        with staged_dir(out) as tmp:
            (tmp / "a.txt").write_text("2")
            raise KeyboardInterrupt
    assert _snapshot(out) == {"a.txt": b"1", "old.png": b"x"}
    with staged_dir(out) as tmp:
        (tmp / "a.txt").write_text("3")
    assert _snapshot(out) == {"a.txt": b"3"}  # old.png was the earlier run's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folder left beside it


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_folder_with_other_files_or_the_working_folder_is_refused(tmp_path, monkeypatch):
    (tmp_path / "mine.txt").write_text("keep")
    (tmp_path / "plan.json").write_text("{}")
    with pytest.raises(InputError) as exc:
        check_replaceable_dir(tmp_path, "--out", ("plan.json", "*.png"))
    assert exc.value.field == "--out" and "mine.txt" in exc.value.message
    (tmp_path / "mine.txt").unlink()
    assert check_replaceable_dir(tmp_path, "--out", ("plan.json", "*.png")) == tmp_path
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="working folder"):
        check_replaceable_dir(".", "--out", ("plan.json", "*.png"))


def test_a_second_plan_leaves_no_file_of_the_first_and_report_embeds_only_its_own(tmp_path, capsys):
    """A second ``plan --out D`` left the first run's timelines in D, and ``report D`` embedded them."""
    out = tmp_path / "plan"
    assert main([*PLAN, "--out", str(out)]) == 0
    assert any(p.name.startswith("timeline_") for p in out.iterdir())
    assert main([*PLAN, "--no-timelines", "--out", str(out)]) == 0
    assert not [p.name for p in out.iterdir() if p.name.startswith("timeline_")]
    assert "wrote " + str(out / "plan.json") in capsys.readouterr().out  # the final paths, not the staged ones
    (out / "timeline_0_baseline.png").write_bytes(b"not this plan's")  # e.g. copied in by hand
    (out / "timeline_9_other.png").write_bytes(b"not this plan's")
    assert main(["report", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "timeline_9_other" not in report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def test_an_interrupted_plan_leaves_the_earlier_one_untouched(tmp_path, monkeypatch, capsys):
    """Ctrl-C during ``omnibal plan`` left a new plan.json beside the old report and exports."""
    from omnibal.cli import plan as cli_plan

    out = tmp_path / "plan"
    assert main([*PLAN, "--no-timelines", "--out", str(out)]) == 0
    before = _snapshot(out)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_plan, "write_engine_exports", interrupted)  # after plan.json and the report
    assert main([*PLAN, "--seed", "1", "--out", str(out)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "omnibal plan: interrupted"
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]
    (out / "notes.txt").write_text("mine")
    assert main([*PLAN, "--out", str(out)]) == 2  # refused before planning, never removed
    assert "notes.txt" in capsys.readouterr().err and (out / "notes.txt").read_text() == "mine"


def test_report_reads_the_trainers_own_metrics_log(tmp_path, capsys):
    """``report --train`` looked for ``step_time_s``; ``omnibal train --metrics-log`` writes ``step_s``."""
    import json

    out = tmp_path / "plan"
    assert main([*PLAN, "--no-timelines", "--out", str(out)]) == 0
    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps({"run": {"mode": "offline"}}) + "\n" +
                   "".join(json.dumps({"step": i, "step_s": 0.5 + i}) + "\n" for i in range(3)))
    assert main(["report", str(out), "--train", str(log)]) == 0
    assert "3 steps, median 1.5000 s" in (out / "report.md").read_text()
