"""Summaries of a `SampleStats` table: counts, means, percentiles and histograms, as data, text or a PNG."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from omnibal.outputs import atomic_path, image_format
from omnibal.stats.table import SampleStats

PERCENTILES = (50, 90, 99)
# Token bins double in width: SFT lengths spread over two orders of magnitude.
TOKEN_BIN_EDGES = (1, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 16384, 32768)


@dataclass(frozen=True, kw_only=True)
class ColumnSummary:
    """Distribution of one column."""

    total: int
    mean: float
    min: int
    max: int
    percentiles: dict[int, float]
    """Percentile -> value (numpy's linear interpolation)."""


@dataclass(frozen=True, kw_only=True)
class StatsSummary:
    """What a stats table holds, in numbers a person reads."""

    source: str
    num_samples: int
    num_text_only: int
    """Samples without a real image (they may still carry a dummy tile)."""
    num_multi_image: int
    tiles: ColumnSummary
    tokens: ColumnSummary
    images: ColumnSummary
    tiles_histogram: dict[int, int]
    """Tiles per sample -> number of samples (every value that occurs)."""
    tokens_histogram: list[tuple[int, int, int]] = field(default_factory=list)
    """``(lo, hi, count)``: samples with ``lo <= tokens < hi``."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tiles_histogram"] = {str(k): v for k, v in self.tiles_histogram.items()}
        return d

    def to_text(self) -> str:
        n = self.num_samples
        out = [
            f"{self.source}: {n:,} samples, {n - self.num_text_only:,} with images "
            f"({self.num_multi_image:,} multi-image), {self.num_text_only:,} text-only",
            "",
            f"{'':8}{'total':>14}{'mean':>10}{'min':>8}"
            + "".join(f"{'p' + str(p):>8}" for p in self.tiles.percentiles)
            + f"{'max':>9}",
        ]
        for name, col in (("tiles", self.tiles), ("tokens", self.tokens), ("images", self.images)):
            out.append(
                f"{name:8}{col.total:>14,}{col.mean:>10.2f}{col.min:>8,}"
                + "".join(f"{v:>8,.0f}" for v in col.percentiles.values())
                + f"{col.max:>9,}"
            )
        out += ["", "tiles per sample"]
        out += _bars([(str(k), c) for k, c in self.tiles_histogram.items()], n)
        out += ["", "tokens per sample"]
        out += _bars([(f"[{lo:,}, {hi:,})", c) for lo, hi, c in self.tokens_histogram], n)
        return "\n".join(out)


def _bars(rows: list[tuple[str, int]], total: int, width: int = 40) -> list[str]:
    label_w = max((len(r[0]) for r in rows), default=0)
    top = max((c for _, c in rows), default=1) or 1
    return [
        f"  {label:>{label_w}} {count:>10,} {100 * count / max(total, 1):5.1f}% {'#' * round(width * count / top)}"
        for label, count in rows
    ]


def _column(values: np.ndarray, percentiles) -> ColumnSummary:
    v = values.astype(np.int64)
    return ColumnSummary(
        total=int(v.sum()),
        mean=float(v.mean()),
        min=int(v.min()),
        max=int(v.max()),
        percentiles={int(p): float(x) for p, x in zip(percentiles, np.percentile(v, percentiles))},
    )


def summarize(stats: SampleStats, *, percentiles=PERCENTILES) -> StatsSummary:
    """Counts, means, percentiles and histograms of ``stats`` (vectorised: a full mixture in well under a second)."""
    if len(stats) == 0:
        raise ValueError("cannot summarise an empty table")
    tiles_counts = np.bincount(stats.tiles)
    edges = np.array(TOKEN_BIN_EDGES + (max(int(stats.tokens.max()) + 1, TOKEN_BIN_EDGES[-1] + 1),))
    edges = edges[: np.searchsorted(edges, stats.tokens.max(), side="right") + 1]
    token_counts = np.histogram(stats.tokens, bins=edges)[0]
    return StatsSummary(
        source=stats.source,
        num_samples=len(stats),
        num_text_only=int((stats.images == 0).sum()),
        num_multi_image=int((stats.images > 1).sum()),
        tiles=_column(stats.tiles, percentiles),
        tokens=_column(stats.tokens, percentiles),
        images=_column(stats.images, percentiles),
        tiles_histogram={int(k): int(c) for k, c in enumerate(tiles_counts) if c},
        tokens_histogram=[(int(lo), int(hi), int(c)) for lo, hi, c in zip(edges[:-1], edges[1:], token_counts)],
    )


def plot_histograms(stats: SampleStats, path: str | Path, *, title: str | None = None) -> Path:
    """A PNG with the tiles histogram (one bar per value) and the tokens histogram."""
    from matplotlib.figure import Figure  # no pyplot: its global backend and figure registry stay untouched

    fig = Figure(figsize=(11, 4))
    ax_t, ax_k = fig.subplots(1, 2)
    counts = np.bincount(stats.tiles)
    ax_t.bar(np.arange(len(counts)), counts, color="#3b75af")
    ax_t.set_xlabel("vision tiles per sample")
    ax_t.set_ylabel("samples")
    ax_t.set_xticks(np.arange(len(counts)))
    ax_k.hist(stats.tokens, bins=min(100, max(10, len(stats) // 50)), color="#d0743c")
    ax_k.set_xlabel("LLM tokens per sample")
    ax_k.set_ylabel("samples")
    fig.suptitle(title or f"{stats.source} ({len(stats):,} samples)")
    fig.tight_layout()

    out = Path(path)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=100, format=image_format(out) or "png")
    return out
