"""``omnibal plan --verify K``: run the top-K candidate plans (partition x recompute) in the reference trainer
for a few steps each, choose the plan by measurement, and report predicted vs measured per candidate.

The OmniBal paper picks its partition by measuring candidates; the planner picks by the simulator. This module
does the measuring: each candidate runs in ``omnibal.train`` (``train_rank`` on ``dp x pp`` local processes,
gloo on CPU, NCCL when CUDA devices are present) on the planned job's own balanced schedule and statistics,
one warm-up step and ``steps`` timed steps. The prediction it is compared with is the simulator's for exactly
those steps (the same micro-batches; p2p at the fixed buffer shape the trainer sends).

Only models the trainer can run on this machine can be verified: the ``tiny`` preset (or another preset on
CUDA devices), one rank per process, no tensor parallelism, and on CPU no more ranks (DP x PP) than the
process may use cores: a larger world is refused with both numbers rather than shrunk, since a plan for
another world is another plan. On CPU the plan must be made for this machine
(``--hardware cpu``, ideally with a ``--profile`` measured here), or predicted and measured times describe
different machines: both are InputErrors naming the option.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from omnibal.errors import InputError
from omnibal.tables import markdown_table

CPU_MODELS = ("tiny",)
"""Presets the reference trainer runs on CPU in seconds per step."""


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """How candidates are measured."""

    top_k: int
    """Candidates measured: the simulator's best ``top_k`` (memory-fitting) ones."""
    steps: int = 3
    """Timed steps per candidate (after one warm-up step)."""
    device: str = "auto"
    """``cpu`` (gloo processes, one torch thread each), ``cuda`` (one GPU per rank) or ``auto`` (cuda when
    enough devices are present)."""
    timeout_s: float = 900.0
    """Wall-clock limit of one candidate's run."""


@dataclass(frozen=True, kw_only=True)
class CandidateMeasurement:
    """One measured candidate."""

    parts: tuple[int, ...]
    """Stage cut points."""
    recompute: tuple[tuple[str, ...], ...]
    """Per stage, the recomputed layers."""
    search_step_s: float
    """The simulator's mean step on the search's sampled steps (how the planner ranked it)."""
    predicted_step_s: float
    """The simulator's mean step over exactly the measured steps."""
    measured_step_s: float
    """The trainer's mean wall-clock step over the timed steps."""
    slowdown: float = 1.0
    """The ranks' busy wall time (compute + optimizer + data) over their own CPU time: > 1 when other jobs held
    the cores (CPU runs; 1.0 on CUDA, where the host's CPU time says nothing about the device)."""

    @property
    def normalised_step_s(self) -> float:
        """The measured step divided by :attr:`slowdown` (what the step takes with the cores to itself)."""
        return self.measured_step_s / self.slowdown

    @property
    def error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1.0

    @property
    def error_normalised(self) -> float:
        return self.predicted_step_s / self.normalised_step_s - 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "parts": list(self.parts), "recompute": [list(r) for r in self.recompute],
                "error": self.error, "normalised_step_s": self.normalised_step_s,
                "error_normalised": self.error_normalised}


def check_verifiable(config, *, device: str = "cpu") -> None:
    """InputError unless the reference trainer can run ``config``'s (a ``PlanJobConfig``) model here."""
    if config.hf_model is not None:
        raise InputError("--verify runs the reference trainer's own models; a Hugging Face checkpoint is not "
                         "verified (use omnibal train --hf-model to measure it)", source="--verify", field="verify")
    if config.layout.tp_size != 1:
        raise InputError(f"the reference trainer has no tensor parallelism; --verify needs --tp 1, got "
                         f"{config.layout.tp_size}", source="--verify", field="tp_size")
    if device == "cpu":
        if config.preset not in CPU_MODELS:
            raise InputError(f"--verify on CPU runs only {', '.join(CPU_MODELS)} (model {config.preset} would take "
                             "hours per step); plan with --model tiny, or verify on CUDA devices", source="--verify",
                             field="preset")
        hardware = config.hardware_name
        if hardware != "cpu" and not hardware.startswith("cpu-"):  # a measured CPU spec is named cpu-<threads>t
            raise InputError(f"--verify measures on this machine's CPU but the plan predicts {hardware}: plan "
                             "with --hardware cpu (and a --profile measured here)", source="--hardware",
                             field="hardware")
        _check_fits_cpus(config.layout.dp_size * config.layout.pp_size, config.layout.pp_size)


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask: a container's or ``taskset``'s share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _check_fits_cpus(world: int, pp_size: int) -> None:
    """Refuse a CPU measurement of more ranks than cores. Each rank is a process with one torch thread; more
    of them than cores time-share the cores, so their step times measure the sharing, not the plan (and the
    default 128-GPU layout started 128 ranks, ~20 GB, on a 2-core machine). The plan is not shrunk to fit:
    another DP or PP size is another plan, with another schedule and other candidates."""
    cores = usable_cpus()
    if world <= cores:
        return
    pp = min(pp_size, cores)
    raise InputError(f"--verify runs the plan's {world} ranks (DP x PP) as local processes, one per CPU core, and "
                     f"this machine has {cores}: plan a world that fits (e.g. --gpus {cores} --pp {pp}), or verify "
                     f"where {world} cores or CUDA devices are", source="--gpus", field="num_gpus")


