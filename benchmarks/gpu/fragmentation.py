"""Section 2b of the GPU check: what PyTorch's caching allocator reserves beyond what it hands out when a
stack of LLM blocks trains on a sequence of variable-length packs (omnibal's balanced packs of the embedded
synthetic InternVL mixture, one attention segment per sample).

Per pack: forward + backward of the stack, then the peaks of ``max_memory_allocated`` and
``max_memory_reserved`` since the previous pack. The figure a memory margin must cover is
``reserved / allocated - 1`` at the run's peak. The allocator setting is the process's own
(``PYTORCH_CUDA_ALLOC_CONF``), so the check runs this module once per setting as its own process:

    python -m benchmarks.gpu.fragmentation --json OUT.json [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.gpu.shapes import DRY, FULL, FragmentationConfig
from omnibal.cost.profile import Point
from omnibal.data.balance import balance
from omnibal.measure.runner import LayerRunner
from omnibal.stats.synthetic import synthetic_internvl_mixture


def pack_lengths(cfg: FragmentationConfig) -> list[list[int]]:
    """Sample token lengths of the first ``cfg.packs`` packs omnibal balances from the synthetic mixture."""
    stats = synthetic_internvl_mixture(cfg.samples, seed=0)
    sched = balance(stats, dp_size=8, num_microbatches=4, seed=0)
    packs = []
    for s in range(sched.num_steps):
        for r in range(sched.dp_size):
            for k in range(sched.num_microbatches):
                lengths = [max(1, int(round(t * cfg.scale))) for t in stats.tokens[sched.microbatch(s, r, k)]]
                packs.append(lengths)
                if len(packs) == cfg.packs:
                    return packs
    return packs


def run(cfg: FragmentationConfig, *, device: str, dtype: str) -> dict[str, Any]:
    """Train the stack on the packs; per pack the token count and the allocator's peaks (GPU)."""
    runner = LayerRunner(cfg.spec, device=device, dtype=dtype)
    block = runner.module("llm_block")
    stack = [block] + [type(block)(cfg.spec, runner.opts).to(device=runner.device, dtype=runner.dtype)
                       for _ in range(cfg.blocks - 1)]
    cuda = runner.is_cuda
    rows = []
    for lengths in pack_lengths(cfg):
        carry = runner.carry("llm_block", 0, lengths)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        out = carry
        for layer in stack:
            out = layer(*out)
        out[0].float().square().mean().backward()
        del out, carry
        row: dict[str, Any] = {"tokens": int(sum(lengths)), "samples": len(lengths),
                               "tokens_sq": float(Point("llm_block", 0, tuple(lengths)).features[3])}
        if cuda:
            torch.cuda.synchronize()
            row.update(max_allocated=torch.cuda.max_memory_allocated(), max_reserved=torch.cuda.max_memory_reserved(),
                       reserved=torch.cuda.memory_reserved(), allocated=torch.cuda.memory_allocated())
        rows.append(row)
        for layer in stack:
            layer.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"blocks": cfg.blocks, "model": cfg.spec.name, "packs": rows}
    if cuda:
        peak_alloc = max(r["max_allocated"] for r in rows)
        peak_res = max(r["max_reserved"] for r in rows)
        out.update(peak_allocated=peak_alloc, peak_reserved=peak_res, overhead=peak_res / peak_alloc - 1.0,
                   overhead_per_pack=[r["max_reserved"] / r["max_allocated"] - 1.0 for r in rows],
                   tokens_range=[int(np.min([r["tokens"] for r in rows])), int(np.max([r["tokens"] for r in rows]))])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="result file")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    args = ap.parse_args(argv)
    shapes = DRY if args.dry_run else FULL
    result = run(shapes.fragmentation, device=shapes.device, dtype=shapes.dtype)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
