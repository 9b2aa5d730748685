"""The GPU check: measure on one accelerator what omnibal's numbers rest on, in one short run.

    bash benchmarks/gpu/run.sh --out DIR            # full: one CUDA device, real model widths, bf16
    bash benchmarks/gpu/run.sh --dry-run --out DIR  # tiny shapes on the CPU: the same code, for CI

Sections, cheapest first; each is timed, and one that fails is recorded with its error while the others run:

1. ``layers``: forward/backward time of InternViT-6B / InternLM2-20B layers and a 7B LLM block against the
   analytic cost model, then the efficiency factors fitted on the first model and checked on the second
   (:mod:`benchmarks.gpu.layer_costs`);
2. ``memory``: what layers keep for the backward at every recompute granularity, against the memory model,
   for the reference model and the Hugging Face adapters (:mod:`benchmarks.gpu.memory`);
3. ``fragmentation``: the caching allocator's reserve over allocation on variable-length packs, default
   and expandable segments (:mod:`benchmarks.gpu.fragmentation`, one process per setting);
4. ``tests``: the test suite's ``gpu``-marked tests;
5. ``end_to_end``: baseline vs omnibal training an InternVL-shaped HF model on one device, measured and
   predicted (:mod:`benchmarks.gpu.end_to_end`).

Writes ``DIR/result.json`` (every figure, the device and versions), ``DIR/result.md`` (tables),
``DIR/profiles.json`` (the fitted layer profiles) and ``DIR/log.txt``, rewritten after every section so an
interrupted run still leaves what it measured. docs/gpu.md says how to read them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import ROOT
from benchmarks.gpu.report import render
from benchmarks.gpu.shapes import DRY, FULL, CheckShapes
from omnibal.cost.hardware import HardwareSpec, get_hardware
from omnibal.errors import InputError

SECTION_NAMES = ("layers", "memory", "fragmentation", "tests", "end_to_end")


def hardware_for(device_name: str, memory_bytes: float) -> HardwareSpec:
    """The datasheet preset of the device the check runs on (the dry run predicts as if on an H100)."""
    name = device_name.upper()
    if "H200" in name:
        return get_hardware("h200")
    if "A100" in name:
        return get_hardware("a100-80g" if memory_bytes > 60 * 2**30 else "a100-40g")
    return get_hardware("h100")


def environment(shapes: CheckShapes) -> dict[str, Any]:
    """The device and the versions the figures come from."""
    from omnibal.train.layers import flash_varlen_kernel

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "varlen_kernel": flash_varlen_kernel(),
                           "git_commit": os.environ.get("OMNIBAL_GIT_COMMIT") or _git_commit(),
                           "cpu_count": os.cpu_count()}
    for pkg in ("transformers", "numpy"):
        try:
            env[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            env[pkg] = None
    if shapes.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), memory_bytes=props.total_memory,
                   multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    else:
        env.update(device=f"CPU ({platform.processor() or platform.machine()})", memory_bytes=None)
    return env


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run_fragmentation(dry: bool, out: Path, log) -> dict[str, Any]:
    """The fragmentation module once per allocator setting, each in its own process."""
    result = {}
    for name, conf in (("default", None), ("expandable_segments", "expandable_segments:True")):
        path = out / f"fragmentation_{name}.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        cmd = [sys.executable, "-m", "benchmarks.gpu.fragmentation", "--json", str(path)]
        cmd += ["--dry-run"] if dry else []
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        result[name] = json.loads(path.read_text())
        log(f"fragmentation: {name} done")
    return result


def run_gpu_tests(dry: bool) -> dict[str, Any]:
    """``pytest -m gpu`` on the device (skipped in the dry run: on a CPU every such test skips)."""
    if dry:
        return {"returncode": None, "summary": "not run in the dry run (no CUDA device)"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), str(ROOT)])}
    files = sorted(str(p) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else "", "output": proc.stdout[-20000:]}


def _sections(shapes: CheckShapes, hardware: HardwareSpec, out: Path, work: Path, dry: bool, log
              ) -> dict[str, Callable[[], dict]]:
    from benchmarks.gpu.end_to_end import run_end_to_end
    from benchmarks.gpu.layer_costs import run_layer_costs
    from benchmarks.gpu.memory import run_memory

    return {"layers": lambda: run_layer_costs(shapes, hardware, log),
            "memory": lambda: run_memory(shapes, hardware, log),
            "fragmentation": lambda: run_fragmentation(dry, work, log),
            "tests": lambda: run_gpu_tests(dry),
            "end_to_end": lambda: run_end_to_end(shapes, work, log)}


def write(doc: dict, out: Path) -> None:
    """result.json, result.md and profiles.json (the layer profiles, kept out of result.json)."""
    profiles = {}
    slim = json.loads(json.dumps(doc, default=float))
    for case in slim["sections"].get("layers", {}).get("cases", []):
        profiles[case["model"]] = case.pop("profile")
    (out / "result.json").write_text(json.dumps(slim, indent=1) + "\n")
    (out / "result.md").write_text(render(slim) + "\n")
    if profiles:
        (out / "profiles.json").write_text(json.dumps(profiles, indent=1) + "\n")


def run_check(out: Path, *, dry: bool, sections: tuple[str, ...] = SECTION_NAMES, budget_s: float = 480.0) -> dict:
    """Run the sections in order into ``out``; a section that would start after ``budget_s`` is skipped."""
    if not dry and not torch.cuda.is_available():
        raise InputError("no CUDA device on this machine: the full GPU check needs one (run it with --dry-run "
                         "on a CPU)", source="benchmarks/gpu/run.sh", field="--dry-run")
    shapes = DRY if dry else FULL
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    logfile = open(out / "log.txt", "a", encoding="utf-8")

    def log(msg: str) -> None:
        line = f"[gpu check {time.perf_counter() - started:6.1f} s] {msg}"
        print(line, file=sys.stderr, flush=True)
        logfile.write(line + "\n")
        logfile.flush()

    env = environment(shapes)
    hardware = hardware_for(env["device"], env.get("memory_bytes") or 0)
    doc: dict[str, Any] = {"dry_run": dry, "environment": env, "sections": {}, "skipped": {}, "seconds": 0.0}
    log(f"device {env['device']}, torch {env['torch']}, hardware preset {hardware.name}")
    with tempfile.TemporaryDirectory(prefix="omnibal-gpu-check-") as tmp:
        for name, fn in _sections(shapes, hardware, out, Path(tmp), dry, log).items():
            if name not in sections:
                continue
            if time.perf_counter() - started > budget_s:
                doc["skipped"][name] = f"over the {budget_s:.0f} s budget"
                continue
            t0 = time.perf_counter()
            log(f"section {name}")
            try:
                result = fn()
            except Exception:  # one failing section must not cost the others' figures
                result = {"error": traceback.format_exc()[-4000:]}
                log(f"section {name} failed: {result['error'].strip().splitlines()[-1]}")
            result["seconds"] = time.perf_counter() - t0
            doc["sections"][name] = result
            doc["seconds"] = time.perf_counter() - started
            write(doc, out)
            if shapes.device == "cuda":
                torch.cuda.empty_cache()
    log(f"done in {doc['seconds']:.0f} s: {out / 'result.md'}")
    logfile.close()
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for result.json, result.md, profiles.json")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (what CI runs)")
    ap.add_argument("--sections", default=",".join(SECTION_NAMES),
                    help=f"comma-separated subset of {','.join(SECTION_NAMES)}")
    ap.add_argument("--budget-s", type=float, default=480.0, help="no section starts after this many seconds")
    args = ap.parse_args(argv)
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = sorted(set(sections) - set(SECTION_NAMES))
    if unknown:
        print(f"error: --sections: unknown {unknown}; known: {', '.join(SECTION_NAMES)}", file=sys.stderr)
        return 2
    try:
        doc = run_check(args.out, dry=args.dry_run, sections=sections, budget_s=args.budget_s)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = [n for n, s in doc["sections"].items() if "error" in s]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
