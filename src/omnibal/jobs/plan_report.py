"""Plan reports: terminal text, markdown and PNGs.

``write_job_outputs`` writes everything ``omnibal plan`` produces into one folder (plan.json,
ablation.json, report.md, a pipeline timeline per ablation row, a per-stage chart); ``render_report``
turns a plan.json (with its ablation.json, and optional simulate/train outputs) back into report.md and
the stage chart, which is what ``omnibal report`` does. matplotlib is imported inside the plot functions.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np

from omnibal.errors import InputError
from omnibal.outputs import write_text
from omnibal.plan.ablation import AblationRow, ablation_markdown
from omnibal.plan.exports import export_all
from omnibal.plan.plan import Plan
from omnibal.sim.epoch import simulate_epoch, simulate_one_step
from omnibal.sim.report import pick_ranks, plot_timeline
from omnibal.tables import fixed, markdown_table

PLAN_OUTPUTS = ("plan.json", "ablation.json", "report.md", "verify.md", "*.png", "exports", "hbp.json",
                "hbp_schedule.json")
"""What ``omnibal plan`` (and ``omnibal report`` on its folder) writes into its ``--out`` folder: a folder that holds
anything else is refused, since a plan's folder is replaced whole (``omnibal.outputs.staged_dir``)."""

GiB = float(1 << 30)


def _gib(x: float | None) -> str:
    return "-" if x is None else fixed(x / GiB, 1)


def _layer_span(modules: tuple[str, ...]) -> str:
    return modules[0] if len(modules) == 1 else f"{modules[0]} .. {modules[-1]}"


def stage_rows(plan: Plan) -> list[list[str]]:
    """Header + one row per stage."""
    budget = plan.inputs.memory_budget_bytes
    rows = [["stage", "layers", "modules", "checkpointed", "in flight", "time/mb (s)", "recompute/mb (s)",
             f"planned GiB (budget {_gib(budget)})", "simulated peak GiB"]]
    for st in plan.stages:
        rows.append([str(st.stage), f"{st.layers[0]}-{st.layers[1] - 1}", _layer_span(st.modules),
                     f"{len(st.recompute)} of {len(st.modules)}", str(st.in_flight), fixed(st.time_s, 3),
                     fixed(st.recompute_time_s, 3), _gib(st.memory_bytes), _gib(st.simulated_peak_memory_bytes)])
    return rows


BALANCE_KEYS = (("num_microbatches", "micro-batches per step", "{:d}"),
                ("num_steps", "steps of the balanced rows", "{:d}"),
                ("samples_per_microbatch_mean", "samples / micro-batch", "{:.2f}"),
                ("caps_tiles", "tile buffer Q_v", "{:d}"), ("caps_tokens", "token buffer Q_t", "{:d}"),
                ("pad_ratio_longest", "pad ratio (padded to longest)", "{:.3f}"),
                ("dist_ratio_vision", "dist ratio vision", "{:.3f}"), ("dist_ratio_text", "dist ratio text", "{:.3f}"),
                ("vision_max_mean_ranks", "vision cost max/mean over ranks (per step, mean over steps)", "{:.3f}"),
                ("llm_max_mean_ranks", "LLM cost (linear + attention) max/mean over ranks", "{:.3f}"),
                ("llm_attention_max_mean_ranks", "LLM attention cost alone max/mean over ranks", "{:.3f}"),
                ("total_max_mean_ranks", "total cost (vision + LLM) max/mean over ranks", "{:.3f}"),
                ("cost_model", "costs priced on", "{}"),
                ("useful_fraction", "useful compute fraction", "{:.3f}"), ("coverage_ok", "every sample once", "{}"))


