"""Section 3 of the GPU check: one device trains a random-init InternVL-shaped Hugging Face model on the real
example (rendered charts and pages, replicated), through the real command line, baseline vs offline (omnibal's
balanced packs):

- baseline: ``omnibal train --mode baseline``: random micro-batches of ``batch_size`` samples padded to their
  longest, every block recomputed (InternVL's fine-tuning defaults);
- offline: ``omnibal train --mode offline``: the balancer's packs, varlen attention, no recompute.

Each mode trains one whole epoch (every sample once) with ``--precision bf16-mixed`` on a GPU. Reported per
mode: samples/s and tokens/s over the steps after the first, the token padding, and where the step's time
went (data loading, compute, optimizer). Then the simulator predicts both from a profile of this model's own
layers measured on the device (:class:`omnibal.measure.runner.LayerRunner` over the wrapped chain, fitted,
:func:`omnibal.cost.profile.cost_table_from_profile`) and exactly the schedules the runs trained.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.cpu_runs import step_features
from benchmarks.gpu.shapes import CheckShapes, EndToEndConfig
from benchmarks.trainer_runs import run_train
from omnibal.cli.train import add_arguments, train_config
from omnibal.cost.profile import FORMAT, cost_table_from_profile, fit_profile, grid_points
from omnibal.cost.spec import LAYER_KINDS
from omnibal.cost.table import RECOMPUTE_FULL, RECOMPUTE_SELECTIVE
from omnibal.examples.real_example import make_real_example, save_model
from omnibal.measure.profile import measure_points
from omnibal.sim import SimConfig, simulate_epoch
from omnibal.train import run as train_run

MODES = ("baseline", "offline")


def prepare(root: Path, cfg: EndToEndConfig, log) -> dict[str, Path]:
    """The example (``cfg.records`` records, annotations repeated ``cfg.replicas`` times under new ids) and
    the random-init checkpoint of ``cfg.model`` with the example's tokenizer."""
    from transformers import AutoTokenizer  # the hf extra

    example = root / "example"
    make_real_example(example, num_records=cfg.records, seed=0)
    records = [json.loads(line) for line in (example / "annotations.jsonl").read_text().splitlines()]
    annotations = example / f"annotations_x{cfg.replicas}.jsonl"
    with open(annotations, "w", encoding="utf-8") as f:
        for j in range(cfg.replicas):
            for rec in records:
                f.write(json.dumps({**rec, "id": f"{rec['id']}-r{j}"}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(example / "tokenizer"), local_files_only=True)
    params = save_model(cfg.model, tokenizer, root / "model", seed=0)
    log(f"end to end: {len(records) * cfg.replicas} samples, model of {params / 1e9:.2f}B parameters")
    return {"annotations": annotations, "images": example / "images", "tokenizer": example / "tokenizer",
            "model": root / "model", "params": params}


def train_args(paths: dict, cfg: EndToEndConfig, shapes: CheckShapes, mode: str) -> list[str]:
    return ["--annotations", str(paths["annotations"]), "--image-root", str(paths["images"]),
            "--tokenizer", str(paths["tokenizer"]), "--hf-model", str(paths["model"]),
            "--max-tiles", str(cfg.max_tiles), "--device", shapes.device, "--precision", shapes.precision,
            "--microbatches", str(cfg.microbatches), "--batch-size", str(cfg.batch_size), "--mode", mode,
            "--steps", "0", "--timeout", "600"]


def _measured(doc: dict) -> dict[str, Any]:
    s = doc["summary"]
    rank = s["per_rank"][0]
    keys = ("data_s", "compute_s", "optim_s", "dp_sync_s", "wait_s", "step_s", "peak_mem_bytes")
    compute = (rank["compute_s"] or 0.0) / max(rank["step_s"], 1e-12)
    return {"steps": s["steps"], "samples_per_s": s["samples_per_s"], "tokens_per_s": s["tokens_per_s"],
            "compute_samples_per_s": s["samples_per_s"] / compute if compute else None,
            "token_pad_ratio": s["token_pad_ratio"], "final_loss": s["final_loss"], "wall_s": doc["wall_s"],
            "recompute": doc["recompute"], "selective": doc.get("selective", []),
            **{k: rank.get(k) for k in keys}}


def _chain_profile(chain, cfg: EndToEndConfig, shapes: CheckShapes) -> dict[str, Any]:
    """This model's layers timed on the device as the runs execute them (fp32 weights under autocast on a
    GPU), fitted into a profile."""
    from omnibal.measure.runner import LayerRunner

    spec = chain.spec
    points = grid_points(cfg.profile_grid, spec, LAYER_KINDS)
    runner = LayerRunner(spec, device=shapes.device, dtype=shapes.dtype, chain=chain.chain(),
                         autocast=shapes.precision == "bf16-mixed")
    rows = measure_points(spec, points, device=shapes.device, dtype=shapes.dtype, warmup=shapes.warmup,
                          repeats=shapes.repeats, runner=runner)
    return {"format": FORMAT, "model": {"name": spec.name, "fingerprint": spec.fingerprint(), "spec": spec.to_dict()},
            "dtype": shapes.dtype, "measurements": rows, "fit": fit_profile(rows)}


def predict(paths: dict, cfg: EndToEndConfig, shapes: CheckShapes, measured: dict[str, dict], log) -> dict:
    """The simulator's samples/s of each mode over the steps the summary counts (all but the first)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    tcfg = train_config(parser.parse_args(train_args(paths, cfg, shapes, "offline")))
    chain = train_run.build_model(tcfg)
    stats, _ = train_run.build_data(tcfg, chain)
    profile = _chain_profile(chain, cfg, shapes)
    table = cost_table_from_profile(chain.spec, profile)
    log(f"end to end: profiled {len(profile['measurements'])} shapes of the model's layers")
    out = {"profile_fit": profile["fit"]}
    for mode in MODES:
        schedule = train_run.build_schedule(replace(tcfg, mode=mode), stats)
        feats = step_features(schedule, stats, schedule.num_steps, padded=mode == "baseline")[1:]
        whole = {name for stage in measured[mode]["recompute"] for name in stage}
        sel = {name for stage in measured[mode]["selective"] for name in stage}
        mask = np.array([RECOMPUTE_FULL if n in whole else RECOMPUTE_SELECTIVE if n in sel else 0
                         for n in table.names], dtype=np.int8)
        res = simulate_epoch(table, np.array([0, table.num_layers]), mask, feats, SimConfig(dp_size=1, zero_stage=0))
        samples = sum(len(schedule.microbatch(s, 0, k)) for s in range(1, schedule.num_steps)
                      for k in range(schedule.num_microbatches))
        tokens = float(feats[..., 2].sum())
        total = float(np.sum(res.step_time))
        out[mode] = {"samples_per_s": samples / total, "step_s": total / max(1, len(feats)),
                     "computed_tokens": tokens}
    return out


def run_end_to_end(shapes: CheckShapes, root: Path, log) -> dict[str, Any]:
    """Prepare, train both modes, predict both; the section's result."""
    cfg = shapes.end_to_end
    paths = prepare(root, cfg, log)
    measured = {}
    for mode in MODES:
        log(f"end to end: training {mode}")
        doc = run_train(train_args(paths, cfg, shapes, mode), root, mode, timeout_s=1800)
        measured[mode] = _measured(doc)
        log(f"end to end: {mode} {measured[mode]['samples_per_s']:.2f} samples/s")
    if shapes.device == "cuda":
        torch.cuda.empty_cache()
    predicted = predict(paths, cfg, shapes, measured, log)
    speedup = measured["offline"]["samples_per_s"] / measured["baseline"]["samples_per_s"]
    speedup_pred = predicted["offline"]["samples_per_s"] / predicted["baseline"]["samples_per_s"]
    return {"params": paths["params"], "samples": cfg.records * cfg.replicas, "measured": measured,
            "predicted": predicted, "speedup": speedup, "speedup_predicted": speedup_pred}