def resolve_device(device: str, world_size: int) -> str:
    """``auto`` -> ``cuda`` when at least ``world_size`` CUDA devices are present, else ``cpu``."""
    if device not in ("auto", "cpu", "cuda"):
        raise InputError(f"must be auto, cpu or cuda, got {device!r}", source="--verify-device", field="device")
    if device != "auto":
        return device
    import torch  # deferred: planning without --verify never needs torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"


def top_candidates(scored, k: int) -> list:
    """The ``k`` best memory-fitting candidates by the simulator's search score (distinct plans)."""
    seen, out = set(), []
    for cand in sorted((c for c in scored if not c.oom and c.sim_step_time is not None),
                       key=lambda c: c.sim_step_time):
        key = (tuple(cand.plan.parts), tuple(cand.plan.recompute_mask(cand.plan.parts[-1]).tolist()))
        if key not in seen:
            seen.add(key)
            out.append(cand)
        if len(out) == k:
            break
    return out


def recompute_sets(names, parts, mask) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(n for n, m in zip(names[a:b], mask[a:b]) if m) for a, b in zip(parts[:-1], parts[1:]))


def predicted_steps(result, parts, mask, num_steps: int) -> float:
    """The simulator's mean step over steps ``1..num_steps-1`` of the balanced schedule (step 0: warm-up)."""
    from omnibal.jobs.predict import schedule_features
    from omnibal.sim.epoch import simulate_epoch

    sched, stats = result.balanced_schedule, result.stats
    padding = result.plan.data.settings.get("padding", "varlen")
    features, buffer = schedule_features(sched, stats, padding=padding, p2p_padding="fixed_buffer",
                                         pp_size=result.plan.inputs.layout.pp_size)
    features = features[:num_steps]
    buffer = None if buffer is None else buffer[:num_steps]
    res = simulate_epoch(result.table, parts, mask, features, result.sim_config, buffer_features=buffer)
    return float(res.step_time[1:].mean())


def _train_config(result, cand_parts, rec_sets, files: dict, steps: int, device: str, timeout_s: float):
    from omnibal.train.config import TRAIN_LAYOUT, TrainConfig

    i = result.plan.inputs
    spec_tokens = int(result.stats.convention.tokens_per_tile) if result.stats.convention else 256
    # the schedule's count: its largest level's when the levels have their own (the trainer runs each step's)
    layout = replace(TRAIN_LAYOUT, dp_size=i.layout.dp_size, pp_size=i.layout.pp_size,
                     num_microbatches=int(result.balanced_schedule.num_microbatches))
    return TrainConfig(mode="offline", layout=layout,
                       stage_layers=tuple((int(a), int(b)) for a, b in zip(cand_parts[:-1], cand_parts[1:])),
                       recompute=rec_sets, model=i.model, stats_path=files["stats"], schedule_path=files["schedule"],
                       stats_tokens_per_tile=spec_tokens, num_steps=steps + 1, device=device, torch_threads=1,
                       timeout_s=min(timeout_s, 300.0), quiet=True)


def measure_candidate(cfg, *, timeout_s: float) -> tuple[float, float]:
    """``(mean wall-clock step, slowdown)`` of one trainer run (``train_rank`` on ``cfg.world_size`` local
    processes); the slowdown (see :class:`CandidateMeasurement`) is 1.0 on CUDA."""
    from omnibal.processes import start_method
    from omnibal.train.distributed import spawn_local
    from omnibal.train.run import train_rank

    results = spawn_local(train_rank, cfg.world_size, args=(cfg,), deadline_s=timeout_s,
                          start_method=start_method(cfg.device))
    errors = [r.error for r in results if r.error]
    if errors:
        raise InputError("a candidate's trainer run failed: " + "; ".join(str(e) for e in errors)[:2000],
                         source="--verify", field="verify")
    summary = results[0].value
    ranks = summary["per_rank"]
    busy = sum(r["compute_s"] + r["optim_s"] + r["data_s"] for r in ranks)
    cpu = sum(r["cpu_s"] for r in ranks)
    slowdown = max(1.0, busy / cpu) if cfg.device == "cpu" and cpu > 0 else 1.0
    return float(summary["mean_step_s"]), float(slowdown)


