"""omnibal: balance data, pipeline partition and memory for distributed VLM instruction tuning.

The package is layered (see docs/architecture.md; lower layers never import higher ones):
``errors``/``outputs``/``validate``/``tables`` -> ``stats`` -> ``cost`` -> ``data``/``sim`` -> ``plan``/``train``
-> ``measure``/``integrations``/``examples`` -> ``cli``. Each layer is importable on its own and returns plain,
serialisable results.
"""

from omnibal.errors import InputError, OmnibalError
from omnibal.stats.table import SampleStats

__version__ = "0.1.0"

__all__ = ["InputError", "OmnibalError", "SampleStats", "__version__"]
