"""Step-time simulation of DP x PP schedules, and reports.

Layers, cheapest first:

* :mod:`omnibal.sim.pipeline_order`: the pure pipeline engine (GPipe / 1F1B op times from per-op durations,
  vectorised over any batch axes).
* :mod:`omnibal.sim.step`: DP x PP steps (slowest rank per stage group, ring all-reduce, memory, OOM).
* :mod:`omnibal.sim.costs`: a :class:`~omnibal.cost.table.LayerCostTable` + cut points + recompute mask +
  micro-batch features -> per-stage op times and bytes.
* :mod:`omnibal.sim.epoch`: an epoch's totals and GPU days; ``score_plan`` for the planner.
* :mod:`omnibal.sim.report`: markdown + PNG (pipeline timeline, per-rank load histograms).
"""

from omnibal.sim.calibrate import Calibration, CalibrationRun, calibrate, rank_jitter
from omnibal.sim.costs import (
    SimConfig,
    StageCosts,
    config_for_hardware,
    cuts_from_starts,
    even_cuts,
    recompute_mask_from_counts,
    stage_costs,
    validate_cuts,
)
from omnibal.sim.epoch import EpochResult, PlanScore, score_plan, simulate_epoch, simulate_one_step
from omnibal.sim.pipeline_order import PipelineTimes, peak_inflight, simulate_pipeline
from omnibal.sim.step import StepTimes, ring_allreduce_time, simulate_steps

__all__ = [
    "Calibration", "CalibrationRun", "EpochResult", "PipelineTimes", "PlanScore", "SimConfig",
    "StageCosts", "StepTimes", "config_for_hardware", "calibrate", "rank_jitter", "cuts_from_starts", "even_cuts",
    "peak_inflight", "recompute_mask_from_counts", "ring_allreduce_time",
    "score_plan", "simulate_epoch", "simulate_one_step", "simulate_pipeline", "simulate_steps", "stage_costs",
    "validate_cuts",
]
