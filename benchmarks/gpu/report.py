"""The GPU check's markdown: one table per section, from the result document alone (``check.py`` writes both;
``python -m benchmarks.gpu.report RESULT.json`` rewrites the markdown of a stored result)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from omnibal.tables import markdown_table

MiB = float(1 << 20)
GiB = float(1 << 30)


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _abs_pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _section_error(doc: dict, name: str) -> str | None:
    sec = doc["sections"].get(name)
    if sec is None:
        return f"not run ({doc.get('skipped', {}).get(name, 'not selected')})"
    if "error" in sec:
        return f"failed after {sec.get('seconds', 0):.0f} s: `{sec['error'].strip().splitlines()[-1]}`"
    return None


def _layers(sec: dict) -> list[str]:
    eff = ("eff_matmul", "eff_attention", "eff_memory", "layer_overhead_s")
    hw, cal = sec["hardware"], sec["calibrated"]
    out = [f"Analytic model on the `{hw['name']}` preset; efficiencies fitted on the calibration case:", "",
           markdown_table([["factor", "preset", "fitted"]] + [[k, f"{hw[k]:.3g}", f"{cal[k]:.3g}"] for k in eff]), ""]
    rows = [["case", "kind", "points", "fwd+bwd ms (measured)", "step error before", "step error after",
             "act bytes error"]]
    for case in sec["cases"]:
        for kind, before in case["errors_before"].items():
            pts = [p for p in case["points"] if p["kind"] == kind]
            ms = [p["fwd_ms"] + p["bwd_ms"] for p in pts]
            after = case["errors_after"][kind]
            rows.append([case["label"] + ("" if case["calibrated_on"] else " (held out)"), kind, str(len(pts)),
                         f"{min(ms):.2f}-{max(ms):.2f}", f"{_abs_pct(before.get('step_mean_abs'))} "
                         f"(bias {_pct(before.get('step_bias'))})", f"{_abs_pct(after.get('step_mean_abs'))} "
                         f"(bias {_pct(after.get('step_bias'))})", _pct(before.get("act_bias"))])
    return out + [markdown_table(rows), ""]


def _memory(sec: dict) -> list[str]:
    out = []
    for case in sec["cases"]:
        rows = [["kind", "granularity", "tiles", "tokens", "predicted MiB", "saved MiB (autograd)", "kept MiB",
                 "peak MiB", "error"]]
        for r in case["rows"]:
            rows.append([r["kind"], r["granularity"], str(r["tiles"]), str(r["tokens"]),
                         f"{r['predicted_bytes'] / MiB:.1f}", f"{r['saved_bytes'] / MiB:.1f}",
                         "n/a" if r.get("kept_bytes") is None else f"{r['kept_bytes'] / MiB:.1f}",
                         "n/a" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / MiB:.1f}",
                         _pct(r.get("error"))])
        out += [f"**{case['label']}** (max |error| {_abs_pct(case['max_abs_error'])})", "", markdown_table(rows), ""]
    return out


def _fragmentation(sec: dict) -> list[str]:
    rows = [["allocator", "packs", "tokens per pack", "peak allocated GiB", "peak reserved GiB",
             "reserved over allocated"]]
    for name, r in sec.items():
        if not isinstance(r, dict) or "packs" not in r:
            continue
        if "peak_allocated" not in r:
            rows.append([name, str(len(r["packs"])), "", "n/a (CPU)", "n/a", "n/a"])
            continue
        lo, hi = r["tokens_range"]
        rows.append([name, str(len(r["packs"])), f"{lo}-{hi}", f"{r['peak_allocated'] / GiB:.2f}",
                     f"{r['peak_reserved'] / GiB:.2f}", f"{r['overhead']:.1%}"])
    return [markdown_table(rows), ""]


def _end_to_end(sec: dict) -> list[str]:
    rows = [["mode", "samples/s (wall)", "samples/s (compute only)", "predicted", "error vs compute", "tokens/s",
             "token pad", "s/step: data", "compute", "optimizer", "peak GiB"]]
    for mode in sec["measured"]:  # baseline first, then the balanced run (offline mode)
        m, p = sec["measured"][mode], sec["predicted"][mode]
        peak, comp = m.get("peak_mem_bytes"), m.get("compute_samples_per_s")
        rows.append([mode, f"{m['samples_per_s']:.2f}", "n/a" if not comp else f"{comp:.2f}",
                     f"{p['samples_per_s']:.2f}", _pct(p["samples_per_s"] / comp - 1 if comp else None),
                     f"{m['tokens_per_s']:.0f}", f"{m['token_pad_ratio']:.1%}", f"{m['data_s']:.3f}",
                     f"{m['compute_s']:.3f}", f"{m['optim_s']:.3f}", "n/a" if not peak else f"{peak / GiB:.1f}"])
    return [f"{sec['samples']} samples, a {sec['params'] / 1e9:.2f}B-parameter model; "
            "offline (balanced) over baseline: "
            f"**{sec['speedup']:.2f}x** measured, {sec['speedup_predicted']:.2f}x predicted.", "",
            markdown_table(rows), ""]


def _tests(sec: dict) -> list[str]:
    return [f"`pytest -m gpu`: exit {sec['returncode']}; {sec['summary']}", ""]


SECTIONS = {"layers": ("Layer costs", _layers), "memory": ("Memory per layer and granularity", _memory),
            "fragmentation": ("Caching allocator on variable-length packs", _fragmentation),
            "end_to_end": ("End to end on one device", _end_to_end), "tests": ("GPU tests", _tests)}


def render(doc: dict[str, Any]) -> str:
    env = doc["environment"]
    lines = [f"# GPU check ({'dry run, CPU' if doc['dry_run'] else 'full'})", "",
             f"Device: {env['device']}; torch {env['torch']}, CUDA {env.get('cuda')}, transformers "
             f"{env.get('transformers')}, varlen attention kernel `{env.get('varlen_kernel')}`; git "
             f"{env.get('git_commit')}; {doc['seconds']:.0f} s in all.", ""]
    for name, (title, fmt) in SECTIONS.items():
        lines += [f"## {title}", ""]
        problem = _section_error(doc, name)
        if problem:
            lines += [problem, ""]
            continue
        sec = doc["sections"][name]
        lines += fmt(sec) + [f"({sec['seconds']:.0f} s)", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    path = Path((argv or sys.argv[1:])[0])
    doc = json.loads(path.read_text())
    path.with_suffix(".md").write_text(render(doc) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
