"""Balanced dynamic mini-batches: omnibal's balancer, faithful ISF and baselines behind one interface.

    from omnibal.data.balance import balance, BalanceConfig
    schedule = balance(stats, dp_size=32, num_microbatches=1, seed=0, epoch=0)
    schedule.to_json("schedule.json")

See ``docs/balance.md`` for the algorithm, the schedule JSON and the metrics.
"""

from omnibal.data.balance.api import BalanceConfig, balance
from omnibal.data.balance.common import epoch_rng
from omnibal.data.balance.cost import DEFAULT_COST, BalanceCost
from omnibal.data.balance.schedule import FORMAT, Caps, Schedule

__all__ = ["balance", "BalanceConfig", "BalanceCost", "DEFAULT_COST", "Schedule", "Caps", "FORMAT",
           "epoch_rng"]