def verify_plan(result, config: VerifyConfig, job_config, *, progress=None):
    """Measure the top-K candidates of a ``PlanJobResult``; returns ``(plan chosen by measurement,
    [CandidateMeasurement] in the simulator's order)``. ``job_config``: the ``PlanJobConfig`` it came from."""
    from omnibal.stats.io import save_stats

    plan = result.plan
    world = plan.inputs.layout.dp_size * plan.inputs.layout.pp_size
    device = resolve_device(config.device, world)
    check_verifiable(job_config, device=device)
    if config.top_k < 1 or config.steps < 1:
        raise InputError("--verify and --verify-steps must be >= 1", source="--verify", field="verify")
    if result.balanced_schedule.num_steps < config.steps + 1:
        raise InputError(f"the balanced schedule has {result.balanced_schedule.num_steps} steps, --verify needs "
                         f"{config.steps + 1} (one warm-up): use more samples or fewer --verify-steps",
                         source="--verify-steps", field="verify_steps")
    candidates = top_candidates(result.scored, config.top_k)
    names = result.table.names
    measured = []
    with tempfile.TemporaryDirectory(prefix="omnibal-verify-") as tmp:
        files = {"stats": str(Path(tmp) / "stats.jsonl"), "schedule": str(Path(tmp) / "schedule.json")}
        save_stats(result.stats, files["stats"])
        result.balanced_schedule.to_json(files["schedule"])
        for n, cand in enumerate(candidates):
            parts = tuple(int(x) for x in cand.plan.parts)
            mask = cand.plan.recompute_mask(len(names))
            rec = recompute_sets(names, parts, mask)
            if progress is not None:
                progress(f"verify {n + 1}/{len(candidates)}: parts {list(parts)}, {int(mask.sum())} recomputed")
            cfg = _train_config(result, parts, rec, files, config.steps, device, config.timeout_s)
            wall, slowdown = measure_candidate(cfg, timeout_s=config.timeout_s)
            measured.append(CandidateMeasurement(
                parts=parts, recompute=rec, search_step_s=float(cand.sim_step_time),
                predicted_step_s=predicted_steps(result, parts, mask, config.steps + 1), measured_step_s=wall,
                slowdown=slowdown))
    # on a shared CPU the wall clock carries the other jobs' load: choose by the CPU-normalised step there
    best = int(np.argmin([m.normalised_step_s for m in measured]))
    chosen = _plan_for(result, candidates[best])
    verify = {"device": device, "steps": config.steps, "warmup_steps": 1, "torch_threads": 1,
              "load_average": list(os.getloadavg()), "chosen": best, "chosen_by": "normalised_step_s",
              "simulator_choice": 0, "candidates": [m.to_dict() for m in measured]}
    return replace(chosen, search={**chosen.search, "verify": verify}), measured


def _plan_for(result, candidate):
    """The job's plan with ``candidate``'s stages, and its epoch prediction re-simulated for them."""
    from omnibal.plan.plan import Prediction, plan_stages
    from omnibal.sim.epoch import simulate_epoch

    plan = result.plan
    mask = candidate.plan.recompute_mask(result.table.num_layers)
    res = simulate_epoch(result.table, candidate.plan.parts, mask, result.plan_features, result.sim_config,
                         epoch_scale=result.epoch_scale)
    summary = res.summary()
    prediction = Prediction(step_time_s=summary["step_time_mean_s"], epoch_time_s=res.total_time,
                            gpu_days=res.gpu_days, bubble=summary["bubble_mean"], num_steps=summary["num_steps"],
                            oom=bool(summary["oom_steps"]))
    stages = plan_stages(result.table.names, candidate.plan, res.peak_memory.max(axis=(0, 1)))
    return replace(plan, stages=stages, prediction=prediction,
                   search={**plan.search, "chosen_parts": list(candidate.plan.parts)})


def verify_markdown(measured: list[CandidateMeasurement], chosen: int) -> str:
    """Predicted vs measured per candidate, as a markdown table."""
    rows = [["#", "cut points", "recomputed layers", "search score s", "predicted s/step", "measured wall s/step",
             "error", "slowdown", "CPU-normalised s/step", "error", ""]]
    for n, m in enumerate(measured):
        rows.append([str(n + 1), str(list(m.parts)), str(sum(len(r) for r in m.recompute)), f"{m.search_step_s:.4g}",
                     f"{m.predicted_step_s:.4g}", f"{m.measured_step_s:.4g}", f"{m.error:+.1%}", f"{m.slowdown:.2f}",
                     f"{m.normalised_step_s:.4g}", f"{m.error_normalised:+.1%}",
                     "chosen (fastest measured)" if n == chosen else ""])
    lines = [markdown_table(rows, compact=True)]
    pred_order = list(np.argsort([m.predicted_step_s for m in measured]))
    meas_order = list(np.argsort([m.normalised_step_s for m in measured]))
    lines += ["", f"Simulator's order {[int(i) + 1 for i in pred_order]}, measured (CPU-normalised) order "
                  f"{[int(i) + 1 for i in meas_order]}; the plan takes candidate {chosen + 1}. Slowdown: the ranks' "
                  "busy wall time over their own CPU time (> 1: other jobs held the cores; 1 on CUDA)."]
    return "\n".join(lines) + "\n"
