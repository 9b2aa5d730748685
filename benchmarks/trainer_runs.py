"""Runs of ``omnibal train`` through the real command line (local gloo ranks), shared by the trainer
benchmarks: one run with its summary, and the Hugging Face InternVL checkpoint + real example that the HF
benchmarks train on."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, load_1min, logger
from omnibal.examples.real_example import INTERNVL, make_real_example, save_model

MICROBATCHES = 4
"""Micro-batches per step of the HF benchmarks."""


def run_train(args: list[str], out_dir: Path, tag: str, *, metrics_log: bool = False,
              timeout_s: float = 3600) -> dict:
    """``omnibal train ARGS`` (one torch/OpenMP thread per rank); its ``--summary-json`` with the run's wall
    seconds and the load average before and after (``load_before``, ``load_after``, ``load``)."""
    summary = out_dir / f"{tag}.summary.json"
    cmd = [sys.executable, "-m", "omnibal", "train", *args, "--summary-json", str(summary), "--quiet"]
    if metrics_log:
        cmd += ["--log", str(out_dir / f"{tag}.jsonl")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    load_before = load_1min()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    doc = json.loads(summary.read_text())
    load_after = load_1min()
    doc.update(wall_s=wall, load_before=load_before, load_after=load_after, load=[load_before, load_after])
    return doc


def make_model(root: Path, *, seed: int) -> Path:
    """The HF benchmarks' InternVL checkpoint (the example's builder, wider and deeper than its test model)."""
    from transformers import AutoTokenizer  # heavy optional dependency (the hf extra)

    spec = replace(INTERNVL, vision_hidden=160, vision_layers=4, text_hidden=192, text_layers=4)
    folder = root / "internvl-bench"
    tok = AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
    save_model(spec, tok, folder, seed=seed)
    return folder


def data_args(root: Path, model: Path) -> list[str]:
    """``omnibal train`` arguments for the real example in ``root`` and the checkpoint ``model``."""
    return ["--annotations", str(root / "annotations.jsonl"), "--image-root", str(root / "images"),
            "--tokenizer", str(root / "tokenizer"), "--hf-model", str(model), "--max-tiles", "6"]


def prepare(argv, *, name: str, description: str):
    """Arguments, log function, work folder with the example, and the benchmark's checkpoint: what every
    benchmark on the real example starts with (bench_train_hf, bench_online_hf)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix=f"{name.replace('_', '-')}-"))
    make_real_example(work, num_records=args.records, seed=0)
    return args, logger(name), work, make_model(work, seed=0)
