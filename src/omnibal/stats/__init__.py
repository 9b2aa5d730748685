"""Per-sample statistics: the table every other layer reads."""

from omnibal.stats.table import SampleStats

__all__ = ["SampleStats"]
