"""The GPU check kit (benchmarks/gpu): its dry run on the CPU goes through every section's code with tiny
shapes, so the full run on a lent accelerator never finds it rotten; the full mode refuses a CPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "gpu" / "run.sh"


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(RUN), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_dry_run_measures_every_section(tmp_path):
    proc = _run("--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "result.json").read_text())
    assert doc["dry_run"] and set(doc["sections"]) == {"layers", "memory", "fragmentation", "tests", "end_to_end"}
    assert not [name for name, sec in doc["sections"].items() if "error" in sec]
    layers = doc["sections"]["layers"]
    assert [c["calibrated_on"] for c in layers["cases"]] == [True, False]
    assert all(p["fwd_ms"] > 0 and p["fwd_pred_ms"] > 0 for c in layers["cases"] for p in c["points"])
    profiles = json.loads((tmp_path / "profiles.json").read_text())
    assert {c["model"] for c in layers["cases"]} == set(profiles)
    assert all(p["fit"] and p["measurements"] for p in profiles.values())
    memory = doc["sections"]["memory"]
    assert len(memory["cases"]) == 3  # reference layers, HF InternVL, HF Llava
    for case in memory["cases"]:
        assert {r["granularity"] for r in case["rows"]} == {"none", "selective", "full"}
        assert all(r["saved_bytes"] > 0 and "error" in r for r in case["rows"])
        sel = [abs(r["error"]) for r in case["rows"] if r["granularity"] == "selective"]
        assert max(sel) <= 0.1, case["label"]  # the memory model of selective recompute, checked on the CPU too
    frag = doc["sections"]["fragmentation"]
    assert set(frag) >= {"default", "expandable_segments"} and len(frag["default"]["packs"]) == 4
    e2e = doc["sections"]["end_to_end"]
    for mode in ("baseline", "offline"):
        assert e2e["measured"][mode]["samples_per_s"] > 0 and e2e["predicted"][mode]["samples_per_s"] > 0
    assert e2e["measured"]["offline"]["token_pad_ratio"] == 0 < e2e["measured"]["baseline"]["token_pad_ratio"]
    md = (tmp_path / "result.md").read_text()
    assert "# GPU check (dry run, CPU)" in md and "offline (balanced) over baseline" in md and "failed" not in md


def test_full_mode_refuses_a_machine_without_cuda(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    proc = _run("--out", str(tmp_path), "--sections", "layers", timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr


def test_unknown_section_is_refused(tmp_path):
    proc = _run("--dry-run", "--out", str(tmp_path), "--sections", "layers,warp", timeout=120)
    assert proc.returncode == 2 and "warp" in proc.stderr
