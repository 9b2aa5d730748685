"""The paper's ablation, predicted: baseline -> + data balance -> + balanced partition -> + adaptive recompute.

Each row changes one thing over the row before it, exactly as in OmniBal's Table (6B + 20B on
Megatron-DeepSpeed: 61.8 -> 51.9 -> 29.0 -> 21.3 GPU days):

1. **baseline**: InternVL-Chat's fixed micro-batches (4 samples, padded to the longest) from its
   length-grouped sampler (``--group_by_length``, on in its InternVL-1.5 fine-tuning scripts;
   ``--baseline-sampler random``: a plain shuffle), the vision-first split (the vision encoder and
   projector on stage 0, the LLM split evenly over the rest; ``--baseline-partition even``: equal layer
   counts), every layer checkpointed (full recompute);
2. **+ data balance**: omnibal's balanced packs (variable sample count, equal vision and LLM cost per
   micro-batch and per rank), same split, full recompute;
3. **+ balanced partition**: the exact min-max partition (stage times include the full recompute) and the
   simulator-scored neighbour search, still full recompute;
4. **+ adaptive recompute**: the joint partition + least-recompute plan under the memory budget, with
   the same search; whole layers recomputed, as in the paper;
   **+ selective recompute** (omnibal's, when the engine expresses it): the same with selective recompute
   of transformer blocks as a third choice per layer (``omnibal.train.recompute``);
5. **+ pack size** (omnibal's, not in the paper; only when the pack-size search, ``plan.packsize``, picks
   another pack than rows 2-4's): micro-batches per step and samples per pack searched together with the
   partition and recompute at the same samples per step. The paper's columns stay empty on it;
6. **+ interleaved schedule** (omnibal's, not in the paper; only when the planner's interleaved 1F1B,
   ``plan.interleaved``, is faster than the plain plan on the same micro-batches): the joint partition +
   recompute over ``P x chunks`` virtual stages, run by Megatron's interleaved 1F1B, which shrinks the
   pipeline's fill and drain at the price of more activations in flight.

Every row is simulated over the whole epoch with its own data, so step counts may differ between rows
(the balancer packs a different number of samples per step); GPU days compare whole epochs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from omnibal.tables import fixed, markdown_table

PAPER_GPU_DAYS = {"baseline": 61.8, "+ data balance": 51.9, "+ balanced partition": 29.0,
                  "+ adaptive recompute": 21.3}
"""OmniBal, InternVL-Chat-1.5 (6B + 20B), Megatron-DeepSpeed, A100 (the paper's ablation)."""
ROW_NAMES = tuple(PAPER_GPU_DAYS)


@dataclass(frozen=True, kw_only=True)
class AblationRow:
    """One configuration of the ablation, simulated over its whole epoch."""

    name: str
    """Row label (one of ROW_NAMES)."""
    data: str
    """How micro-batches are formed."""
    partition: str
    """How layers are split into stages."""
    recompute: str
    """How checkpoints are chosen."""
    parts: tuple[int, ...]
    """Cut points."""
    num_checkpointed: int
    """Layers recomputed whole, in total (over all stages)."""
    num_selective: int = 0
    """Blocks under selective recompute, in total."""
    num_steps: int
    """Steps in the epoch."""
    step_time_s: float
    """Mean simulated seconds per step."""
    epoch_time_s: float
    """Simulated seconds for the epoch."""
    gpu_days: float
    """epoch_time_s * num_gpus / 86400."""
    bubble: float
    """Mean pipeline bubble share."""
    peak_memory_bytes: tuple[float, ...]
    """Per stage, the highest simulated peak over the epoch."""
    oom: bool
    """Whether the simulator saw any device above the memory budget."""
    speedup: float = 1.0
    """Baseline GPU days / this row's GPU days."""
    paper_gpu_days: float | None = None
    """The paper's figure for this row."""

    @property
    def paper_speedup(self) -> float | None:
        if self.paper_gpu_days is None:
            return None
        return PAPER_GPU_DAYS["baseline"] / self.paper_gpu_days

    def to_dict(self) -> dict:
        out = asdict(self)
        out["parts"] = list(self.parts)
        out["peak_memory_bytes"] = list(self.peak_memory_bytes)
        out["paper_speedup"] = self.paper_speedup
        return out


PAPER_MODEL = "internvl-chat-1.5"
"""The model of the paper's ablation: its figures are shown only next to plans of this model."""


def with_speedups(rows: list[AblationRow], model: str = PAPER_MODEL) -> list[AblationRow]:
    """Fill ``speedup`` (vs the first row) and, for the paper's model, the paper's figures."""
    from dataclasses import replace

    base = rows[0].gpu_days
    return [replace(r, speedup=base / r.gpu_days if r.gpu_days > 0 else float("nan"),
                    paper_gpu_days=PAPER_GPU_DAYS.get(r.name) if model == PAPER_MODEL else None) for r in rows]


def ablation_markdown(rows: list[AblationRow], *, show_paper: bool | None = None) -> str:
    """The ablation as a markdown table (what ``omnibal plan`` prints and the report embeds); the paper's
    columns appear when the rows carry its figures (``show_paper`` None), with our cumulative speed-up
    relative to the paper's on the same row."""
    if show_paper is None:
        show_paper = any(r.paper_gpu_days is not None for r in rows)
    head = ["step", "partition (cut points)", "layers recomputed (whole + selective)", "step time (s)", "bubble",
            "GPU days", "speed-up"]
    if show_paper:
        head += ["paper GPU days", "paper speed-up", "ours vs paper"]
    table = [head]
    for r in rows:
        recomputed = f"{r.num_checkpointed} + {r.num_selective}" if r.num_selective else f"{r.num_checkpointed}"
        line = [r.name, str(list(r.parts)), recomputed, fixed(r.step_time_s, 2), f"{r.bubble:.1%}",
                f"{fixed(r.gpu_days, 1)}{' (OOM)' if r.oom else ''}", f"{r.speedup:.2f}x"]
        if show_paper:
            paper = "" if r.paper_gpu_days is None else f"{r.paper_gpu_days:.1f}"
            ps = "" if r.paper_speedup is None else f"{r.paper_speedup:.2f}x"
            gap = "" if r.paper_speedup is None or r.name == "baseline" else f"{r.speedup / r.paper_speedup - 1:+.0%}"
            line += [paper, ps, gap]
        table.append(line)
    return markdown_table(table)
