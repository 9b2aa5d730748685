"""HBP (Hierarchical Balance Packing): several packing levels of different pack lengths in one schedule, each
with its own sequence-parallel degree, partition recompute and static buffer (Yao et al. 2025).

One package, one file per concept, lowest first:

* :mod:`omnibal.hbp.levels`: HBP's settings (:class:`~omnibal.hbp.levels.HBPConfig`), the estimate of what a
  level of one length and SP degree costs, and the set of levels of least estimated time;
* :mod:`omnibal.hbp.packing`: one level packed under its length by the existing balancer;
* :mod:`omnibal.hbp.balance`: the multi-level schedule: samples to levels, levels packed, steps interleaved,
  and the rows left for a resume or reshard;
* :mod:`omnibal.hbp.sp_cost`: what sequence parallelism costs a level: Ulysses all-to-all, per-rank work,
  the memory limit and the recompute price of a per-rank length;
* :mod:`omnibal.hbp.planning`: per-level planning: the level estimate's inputs, the partition and each
  level's recompute, priced by the step-time simulator;
* :mod:`omnibal.hbp.search`: the simulator-scored search over level lengths, SP degrees and partition;
* :mod:`omnibal.hbp.bound`: the bound: how much HBP can gain over the single level at most, under the cost
  model.

It sits with ``plan`` and ``train`` (layer 4): planning needs the planner and the simulator, and the trainer
rebuilds and reshards HBP schedules with :mod:`omnibal.hbp.balance`. ``omnibal plan --hbp`` as a library call
is :mod:`omnibal.jobs.hbp`. This file imports nothing, so the trainer importing the balancer does not load the
planner.
"""
