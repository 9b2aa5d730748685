"""Per-step metrics: JSONL log, end-of-run summary table, progress bar.

Each rank measures its own step: ``compute_s`` (forward + backward of its stage), ``dp_sync_s`` (blocked in
the DP gradient all-reduce: where a rank that finished early waits for the slowest replica), ``optim_s``,
``data_s`` (loading + collating on stage 0) and ``wait_s`` = step time - everything else (pipeline p2p
and bubbles: time the stage sat idle waiting for activations or gradients). Global rank 0 gathers all
ranks' numbers once per step (outside the timed region) and writes one JSON line per step.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from omnibal.outputs import naming_path
from omnibal.tables import markdown_table

RANK_FIELDS = ("step_s", "compute_s", "wait_s", "dp_sync_s", "optim_s", "data_s", "cpu_s", "mem_bytes",
               "peak_mem_bytes")


@dataclass
class RankTimes:
    """One rank's share of one step (seconds; memory in bytes)."""

    step_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    dp_sync_s: float = 0.0
    optim_s: float = 0.0
    data_s: float = 0.0
    cpu_s: float = 0.0
    """CPU seconds the process used during the step (all its threads, including the backend's): on a
    loaded machine, wall times stretch but this does not."""
    mem_bytes: float = 0.0
    """Resident memory now (CPU RSS) or allocated device memory (CUDA)."""
    peak_mem_bytes: float = 0.0
    """Peak resident memory of the process (CPU) or peak allocated device memory (CUDA)."""

    def as_list(self) -> list[float]:
        return [float(getattr(self, f)) for f in RANK_FIELDS]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> RankTimes:
        return cls(**dict(zip(RANK_FIELDS, (float(v) for v in values))))


@dataclass
class StepWork:
    """What one rank's forward + backward of a step did: what the trainer needs to finish the step
    (optimizer, timings, ledger, record)."""

    loss_sum: float
    """Sum of the losses this rank computed (last stage only; 0 elsewhere), divided by the global target count."""
    times: RankTimes
    """The step's timings so far (data, compute, DP sync); the optimizer's and the total come later."""
    counts: dict[str, float]
    """The world's totals of the step (targets, samples, tokens, tiles, buffer tokens, buffer tiles)."""
    fed: list[int]
    """The sample indices whose loss this rank computed (empty off stage 0 and on SP followers)."""
    t_start: float
    """``time.perf_counter()`` when the step started."""
    cpu_start: float
    """``time.process_time()`` when the step started."""


@dataclass
class StepRecord:
    """One step of the whole world, as written to the JSONL log."""

    step: int
    loss: float
    """Mean loss per target token over the global batch."""
    step_s: float
    """Wall time of the step (the slowest rank's)."""
    samples: int
    """Real samples in the global batch."""
    tokens: int
    """Real (unpadded) LLM tokens in the global batch."""
    tiles: int
    """Real image tiles in the global batch."""
    buffer_tokens: int
    """LLM token slots computed (real + padding)."""
    buffer_tiles: int
    """Tile slots computed by the vision encoder (real + padding)."""
    targets: int
    """Target (loss) tokens in the global batch."""
    microbatches: int = 0
    """Micro-batches per rank the step ran (a multi-level schedule's levels may each run their own count)."""
    ranks: list[dict] = field(default_factory=list)
    """Per rank: rank, dp, pp and the RankTimes fields."""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_s if self.step_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["samples_per_s"] = self.samples_per_s
        doc["tokens_per_s"] = self.tokens_per_s
        # no tile pad ratio: the layers compute only the active tiles, which are all real (a tile is never
        # padded), so it would be 0 by construction
        doc["token_pad_ratio"] = 1 - self.tokens / self.buffer_tokens if self.buffer_tokens else 0.0
        return doc


def process_memory(device_type: str = "cpu") -> tuple[float, float]:
    """(current, peak) memory in bytes: RSS for CPU runs, allocated device memory for CUDA."""
    if device_type == "cuda":
        return float(torch.cuda.memory_allocated()), float(torch.cuda.max_memory_allocated())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])

        now = rss_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        now = peak
    return float(now), float(peak)


class MetricsLog:
    """Appends StepRecords to a JSONL file and keeps them for the summary."""

    def __init__(self, path: str | Path | None, *, append: bool = False, header: dict | None = None):
        self.path = Path(path) if path else None
        self.records: list[StepRecord] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a" if append else "w", encoding="utf-8")
            if header is not None:
                self._file.write(json.dumps({"run": header}) + "\n")
                self._file.flush()
        else:
            self._file = None

    def add(self, record: StepRecord) -> None:
        self.records.append(record)
        if self._file is not None:
            with naming_path(self.path):
                self._file.write(json.dumps(record.to_json()) + "\n")
                self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def summarize(records: Sequence[StepRecord], *, warmup: int = 1) -> dict:
    """Throughput and per-rank time shares over the steps after ``warmup`` (all of them if too few)."""
    use = list(records[warmup:]) if len(records) > warmup else list(records)
    if not use:
        return {}
    total_s = sum(r.step_s for r in use)
    ranks: dict[int, dict] = {}
    for rec in use:
        for rk in rec.ranks:
            acc = ranks.setdefault(rk["rank"], {"rank": rk["rank"], "dp": rk["dp"], "pp": rk["pp"], "n": 0,
                                                **{f: 0.0 for f in RANK_FIELDS if "mem" not in f},
                                                "peak_mem_bytes": 0.0})
            acc["n"] += 1
            for f in RANK_FIELDS:
                if f == "peak_mem_bytes":
                    acc[f] = max(acc[f], rk[f])
                elif f != "mem_bytes":
                    acc[f] += rk[f]
    per_rank = []
    for acc in sorted(ranks.values(), key=lambda a: a["rank"]):
        n = acc.pop("n")
        per_rank.append({**acc, **{f: acc[f] / n for f in RANK_FIELDS if "mem" not in f}})
    return {
        "steps": len(use),
        "warmup_steps_excluded": len(records) - len(use),
        "median_step_s": statistics.median(r.step_s for r in use),
        "mean_step_s": total_s / len(use),
        "samples_per_s": sum(r.samples for r in use) / total_s if total_s else 0.0,
        "tokens_per_s": sum(r.tokens for r in use) / total_s if total_s else 0.0,
        "token_pad_ratio": 1 - sum(r.tokens for r in use) / max(1, sum(r.buffer_tokens for r in use)),
        "final_loss": use[-1].loss,
        "per_rank": per_rank,
    }


