"""Issue 20: what the commands write and read at the edges -- empty micro-batches, output paths, atomic writes and
file modes, a FIFO where an image should be, a tokenizer without its library.

Promises (docs/guarantees.md, "Error behaviour on bad input" and "Outputs"): a bad output path is an InputError
(exit 2, one line naming the argument) raised before any output is written; every output file is replaced
atomically and gets the mode the umask gives; no schedule has an empty micro-batch; no input makes a command
hang or end in a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from omnibal.cli import main
from omnibal.errors import InputError

ROOT = Path(__file__).resolve().parents[1]


def _stats_file(path: Path, n: int = 120, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    tiles = rng.integers(1, 4, n)
    rows = [{"key": i, "tiles": int(t), "tokens": int(t * 256 + rng.integers(20, 300)), "images": 1}
            for i, t in enumerate(tiles)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _microbatch_sizes(schedule_path: Path) -> list[int]:
    doc = json.loads(schedule_path.read_text())
    return [len(mb) for step in doc["steps"] for rank in step for mb in rank]


# ------------------------------------------------------------------------------------ case 8: empty micro-batches


def test_balance_with_a_target_below_one_sample_writes_no_empty_microbatch(tmp_path):
    """``--target-samples 0.4`` wrote 32 empty micro-batches (exit 0) that failed training at step 0: the
    balancer never makes more micro-batches than samples."""
    stats = _stats_file(tmp_path / "s.jsonl", n=300)
    out = tmp_path / "sched.json"
    assert main(["balance", "--stats", str(stats), "--dp", "4", "--microbatches", "2",
                 "--target-samples", "0.4", "--out", str(out), "--quiet"]) == 0
    sizes = _microbatch_sizes(out)
    assert min(sizes) >= 1 and sum(sizes) == 300


def test_balance_with_every_row_in_its_own_pack_refuses_empty_microbatches(tmp_path, capsys):
    """``--oversize own_pack`` when every row is over the caps: 300 rows cannot fill whole steps of 8
    micro-batches without empty ones; refused with a named error instead of writing empties."""
    stats = _stats_file(tmp_path / "s.jsonl", n=300)
    out = tmp_path / "sched.json"
    rc = main(["balance", "--stats", str(stats), "--dp", "4", "--microbatches", "2", "--max-tiles", "1",
               "--max-tokens", "10", "--oversize", "own_pack", "--out", str(out), "--quiet"])
    assert rc == 2 and not out.exists()
    assert "oversize" in capsys.readouterr().err
    # 296 rows fill 37 steps exactly: accepted, one row per micro-batch
    _stats_file(stats, n=296)
    assert main(["balance", "--stats", str(stats), "--dp", "4", "--microbatches", "2", "--max-tiles", "1",
                 "--max-tokens", "10", "--oversize", "own_pack", "--out", str(out), "--quiet"]) == 0
    assert set(_microbatch_sizes(out)) == {1}


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0"])
def test_balance_target_samples_not_finite_is_a_named_error(tmp_path, capsys, value):
    """``--target-samples inf`` ended in a ValueError traceback."""
    stats = _stats_file(tmp_path / "s.jsonl")
    assert main(["balance", "--stats", str(stats), "--dp", "2", "--target-samples", value, "--quiet"]) == 2
    assert "target_samples" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ case 9: output paths


def _balance(tmp_path, **outs) -> list[str]:
    stats = _stats_file(tmp_path / "s.jsonl")
    args = ["balance", "--stats", str(stats), "--dp", "2", "--quiet"]
    for flag, value in outs.items():
        args += [f"--{flag.replace('_', '-')}", str(value)]
    return args


def test_balance_out_into_a_missing_folder_is_created(tmp_path):
    out = tmp_path / "new" / "deeper" / "sched.json"
    assert main(_balance(tmp_path, out=out)) == 0 and out.is_file()


@pytest.mark.parametrize("flag", ["out", "metrics_json", "plot"])
@pytest.mark.parametrize("how", ["is-a-folder", "under-a-file"])
def test_balance_bad_output_path_fails_before_writing_anything(tmp_path, capsys, flag, how):
    """A bad ``--out``, ``--metrics-json`` or ``--plot`` gave a traceback, several after ``--out`` was
    written; now an InputError naming the argument, and no other output is written."""
    (tmp_path / "afile").write_text("x")
    bad = tmp_path / "afolder" if how == "is-a-folder" else tmp_path / "afile" / "x.png"
    (tmp_path / "afolder").mkdir()
    good = {"out": tmp_path / "o.json", "metrics_json": tmp_path / "m.json", "plot": tmp_path / "p.png"}
    outs = {**good, flag: bad}
    assert main(_balance(tmp_path, **outs)) == 2
    err = capsys.readouterr().err
    assert f"--{flag.replace('_', '-')}" in err and "Traceback" not in err
    assert not any(p.exists() for k, p in good.items() if k != flag)


def test_plot_with_an_unknown_extension_is_refused_up_front(tmp_path, capsys):
    assert main(_balance(tmp_path, out=tmp_path / "o.json", plot=tmp_path / "p.xyz")) == 2
    assert "--plot" in capsys.readouterr().err and not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("flag", ["out", "report", "plot"])
def test_stats_bad_output_path_fails_before_writing_anything(tmp_path, capsys, flag):
    (tmp_path / "afile").write_text("x")
    good = {"out": tmp_path / "o.jsonl", "report": tmp_path / "r.json", "plot": tmp_path / "p.png"}
    outs = {**good, flag: tmp_path / "afile" / "x.json"}
    args = ["stats", "--synthetic", "50", "--quiet"]
    for k, v in outs.items():
        args += [f"--{k}", str(v)]
    assert main(args) == 2
    assert f"--{flag}" in capsys.readouterr().err
    assert not any(p.exists() for k, p in good.items() if k != flag)


def test_stats_out_with_an_unknown_format_is_refused_up_front(tmp_path, capsys):
    assert main(["stats", "--synthetic", "50", "--out", str(tmp_path / "x.txt"), "--report",
                 str(tmp_path / "r.json"), "--quiet"]) == 2
    assert not (tmp_path / "r.json").exists()


def test_simulate_and_report_out_under_a_file_are_named_errors(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["simulate", "--model", "tiny", "--samples", "500", "--dp", "2", "--quiet", "--out",
                 str(tmp_path / "afile" / "r")]) == 2
    assert "--out" in capsys.readouterr().err
    from test_fuzz_plan_json import GOOD_TEXT

    (tmp_path / "plan.json").write_text(GOOD_TEXT)
    assert main(["report", str(tmp_path / "plan.json"), "--out", str(tmp_path / "afile" / "r")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "Traceback" not in err


def test_an_oserror_on_a_path_is_one_line_not_a_traceback(capsys):
    """The net under every command: an OSError about a path (e.g. from a command's own writer) is reported as
    one line naming the path, exit 2."""
    from omnibal.cli import run_reporting_errors

    def fails(_args):
        raise NotADirectoryError(20, "Not a directory", "/x/afile/out")

    assert run_reporting_errors(fails, None, prog="omnibal plan") == 2
    assert "/x/afile/out" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ atomic writes, modes

_WRITER = """
import sys, numpy as np
from omnibal.data.balance import balance
from omnibal.stats.synthetic import synthetic_internvl_mixture
import omnibal.outputs as outputs
real = outputs.atomic_path
def slow_write(path):
    cm = real(path)
    class Slow:
        def __enter__(self):
            self.tmp = cm.__enter__()
            return self.tmp
        def __exit__(self, *exc):
            print("written", flush=True)
            import time; time.sleep(60)  # killed here: the data is in the temporary file, not renamed yet
            return cm.__exit__(*exc)
    return Slow()
outputs.atomic_path = slow_write
balance(synthetic_internvl_mixture(2000, seed=1), dp_size=2, num_microbatches=2).to_json(sys.argv[1])
"""


def test_balance_out_killed_mid_write_leaves_the_previous_file(tmp_path):
    """A SIGKILL while ``omnibal balance --out`` wrote left 8 MB of truncated JSON in place of the good file:
    the schedule is written to a temporary name and renamed, so the old file stays whole."""
    out = _stats_file(tmp_path / "s.jsonl")  # any previous good file
    sched = tmp_path / "sched.json"
    assert main(["balance", "--stats", str(out), "--dp", "2", "--out", str(sched), "--quiet"]) == 0
    before = sched.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(sched)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"written"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    assert sched.read_bytes() == before
    json.loads(sched.read_text())


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_outputs_get_the_mode_the_umask_gives(tmp_path, umask):
    """Files from ``omnibal stats --out`` were 0600 whatever the umask (a mkstemp name renamed into place)."""
    old = os.umask(umask)
    try:
        assert main(["stats", "--synthetic", "30", "--out", str(tmp_path / "s.jsonl"), "--quiet"]) == 0
        assert main(["stats", "--synthetic", "30", "--out", str(tmp_path / "s.parquet"), "--quiet"]) == 0
        assert main(_balance(tmp_path, out=tmp_path / "b.json", metrics_json=tmp_path / "m.json")) == 0
    finally:
        os.umask(old)
    for name in ("s.jsonl", "s.parquet", "b.json", "m.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name


# ------------------------------------------------------------------------------------ case 11: a FIFO as an image

_IMAGE_READERS = {
    "stats": "from omnibal.cli import main; raise SystemExit(main(['stats', sys.argv[1], '--image-root', sys.argv[2], "
             "'--workers', '1', '--quiet']))",
    "image_size": "from omnibal.stats.tiles import image_size\ntry:\n    image_size(sys.argv[2] + '/x.png')\n"
                  "except ValueError as e:\n    print(e); raise SystemExit(2)",
}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("reader", list(_IMAGE_READERS))
def test_a_fifo_as_an_image_is_refused_not_waited_on(tmp_path, reader):
    """A FIFO named like an image hung ``omnibal stats`` (still blocked after 60 s): images are opened without
    blocking, and anything but a regular file is an InputError naming the image and the record."""
    images = tmp_path / "images"
    images.mkdir()
    os.mkfifo(images / "x.png")
    ann = tmp_path / "ann.jsonl"
    ann.write_text(json.dumps({"id": "a", "image": "x.png", "conversations": [
        {"from": "human", "value": "<image>\nq"}, {"from": "gpt", "value": "a"}]}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    t0 = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-c", "import sys\n" + _IMAGE_READERS[reader], str(ann), str(images)],
                              capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("blocked on the FIFO for 60 s")
    assert done.returncode == 2, done.stderr[-2000:]
    text = done.stdout + done.stderr
    assert "x.png" in text and "FIFO" in text and "Traceback" not in text
    assert time.monotonic() - t0 < 60


def test_a_device_or_folder_as_an_image_is_named(tmp_path):
    from omnibal.stats.tiles import image_size

    (tmp_path / "d.png").mkdir()
    for path, kind in ((tmp_path / "d.png", "folder"), (Path("/dev/zero"), "device")):
        with pytest.raises(InputError, match=kind) as err:
            image_size(path, source="ann.jsonl", record="line 1")
        assert err.value.record == "line 1" and err.value.field == "image"


# ------------------------------------------------------------------------------------ case 13: tokenizer library


def test_tokenizer_without_the_hf_extra_names_the_extra(tmp_path, monkeypatch):
    """``omnibal stats --tokenizer`` with the README's plain install failed with ModuleNotFoundError: tokenizers.
    Now an InputError that names the ``[hf]`` extra (and the README says ``--tokenizer`` needs it)."""
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    from omnibal.stats.tokens import make_counter

    tok = ROOT / "src" / "omnibal" / "examples" / "tokenizer.json"
    with pytest.raises(InputError, match=r"omnibal\[hf\]") as err:
        make_counter(tok)
    assert err.value.field == "tokenizer"
    readme = (ROOT / "README.md").read_text()
    assert any("--tokenizer" in line and ".[hf]" in line for line in readme.splitlines())


def test_plan_out_under_a_file_fails_before_planning(tmp_path, capsys):
    """`omnibal plan --out FILE/x` is refused by name before the job runs (issue 20 case 9)."""
    import time

    from omnibal.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    t0 = time.perf_counter()
    assert main(["plan", "--out", str(blocker / "out"), "--quiet"]) == 2
    assert time.perf_counter() - t0 < 2.0  # the default job takes several seconds: it never started
    err = capsys.readouterr().err.strip()
    assert "--out" in err and "a-file" in err and "\n" not in err
