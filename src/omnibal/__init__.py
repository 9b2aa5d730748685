"""omnibal: balance data, pipeline partition and memory for distributed VLM instruction tuning.

The package is layered the way the data flows (see docs/architecture.md):
``stats`` -> ``data`` (balance, sampler, collate) -> ``cost`` -> ``plan`` (partition, recompute)
-> ``sim`` -> ``train``. Each layer is importable on its own and returns plain, serialisable results.
"""

from omnibal.errors import InputError, OmnibalError
from omnibal.stats.table import SampleStats

__version__ = "0.1.0"

__all__ = ["InputError", "OmnibalError", "SampleStats", "__version__"]
