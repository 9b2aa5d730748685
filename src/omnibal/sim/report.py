"""Reports of a simulated epoch: a text table, markdown, a pipeline timeline PNG and load histograms PNG.

matplotlib is imported inside the plotting functions (Figure objects, no pyplot: the caller's backend stays as it was)
so importing this module stays cheap.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from omnibal.outputs import write_text
from omnibal.sim.costs import StageCosts
from omnibal.sim.epoch import EpochResult
from omnibal.sim.step import StepTimes
from omnibal.tables import markdown_table

COLOURS = {
    "forward": "#4C72B0",
    "recompute": "#DD8452",
    "backward": "#55A868",
    "p2p": "#8C8C8C",
    "allreduce": "#8172B3",
    "idle": "#F2F2F2",
}


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def stage_table(result: EpochResult) -> list[list[str]]:
    """Rows (header first) of the per-stage table: layers, busy, idle, sync, memory, OOM."""
    rows = [["stage", "layers", "busy s/step", "idle s/step", "DP wait s", "all-reduce s", "in-flight",
             "static GiB", "peak GiB", "OOM steps"]]
    for st in result.summary()["stages"]:
        rows.append([
            str(len(rows) - 1), " + ".join(f"{a}-{b - 1}" for a, b in st["layers"]), f"{st['busy_mean_s']:.4g}",
            f"{st['idle_mean_s']:.4g}", f"{st['sync_wait_mean_s']:.4g}", f"{st['allreduce_s']:.4g}",
            str(st["peak_inflight"]), _gib(st["static_bytes"]), _gib(st["peak_memory_bytes"]),
            "-" if st["oom_steps"] is None else str(st["oom_steps"]),
        ])
    return rows


def totals_rows(result: EpochResult) -> list[list[str]]:
    s = result.summary()
    simulated = s["simulated_steps"]
    oom = "no budget" if s["oom_steps"] is None else f"{s['oom_steps']} of {simulated} simulated steps"
    steps = str(s["num_steps"])
    if s["epoch_scale"] != 1.0:
        steps += f" ({simulated} simulated, the epoch x{s['epoch_scale']:.3g})"
    return [
        ["quantity", "value"],
        ["GPUs (DP x PP x TP)", f"{s['num_gpus']} ({s['dp_size']} x {s['pp_size']} x {s['tp_size']})"],
        ["pp schedule", s["pp_schedule"]],
        ["steps", steps],
        ["step time mean / max s", f"{s['step_time_mean_s']:.4g} / {s['step_time_max_s']:.4g}"],
        ["pipeline bubble (mean)", f"{s['bubble_mean']:.1%}"],
        ["idle share of device time", f"{_idle_share(result):.1%}"],
        ["epoch time", f"{s['total_time_s']:.4g} s ({s['total_time_s'] / 3600:.3g} h)"],
        ["GPU days", f"{s['gpu_days']:.4g}"],
        ["OOM", oom],
    ]


def _idle_share(result: EpochResult) -> float:
    total = result.step_time.sum() * result.busy.shape[1] * result.busy.shape[2]
    return float(1.0 - result.busy.sum() / total) if total > 0 else 0.0


def pick_ranks(busy_step: np.ndarray, max_ranks: int = 4) -> list[int]:
    """DP ranks worth drawing for one step ``busy [D, P]``: the slowest and fastest, then a few between."""
    load = busy_step.sum(axis=-1)
    order = np.argsort(load, kind="stable")
    if len(order) <= max_ranks:
        return sorted(order.tolist())
    picks = np.unique(order[np.round(np.linspace(0, len(order) - 1, max_ranks)).astype(int)])
    return sorted(picks.tolist())


def plot_timeline(costs: StageCosts, step: StepTimes, path: str | Path, *, ranks: list[int] | None = None,
                  title: str = "") -> Path:
    """Gantt chart of one step (the result of ``simulate_one_step``): a row per (DP rank, stage), with
    forward, recompute, backward, p2p arrivals, the gradient all-reduce and idle time."""
    from matplotlib.figure import Figure  # no pyplot: its global backend and figure registry stay untouched
    from matplotlib.patches import Patch

    pipe = step.pipeline
    fs, fe, bs, be = (x[0] for x in (pipe.fwd_start, pipe.fwd_end, pipe.bwd_start, pipe.bwd_end))  # [D, M, V]
    rec = np.broadcast_to(costs.recompute[0], fs.shape)
    p2p = np.broadcast_to(costs.p2p[0], fs.shape[:-1] + (fs.shape[-1] - 1,))
    num_dp, num_mb, num_virtual = fs.shape
    num_stages = pipe.stage_end.shape[-1]
    ranks = pick_ranks(pipe.busy[0]) if ranks is None else ranks
    step_time = float(step.step_time[0])
    group_end = pipe.stage_end[0].max(axis=0)
    rows = [(d, s) for d in ranks for s in range(num_stages)]
    row_of = {key: y for y, key in enumerate(rows)}
    fig_h = 1.2 + 0.42 * len(rows)
    fig = Figure(figsize=(13, fig_h))
    ax = fig.subplots()
    label_mb = num_mb * pipe.num_chunks <= 24
    edge = dict(edgecolor="white", linewidth=0.4)
    for (_d, s), y in row_of.items():
        ax.broken_barh([(0, step_time)], (y - 0.4, 0.8), color=COLOURS["idle"])
        ar = step.allreduce_time[s]
        if ar > 0:
            ax.broken_barh([(group_end[s], ar)], (y - 0.4, 0.8), color=COLOURS["allreduce"])
    for d in ranks:
        for k in range(num_virtual):
            y = row_of[(d, k % num_stages)]
            tag = "" if pipe.num_chunks == 1 else f".{k // num_stages}"
            for m in range(num_mb):
                ax.broken_barh([(fs[d, m, k], fe[d, m, k] - fs[d, m, k])], (y - 0.4, 0.8), color=COLOURS["forward"],
                               **edge)
                r = rec[d, m, k]
                if r > 0:
                    ax.broken_barh([(bs[d, m, k], r)], (y - 0.4, 0.8), color=COLOURS["recompute"], **edge)
                ax.broken_barh([(bs[d, m, k] + r, be[d, m, k] - bs[d, m, k] - r)], (y - 0.4, 0.8),
                               color=COLOURS["backward"], **edge)
                if k > 0 and p2p[d, m, k - 1] > 0:  # activation arriving from the previous stage
                    ax.broken_barh([(fe[d, m, k - 1], p2p[d, m, k - 1])], (y - 0.4, 0.15), color=COLOURS["p2p"])
                if k < num_virtual - 1 and p2p[d, m, k] > 0:  # gradient arriving from the next stage
                    ax.broken_barh([(be[d, m, k + 1], p2p[d, m, k])], (y + 0.25, 0.15), color=COLOURS["p2p"])
                if label_mb:
                    for start, end in ((fs[d, m, k], fe[d, m, k]), (bs[d, m, k], be[d, m, k])):
                        if end - start > step_time / 80:
                            ax.text((start + end) / 2, y, f"{m}{tag}", ha="center", va="center", fontsize=6,
                                    color="white")
    ax.set_yticks(range(len(rows)), [f"rank {d} / stage {s}" for d, s in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, step_time * 1.01)
    ax.set_xlabel("seconds")
    fig.suptitle(title or f"pipeline timeline of one step ({step.pipeline.pp_schedule}, {num_mb} micro-batches, "
                 f"{len(ranks)} of {num_dp} DP ranks)", fontsize=10)
    fig.text(0.99, 0.005, f"DP ranks shown: {ranks} (slowest and fastest of the step)", ha="right", fontsize=7)
    for k in range(1, len(ranks)):  # separate DP ranks
        ax.axhline(k * num_stages - 0.5, color="black", linewidth=0.6)
    ax.legend(handles=[Patch(facecolor=c, edgecolor="#999999", label=k) for k, c in COLOURS.items()],
              loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def plot_load_histograms(result: EpochResult, path: str | Path, *, title: str = "") -> Path:
    """Per-rank load over the epoch: (1) each rank's compute load relative to its step's mean rank,
    (2) per step, slowest rank / mean rank, (3) per-stage busy time (partition balance)."""
    from matplotlib.figure import Figure  # no pyplot: its global backend and figure registry stay untouched

    load = result.busy.sum(axis=-1)  # [S, D]
    mean = load.mean(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(mean > 0, load / mean, 1.0)
    fig = Figure(figsize=(15, 4))
    axes = fig.subplots(1, 3)
    axes[0].hist(rel.ravel(), bins=60, color=COLOURS["forward"])
    axes[0].set_xlabel("rank load / mean rank load of its step")
    axes[0].set_ylabel("rank-steps")
    axes[0].set_title("per-rank load (DP balance)", fontsize=10)
    axes[1].hist(rel.max(axis=1), bins=60, color=COLOURS["recompute"])
    axes[1].set_xlabel("slowest rank / mean rank (per step)")
    axes[1].set_ylabel("steps")
    axes[1].set_title(f"step max/mean: mean {rel.max(axis=1).mean():.3f}", fontsize=10)
    edges = np.histogram_bin_edges(result.busy, bins=60)
    for s in range(result.busy.shape[-1]):
        axes[2].hist(result.busy[..., s].ravel(), bins=edges, alpha=0.6, label=f"stage {s}")
    axes[2].set_xlabel("busy seconds per step")
    axes[2].set_ylabel("rank-steps")
    axes[2].set_title("per-stage busy time (partition balance)", fontsize=10)
    axes[2].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def write_report(result: EpochResult, costs: StageCosts, step: StepTimes, step_index: int, out_dir: str | Path,
                 *, header: dict | None = None, layer_names: tuple[str, ...] | None = None,
                 prefix: str = "simulate") -> dict[str, Path]:
    """Write ``<prefix>.md``, ``<prefix>.json``, ``<prefix>_timeline.png`` and ``<prefix>_load.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    timeline = plot_timeline(costs, step, out / f"{prefix}_timeline.png",
                             title=f"step {step_index}: pipeline timeline ({result.config.pp_schedule}, "
                             f"{result.busy.shape[1]} DP ranks x {result.num_stages} stages)")
    load = plot_load_histograms(result, out / f"{prefix}_load.png")
    summary = result.summary()
    summary["inputs"] = header or {}
    summary["timeline_step"] = step_index
    write_text(out / f"{prefix}.json", json.dumps(summary, indent=2) + "\n")
    lines = ["# omnibal simulate", ""]
    if header:
        lines += [f"- {k}: {v}" for k, v in header.items()] + [""]
    lines += ["## Totals", "", markdown_table(totals_rows(result), compact=True), "", "## Stages", "",
              markdown_table(stage_table(result), compact=True), ""]
    if layer_names is not None:
        lines += ["Stage layers: " + "; ".join(
            f"{s}: {layer_names[result.cuts[s]]} .. {layer_names[result.cuts[s + 1] - 1]}"
            for s in range(result.num_stages)), ""]
    lines += [f"## Pipeline timeline (step {step_index})", "", f"![timeline]({timeline.name})", "",
              "## Per-rank load", "", f"![load]({load.name})", ""]
    md = out / f"{prefix}.md"
    write_text(md, "\n".join(lines))
    return {"markdown": md, "json": out / f"{prefix}.json", "timeline": timeline, "load": load}
