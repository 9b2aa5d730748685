"""Per-sample statistics: the table every other layer reads, its file formats and generators."""

from omnibal.stats.io import LoadReport, detect_format, load_stats, read_stats, save_stats
from omnibal.stats.table import SampleStats

__all__ = ["LoadReport", "SampleStats", "detect_format", "load_stats", "read_stats", "save_stats"]
