"""What a person running ``omnibal train`` reads (issue 37, item 5): a start line, loss lines where stdout is a
log rather than a terminal, checkpoint and "saved" lines and the summary on stdout; Ctrl-C as one line and
exit 130; a failed run whose first stderr line is the cause; a folder of an earlier run refused rather than
silently overwritten, so the ledger never holds a sample twice for one run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from dist_helpers import rank_pids
from omnibal.cli import main
from omnibal.train.distributed import PeerFailure, RankResult, root_causes_first

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def stats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("train-output") / "s.jsonl"
    assert main(["stats", "--synthetic", "200", "--out", str(path), "--quiet"]) == 0
    return path


@pytest.fixture(scope="module")
def long_stats(tmp_path_factory) -> Path:
    """An epoch of thousands of steps: a run signalled after its first step is still training then."""
    path = tmp_path_factory.mktemp("train-output-long") / "s.jsonl"
    assert main(["stats", "--synthetic", "20000", "--out", str(path), "--quiet"]) == 0
    return path


def test_a_run_says_what_it_trains_its_loss_what_it_saved_and_its_summary_on_stdout(stats, tmp_path, capsys):
    """Only the final loss reached a log file (the bar needs a terminal), nothing said where the outputs went, and
    the summary went to stderr."""
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    assert main(["train", "--stats", str(stats), "--steps", "5", "--microbatches", "1", "--print-every", "2",
                 "--checkpoint-dir", str(ck), "--checkpoint-every", "4", "--metrics-log", str(log)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert err == "", err
    assert lines[0].startswith(f"omnibal train: offline mode, model tiny, data {stats}, dp 1 x pp 1 on cpu")
    assert lines[1].startswith("omnibal train: training steps 1-5 of the ")
    steps = [int(x.split()[1].split("/")[0]) for x in lines if x.startswith("step ")]
    assert steps == [1, 2, 4, 5], lines  # the first, every 2nd, the last
    assert all(" loss " in x and "s/step" in x for x in lines if x.startswith("step "))
    assert f"omnibal train: checkpoint of step 4 saved to {ck / 'step_00000004'}" in lines
    assert any(x.startswith("## offline dp1 x pp1") for x in lines)
    assert lines[-1] == f"omnibal train: saved checkpoint {ck / 'step_00000005'}, metrics {log}"
    assert main(["train", "--stats", str(stats), "--steps", "2", "--microbatches", "1", "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")


def test_an_earlier_runs_checkpoints_and_ledger_are_refused_without_resume(stats, tmp_path, capsys):
    """A rerun without --resume on a folder with checkpoints started over, overwrote them and appended the same
    samples to --ledger again."""
    ck, ledger = tmp_path / "ck", tmp_path / "ledger.jsonl"
    args = ["train", "--stats", str(stats), "--microbatches", "1", "--quiet", "--checkpoint-every", "1",
            "--ledger", str(ledger)]
    assert main([*args, "--steps", "2", "--checkpoint-dir", str(ck)]) == 0
    before = ledger.read_bytes()
    assert main([*args, "--steps", "4", "--checkpoint-dir", str(ck)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(ck) in err and "--checkpoint-dir" in err and "--resume" in err, err
    assert main([*args, "--steps", "4", "--checkpoint-dir", str(tmp_path / "other")]) == 2  # same ledger
    err = capsys.readouterr().err
    assert str(ledger) in err and "--ledger" in err and "2 steps" in err, err
    assert ledger.read_bytes() == before and sorted(p.name for p in ck.iterdir()) == ["step_00000001",
                                                                                      "step_00000002"]
    assert main([*args, "--steps", "4", "--checkpoint-dir", str(ck), "--resume"]) == 0
    keys = Counter(k for line in ledger.read_text().splitlines() if (e := json.loads(line))["event"] == "step"
                   for k in e["keys"])
    assert keys and set(keys.values()) == {1}  # one run, resumed once: every sample once in the file itself


def test_failures_are_reported_cause_first():
    peer = RankResult(0, 1, PeerFailure("rank 0 (dp 0/2, pp 0/1): step 3 failed: a peer rank died"))
    killed = RankResult(1, -9, failure="rank 1 was killed by SIGKILL")
    fine = RankResult(2, 0)
    assert [r.rank for r in root_causes_first([peer, killed, fine])] == [1, 0]


def _default_sigint() -> None:
    """A terminal's Ctrl-C disposition for the child: a test run started in the background by a
    non-interactive shell inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_dp2(stats: Path, *extra: str) -> subprocess.Popen:
    """``omnibal train --dp 2`` in its own session (a terminal's Ctrl-C reaches the whole process group), stdout
    read until its first step line."""
    proc = subprocess.Popen([sys.executable, "-m", "omnibal", "train", "--stats", str(stats), "--dp", "2",
                             "--steps", "0", "--microbatches", "1", *extra], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_default_sigint)
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        if line.startswith("step ") or time.monotonic() > deadline:
            break
    assert proc.poll() is None, proc.stderr.read()
    return proc


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the ranks")
def test_ctrl_c_is_one_line_and_exit_130(long_stats):
    """Ctrl-C printed two KeyboardInterrupt tracebacks (64 lines), one per rank."""
    proc = _start_dp2(long_stats)
    ranks = rank_pids(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 130 and err == "omnibal train: interrupted\n", (proc.returncode, err)
    assert len(ranks) == 2 and not [r for r in ranks if Path(f"/proc/{r}").exists()
                                    and "Z" not in Path(f"/proc/{r}/stat").read_text().split()[2]]


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the ranks")
def test_a_killed_peer_is_the_first_line(long_stats):
    """The surviving rank's 30-line traceback came first and the cause last."""
    proc = _start_dp2(long_stats, "--timeout", "5")
    try:
        os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    lines = err.splitlines()
    assert proc.returncode == 1 and lines[0].startswith("omnibal train: rank 1 was killed by SIGKILL"), err
    assert len(lines) == 2 and lines[1].startswith("omnibal train: rank 0 (dp 0/2, pp 0/1): "), err
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_peers_bad_image_is_the_first_line_with_rank_file_and_record(tmp_path):
    """A truncated image on one rank: the other rank's 30-line traceback came first, ``image file is truncated``
    on the last line."""
    pytest.importorskip("transformers")
    from omnibal.examples.real_example import make_real_example

    make_real_example(tmp_path, num_records=48, seed=0)
    image = tmp_path / "images" / json.loads((tmp_path / "annotations.jsonl").read_text().splitlines()[0])["image"]
    data = image.read_bytes()
    image.write_bytes(data[: len(data) * 6 // 10])  # the header stays readable: statistics pass, decoding fails
    proc = subprocess.run([sys.executable, "-m", "omnibal", "train", "--annotations",
                           str(tmp_path / "annotations.jsonl"), "--image-root", str(tmp_path / "images"),
                           "--tokenizer", str(tmp_path / "tokenizer"), "--hf-model", str(tmp_path / "llava"),
                           "--dp", "2", "--microbatches", "1", "--steps", "0", "--timeout", "10"], env=ENV,
                          capture_output=True, text=True, timeout=600)
    first = proc.stderr.splitlines()[0]
    assert proc.returncode == 2, proc.stderr  # the cause is bad input
    assert first.startswith("omnibal train: rank ") and f"{tmp_path / 'annotations.jsonl'}: line 1: " in first, first
    assert f"unreadable image {image}: image file is truncated" in first, first
    assert "Traceback" not in proc.stderr
