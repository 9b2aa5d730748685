"""Section 2 of the GPU check: what a layer keeps for its backward, measured, against the memory model.

For every :class:`~benchmarks.gpu.shapes.MemoryCase` (the reference model's layers, and Hugging Face Llava /
InternVL layers wrapped by :mod:`omnibal.train.hf_adapter`), every kind, shape and recompute granularity the
trainer runs (:data:`omnibal.train.recompute.GRANULARITIES`), three figures are recorded beside the model's
prediction (``act_bytes`` / ``sel_act_bytes`` / ``ckpt_bytes`` of
:func:`omnibal.cost.analytic.analytic_cost_table`):

- ``saved_bytes``: what one forward keeps, counted without running the backward
  (:meth:`omnibal.measure.runner.LayerRunner.saved_bytes`: the storages autograd saves, or under
  checkpointing the input plus the outputs selective recompute caches);
- ``kept_bytes`` (GPU): bytes still allocated after the forward, the output excluded, plus the layer's input
  (which the model's figures include): the allocator's view of the same;
- ``peak_bytes`` (GPU): the peak of forward + backward above the level before it (a recomputed layer's
  activations come back for a moment).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from benchmarks.gpu.shapes import CheckShapes, MemoryCase
from omnibal.cost.analytic import analytic_cost_table
from omnibal.cost.hardware import HardwareSpec
from omnibal.cost.profile import Point
from omnibal.examples.real_example import SPECIAL_TOKENS, build_model
from omnibal.measure.runner import LayerRunner
from omnibal.train.recompute import GRANULARITIES


def hf_chain(case: MemoryCase):
    """The Hugging Face model of ``case.hf`` (random init), wrapped as an omnibal chain."""
    from omnibal.train.hf_adapter import from_hf

    ids = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(case.hf, 4096, ids)
    return from_hf(model)


def _shapes(case: MemoryCase, kind: str) -> list[tuple[int, tuple[int, ...]]]:
    if kind.startswith("vision") or kind == "projector":
        return [(t, ()) for t in case.tiles]
    return [(0, tuple([case.segment] * (n // case.segment) + ([n % case.segment] if n % case.segment else [])))
            for n in case.tokens]


def _measure(runner: LayerRunner, kind: str, tiles: int, lengths: tuple[int, ...]) -> dict[str, Any]:
    carry = runner.carry(kind, tiles, list(lengths))
    row: dict[str, Any] = {"saved_bytes": runner.saved_bytes(kind, carry)}
    retained = runner.retained_bytes(kind, carry)
    if retained is not None:
        row["kept_bytes"] = retained + carry[0].untyped_storage().nbytes()
        row["peak_bytes"] = runner.peak_bytes(kind, carry)
    del carry
    if runner.is_cuda:
        torch.cuda.empty_cache()
    return row


def _case_rows(case: MemoryCase, shapes: CheckShapes, hardware: HardwareSpec, log) -> list[dict[str, Any]]:
    chain = hf_chain(case) if case.hf is not None else None
    spec = chain.spec if chain is not None else case.spec
    table = analytic_cost_table(spec, hardware, dtype=shapes.dtype)
    kinds = list(table.kinds)
    rows = []
    for granularity in GRANULARITIES:
        runner = LayerRunner(spec, device=shapes.device, dtype=shapes.dtype, chain=None if chain is None else
                             chain.chain(), granularity=granularity)
        for kind in case.kinds:
            i = kinds.index(kind)
            predicted = {"none": table.act_bytes, "selective": table.sel_act_bytes,
                         "full": table.ckpt_bytes}[granularity][i]
            for tiles, lengths in _shapes(case, kind):
                feats = Point(kind, tiles, lengths).features
                row = {"kind": kind, "granularity": granularity, "tiles": tiles, "tokens": int(sum(lengths)),
                       "segment": case.segment if lengths else 0, "predicted_bytes": float(feats @ predicted),
                       **_measure(runner, kind, tiles, lengths)}
                rows.append(row)
        log(f"memory: {case.label}: granularity {granularity} done")
    return rows


def run_memory(shapes: CheckShapes, hardware: HardwareSpec, log) -> dict[str, Any]:
    """Every memory case; the model's relative error per row where a measurement compares with it."""
    cases = []
    for case in shapes.memory:
        rows = _case_rows(case, shapes, hardware, log)
        for row in rows:
            measured = row["saved_bytes"] if row["granularity"] == "none" else row.get("kept_bytes", row["saved_bytes"])
            if measured:
                row["error"] = row["predicted_bytes"] / measured - 1.0
        errors = [abs(r["error"]) for r in rows if "error" in r]
        cases.append({"label": case.label, "rows": rows,
                      "max_abs_error": float(np.max(errors)) if errors else None})
    return {"granularities": list(GRANULARITIES), "cases": cases}
