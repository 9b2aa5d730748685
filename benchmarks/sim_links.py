"""Measure the gloo links of this machine (CPU ranks): point-to-point and all-reduce latency/bandwidth.

The communication half of the simulator's calibration (``bench_sim_validation``, ``bench_train``,
``bench_plan_cpu``). The measurement is :func:`omnibal.measure.links.measure_links` (its one owner, which the
benchmarks import directly); this script prints its result as JSON.

    python -m benchmarks.sim_links
"""

from __future__ import annotations

import json
import sys

from omnibal.measure.links import fit_line, measure_links

__all__ = ["fit_line", "measure_links"]

if __name__ == "__main__":
    json.dump(measure_links(), sys.stdout, indent=2)
    print()