def format_summary(summary: dict, title: str = "training summary") -> str:
    """Markdown table of the summary (per-rank compute / wait / DP sync in mean seconds per step)."""
    if not summary:
        return f"{title}: no steps"
    lines = [f"## {title}", "",
             f"steps {summary['steps']} (+{summary['warmup_steps_excluded']} warm-up), median step "
             f"{summary['median_step_s'] * 1e3:.1f} ms, {summary['samples_per_s']:.2f} samples/s, "
             f"{summary['tokens_per_s']:.0f} tokens/s (real), token pad {summary['token_pad_ratio']:.1%}, "
             f"final loss {summary['final_loss']:.4f}", "",
             markdown_table([["rank", "dp", "pp", "step ms", "compute ms", "pipeline wait ms", "dp sync ms",
                             "optim ms", "data ms", "cpu ms", "peak MiB"]] + [
                 [str(r["rank"]), str(r["dp"]), str(r["pp"])]
                 + [f"{r[k] * 1e3:.1f}" for k in ("step_s", "compute_s", "wait_s", "dp_sync_s", "optim_s", "data_s",
                                                  "cpu_s")]
                 + [f"{r['peak_mem_bytes'] / 2**20:.0f}"] for r in summary["per_rank"]])]
    return "\n".join(lines)


def progress_bar(total: int, initial: int, *, quiet: bool, desc: str = "train"):
    """tqdm on stderr; disabled when quiet or stderr is not a terminal."""
    if not hasattr(tqdm, "_lock"):
        # tqdm's default lock holds a multiprocessing semaphore: a rank stopped by a signal (Ctrl-C, a failed
        # peer) never releases it, and the parent's resource tracker then warns of a leak; one bar per process
        # needs only a thread lock
        tqdm.set_lock(threading.RLock())
    return tqdm(total=total, initial=initial, desc=desc, unit="step", file=sys.stderr,
                disable=quiet or not sys.stderr.isatty(), dynamic_ncols=True)


LINES_PER_RUN = 20
"""Loss lines a run prints by default (``StepReporter(every=0)``), first and last step included."""
MAX_QUIET_S = 60.0
"""Longest a run goes without a loss line (slow steps): one is printed at the next step after it."""


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class StepReporter:
    """What a person sees of the steps (global rank 0 of a run that is not quiet): the progress bar where
    stderr is a terminal, and where stdout is not one (a log file, a pipe, a job scheduler) or no bar shows,
    a loss line on ``say`` every ``every`` steps (0: about :data:`LINES_PER_RUN` per run), the first and the
    last step and at least one every :data:`MAX_QUIET_S` included: a bar alone leaves a log with the final
    loss only. :meth:`line` says anything else without tearing the bar."""

    def __init__(self, total: int, initial: int, *, show: bool, say=None, every: int = 0):
        self.total, self.initial, self.say = total, initial, say if show else None
        self.bar = progress_bar(total, initial, quiet=not show)
        self.lines = self.say is not None and (not sys.stdout.isatty() or self.bar.disable)
        self.every = every or max(1, -(-(total - initial) // LINES_PER_RUN))
        self._t0 = self._last = time.monotonic()

    def line(self, text: str) -> None:
        if self.say is None:
            return
        if self.bar.disable:
            self.say(text)
        else:
            self.bar.write(text, file=sys.stdout)

    def update(self, record: StepRecord | None) -> None:
        """After a step (``record``: rank 0's, None elsewhere)."""
        self.bar.update(1)
        if record is None:
            return
        self.bar.set_postfix(loss=f"{record.loss:.3f}", sps=f"{record.samples_per_s:.1f}")
        done, now = record.step + 1, time.monotonic()
        if not self.lines or not (done in (self.initial + 1, self.total) or (done - self.initial) % self.every == 0
                                  or now - self._last >= MAX_QUIET_S):
            return
        self._last = now
        elapsed = now - self._t0
        left = elapsed / max(1, done - self.initial) * (self.total - done)
        self.say(f"step {done}/{self.total}  loss {record.loss:.4f}  {record.step_s:.2f} s/step  "
                 f"{record.samples_per_s:.1f} samples/s  {_clock(elapsed)} elapsed, ~{_clock(left)} left")

    def close(self) -> None:
        self.bar.close()
