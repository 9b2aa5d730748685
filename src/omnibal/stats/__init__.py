"""Per-sample statistics: the table every other layer reads, its file formats, summaries and generators."""

from omnibal.stats.io import LoadReport, detect_format, load_stats, read_stats, save_stats
from omnibal.stats.summary import StatsSummary, plot_histograms, summarize
from omnibal.stats.synthetic import SyntheticConfig, synthetic_internvl_mixture
from omnibal.stats.table import SampleStats
from omnibal.stats.tiles import TileConfig, count_tiles

__all__ = [
    "LoadReport",
    "SampleStats",
    "StatsSummary",
    "SyntheticConfig",
    "TileConfig",
    "count_tiles",
    "detect_format",
    "load_stats",
    "plot_histograms",
    "read_stats",
    "save_stats",
    "summarize",
    "synthetic_internvl_mixture",
]