def balance_rows(metrics: dict[str, dict]) -> list[list[str]]:
    """Header + one row per metric, one column per schedule."""
    names = list(metrics)
    rows = [["metric", *names]]
    for key, label, fmt in BALANCE_KEYS:
        if not any(key in metrics[n] for n in names):
            continue
        cells = []
        for n in names:
            v = metrics[n].get(key)
            if v is None:
                cells.append("-")
            elif "{:d}" in fmt:
                cells.append(fmt.format(int(v)))
            else:
                cells.append(fmt.format(v))
        rows.append([label, *cells])
    return rows


def plot_stages(plan: Plan, path: str | Path, ablation: list[AblationRow] | None = None) -> Path:
    """Per stage: time per micro-batch split into compute, p2p and recompute; memory against the budget."""
    from matplotlib.figure import Figure  # no pyplot: its global backend and figure registry stay untouched

    stages = plan.stages
    x = np.arange(len(stages))
    fig = Figure(figsize=(12, 4))
    axes = fig.subplots(1, 2)
    comp = np.array([s.compute_time_s for s in stages])
    p2p = np.array([s.boundary_time_s for s in stages])
    rec = np.array([s.recompute_time_s for s in stages])
    axes[0].bar(x, comp, color="#4C72B0", label="forward + backward")
    axes[0].bar(x, p2p, bottom=comp, color="#8C8C8C", label="p2p")
    axes[0].bar(x, rec, bottom=comp + p2p, color="#DD8452", label="recompute")
    axes[0].set_xticks(x, [f"{s.stage}\n{s.layers[0]}-{s.layers[1] - 1}" for s in stages])
    axes[0].set_ylabel("seconds per mean micro-batch")
    axes[0].set_title("stage time (planned)", fontsize=10)
    axes[0].legend(fontsize=8)
    planned = np.array([s.memory_bytes for s in stages]) / GiB
    axes[1].bar(x - 0.2, planned, width=0.4, color="#55A868", label="planned peak")
    sim = [s.simulated_peak_memory_bytes for s in stages]
    if all(v is not None for v in sim):
        axes[1].bar(x + 0.2, np.array(sim) / GiB, width=0.4, color="#8172B3", label="simulated peak")
    if plan.inputs.memory_budget_bytes is not None:
        axes[1].axhline(plan.inputs.memory_budget_bytes / GiB, color="black", linestyle="--", label="budget")
    axes[1].set_xticks(x, [f"{s.stage}\n{len(s.recompute)} ckpt" for s in stages])
    axes[1].set_ylabel("GiB per device")
    axes[1].set_title("stage memory", fontsize=10)
    axes[1].legend(fontsize=8, loc="lower right")
    lay = plan.inputs.layout
    fig.suptitle(f"{plan.inputs.model} on {lay.num_gpus} x {plan.inputs.hardware} "
                 f"(DP {lay.dp_size} x PP {lay.pp_size} x TP {lay.tp_size})", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def plot_ablation(rows: list[AblationRow], path: str | Path) -> Path:
    """GPU days per ablation step, predicted next to the paper's."""
    from matplotlib.figure import Figure  # no pyplot: its global backend and figure registry stay untouched

    x = np.arange(len(rows))
    fig = Figure(figsize=(8, 3.8))
    ax = fig.subplots()
    ours = [r.gpu_days for r in rows]
    paper = [r.paper_gpu_days or 0.0 for r in rows]
    width = 0.4 if any(paper) else 0.6
    ax.bar(x - (0.2 if any(paper) else 0.0), ours, width=width, color="#4C72B0", label="omnibal (predicted)")
    if any(paper):
        ax.bar(x + 0.2, paper, width=0.4, color="#C44E52", label="OmniBal paper (measured)")
    for i, r in enumerate(rows):
        ax.text(i - (0.2 if any(paper) else 0.0), ours[i], f"{ours[i]:.1f}\n{r.speedup:.2f}x", ha="center",
                va="bottom", fontsize=7)
        if r.paper_gpu_days:
            ax.text(i + 0.2, paper[i], f"{paper[i]:.1f}\n{r.paper_speedup:.2f}x", ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(x, [r.name for r in rows], fontsize=8)
    ax.set_ylabel("GPU days per epoch")
    ax.set_ylim(0, max(ours + paper) * 1.25)
    ax.legend(fontsize=8)
    ax.set_title("ablation", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def ablation_from_json(path: str | Path) -> list[AblationRow]:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
        rows = []
        for r in raw["rows"]:
            r = dict(r)
            r.pop("paper_speedup", None)
            r["parts"] = tuple(r["parts"])
            r["peak_memory_bytes"] = tuple(r["peak_memory_bytes"])
            rows.append(AblationRow(**r))
        return rows
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InputError(f"not an ablation file: {exc}", source=str(path), field="rows") from None


def plan_markdown(plan: Plan, ablation: list[AblationRow] | None, *, images: dict[str, str] | None = None,
                  balance_metrics: dict | None = None, extra: list[str] | None = None,
                  timings: dict | None = None) -> str:
    """The report as markdown (image paths relative to the report)."""
    images = images or {}
    inp, lay = plan.inputs, plan.inputs.layout
    pred = plan.prediction
    lines = [f"# omnibal plan: {inp.model} on {lay.num_gpus} x {inp.hardware}", "",
             f"- parallelism: DP {lay.dp_size} x PP {lay.pp_size} x TP {lay.tp_size}, ZeRO-{lay.zero_stage}, "
             f"{lay.num_microbatches} micro-batches per step and rank",
             f"- memory budget per device: {_gib(inp.memory_budget_bytes)} GiB",
             f"- data: {inp.stats_source} ({inp.num_samples:,} samples, fingerprint {inp.stats_fingerprint})",
             f"- cost model: {'profile ' + inp.profile if inp.profile else 'analytic'}; omnibal {inp.omnibal_version}",
             f"- balancer: {plan.data.method}, caps {plan.data.settings.get('caps')}, "
             f"padding {plan.data.settings.get('padding')}",
             "", "## Prediction", "",
             f"Step time {fixed(pred.step_time_s, 2)} s, {pred.num_steps} steps, epoch "
             f"{fixed(pred.epoch_time_s / 3600, 2)} h, **{fixed(pred.gpu_days, 1)} GPU days**, pipeline bubble "
             f"{pred.bubble:.1%}"
             f"{', OUT OF MEMORY on some steps' if pred.oom else ''}.", ""]
    if ablation:
        paper = ablation[0].paper_gpu_days is not None
        lines += ["## Ablation (predicted by the simulator" + (", next to the paper's measurements)" if paper else ")"),
                  "", ablation_markdown(ablation), ""]
        if paper:
            lines += ["The paper measured a different dataset and baseline split; docs/plan.md explains each "
                      "difference from the model (and the variants that reproduce the paper's steps).", ""]
        if "ablation" in images:
            lines += [f"![ablation]({images['ablation']})", ""]
    lines += ["## Stages", "", markdown_table(stage_rows(plan)), ""]
    if "stages" in images:
        lines += [f"![stages]({images['stages']})", ""]
    lines += ["Checkpointed modules per stage:", ""]
    for st in plan.stages:
        lines.append(f"- stage {st.stage}: " + (", ".join(st.recompute) if st.recompute else "none"))
    lines.append("")
    timeline_keys = [k for k in images if k.startswith("timeline:")]
    if timeline_keys:
        lines += ["## Pipeline timelines (one step of each ablation row; the median step of its epoch)", ""]
        for k in timeline_keys:
            lines += [f"### {k.split(':', 1)[1]}", "", f"![{k}]({images[k]})", ""]
    if balance_metrics:
        lines += ["## Balance", "", markdown_table(balance_rows(balance_metrics)), ""]
    ex = export_all(plan)
    lines += ["## Exports", "", f"Planned for engine `{plan.engine}`; `omnibal plan --engine NAME` writes the files "
              "under `exports/` (docs/engines/).", ""]
    for engine, fields in ex.items():
        if "not_expressible" in fields:
            lines.append(f"- {engine}: not expressible ({fields['not_expressible']})")
        elif engine == "deepspeed":
            lines.append(f"- deepspeed: parts `{fields['parts']}`, checkpointed layers per stage "
                         f"`{[len(r) for r in fields['recompute_layers_per_stage']]}`")
        elif engine == "megatron":
            lang = fields["language"]
            lines.append(f"- megatron: layout `{lang['pipeline_model_parallel_layout']}`, recompute_num_layers "
                         f"`{lang['recompute_num_layers']}` (vision `{fields['vision']['recompute_num_layers']}`)")
        else:
            lines.append(f"- torchtitan: {len(fields['parallelism']['module_fqns_per_model_part'])} model parts, "
                         f"activation checkpoint `{fields['activation_checkpoint']['mode']}`")
    lines.append("")
    search = plan.search
    if search.get("candidates"):
        lines += ["## Search", "",
                  f"Exact joint optimum (anchor) {search.get('anchor_parts')}; {search.get('enumerated')} "
                  f"neighbours within {search.get('radius')} layers ranked by the stage model, the best "
                  f"{search.get('scored')} simulated on {search.get('sample_steps')} steps; chosen "
                  f"{search.get('chosen_parts')}.", "",
                  markdown_table([["cut points", "stage-model step (s)", "simulated step (s)", "OOM"]] + [
                      [str(c["parts"]), f"{c['model_step_time_s']:.3f}",
                       "-" if c.get("sim_step_time_s") is None else f"{c['sim_step_time_s']:.3f}", str(c["oom"])]
                      for c in search["candidates"]]), ""]
    if extra:
        lines += extra
    if timings:
        lines += ["## Wall time", "", ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()), ""]
    return "\n".join(lines)


def timeline_name(index: int, row_name: str) -> str:
    """The timeline PNG of ablation row ``index`` (what ``write_job_outputs`` draws, ``render_report`` embeds)."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", row_name.strip("+ ")).strip("_")  # engine rows hold ':' '/' '()'
    return f"timeline_{index}_{slug}.png"


def write_job_outputs(result, out_dir: str | Path, *, timelines: bool = True, progress=None) -> dict[str, Path]:
    """Write plan.json, ablation.json, report.md and the PNGs of a :class:`PlanJobResult`.
    ``progress(label)`` is called before each picture (for a progress bar)."""
    progress = progress or (lambda label: None)

    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {"plan": result.plan.save(out / "plan.json")}
    progress("ablation and stage charts")
    images = {"ablation": plot_ablation(result.ablation, out / "ablation.png").name,
              "stages": plot_stages(result.plan, out / "stages.png", result.ablation).name}
    if timelines:
        for i, row in enumerate(result.ablation):
            parts, mask = result.row_plans[row.name]
            progress(f"timeline: {row.name}")
            feats = result.row_features(row.name)  # the row's own pack: its micro-batch count and caps
            steps = result.row_step_times.get(row.name)
            if steps is None:
                steps = simulate_epoch(result.table, parts, mask, feats, result.row_sim_config(row.name)).step_time
            median = int(np.argsort(steps)[len(steps) // 2])
            costs, step = simulate_one_step(result.table, parts, mask, feats[median], result.row_sim_config(row.name))
            name = timeline_name(i, row.name)
            # the slowest and the fastest DP rank of the step: the imbalance, at half the drawing time of four
            plot_timeline(costs, step, out / name, ranks=pick_ranks(step.pipeline.busy[0], max_ranks=2),
                          title=f"{row.name}: step {median} (median), {row.step_time_s:.1f} s mean step")
            images[f"timeline:{row.name}"] = name
    md = plan_markdown(result.plan, result.ablation, images=images, balance_metrics=result.balance_metrics,
                       timings=result.timings)
    write_text(out / "report.md", md)
    files["report"] = out / "report.md"
    for key, name in images.items():
        files[f"png:{key}"] = out / name
    # last, so that its timings include writing this report
    timings = {**result.timings, "report": round(time.perf_counter() - t0, 3)}
    write_text(out / "ablation.json", json.dumps({"rows": [r.to_dict() for r in result.ablation],
                                                 "balance_metrics": result.balance_metrics,
                                                 "timings": timings}, indent=2) + "\n")
    files["ablation"] = out / "ablation.json"
    return files


def render_report(plan_path: str | Path, out_dir: str | Path | None = None, *,
                  ablation_path: str | Path | None = None, simulate_path: str | Path | None = None,
                  train_path: str | Path | None = None) -> dict[str, Path]:
    """``omnibal report``: report.md + stages.png (+ ablation.png) from a plan.json and its companions."""
    plan_path = Path(plan_path)
    plan = Plan.load(plan_path)
    out = Path(out_dir) if out_dir is not None else plan_path.parent
    out.mkdir(parents=True, exist_ok=True)
    ablation, metrics, timings = None, None, None
    if ablation_path is None and (plan_path.parent / "ablation.json").is_file():
        ablation_path = plan_path.parent / "ablation.json"
    if ablation_path is not None:
        ablation = ablation_from_json(ablation_path)
        raw = json.loads(Path(ablation_path).read_text())
        metrics, timings = raw.get("balance_metrics"), raw.get("timings")
    images = {"stages": plot_stages(plan, out / "stages.png").name}
    if ablation:
        images["ablation"] = plot_ablation(ablation, out / "ablation.png").name
    # the plan's own timelines only: a PNG of another run in the folder is not this plan's
    for i, row in enumerate(ablation or []):
        if (out / timeline_name(i, row.name)).is_file():
            images[f"timeline:{row.name}"] = timeline_name(i, row.name)
    extra = []
    if simulate_path is not None:
        extra += _simulate_section(plan, Path(simulate_path))
    if train_path is not None:
        extra += _train_section(plan, Path(train_path))
    md = plan_markdown(plan, ablation, images=images, balance_metrics=metrics, extra=extra, timings=timings)
    write_text(out / "report.md", md)
    files = {"report": out / "report.md"}
    files.update({f"png:{k}": out / v for k, v in images.items()})
    return files


def _simulate_section(plan: Plan, path: Path) -> list[str]:
    try:
        sim = json.loads(path.read_text())
        step = float(sim["step_time_mean_s"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise InputError(f"not a simulate summary (omnibal simulate's JSON): {exc}", source=str(path),
                         field="step_time_mean_s") from None
    return ["## Simulation", "", f"`{path.name}`: mean step {step:.3f} s (plan predicted "
            f"{plan.prediction.step_time_s:.3f} s; cut points {sim.get('cuts')}, bubble "
            f"{sim.get('bubble_mean', float('nan')):.1%}).", ""]


def _train_section(plan: Plan, path: Path) -> list[str]:
    """Measured step times from a training metrics log (JSON lines with ``step_s``, what ``omnibal train
    --metrics-log`` writes, or ``step_time_s``)."""
    times = []
    try:
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            value = rec.get("step_s", rec.get("step_time_s", rec.get("step_time")))
            if value is not None:
                times.append(float(value))
    except (OSError, json.JSONDecodeError, ValueError, AttributeError) as exc:
        raise InputError(f"not a JSON-lines metrics log: {exc}", source=str(path)) from None
    if not times:
        raise InputError("no step_time_s records", source=str(path), field="step_time_s")
    arr = np.array(times)
    return ["## Training run", "", f"`{path.name}`: {len(arr)} steps, median {np.median(arr):.4f} s, mean "
            f"{arr.mean():.4f} s (first step included; plan predicted {plan.prediction.step_time_s:.4f} s for "
            f"its own cluster).", ""]
