"""`BalancedBatchSampler`: one DP rank's micro-batches of a balanced schedule, as a torch BatchSampler.

It yields lists of dataset indices, one list per micro-batch, in step order: step 0 micro-batch 0..M-1,
step 1, ... Every rank builds the same schedule from (stats, config, seed, epoch) on its own -- no
torch.distributed call, no communication -- and takes its own row of it. The DataLoader iterates the batch
sampler in the main process and hands index lists to its workers, so workers need nothing from it.

Resume: ``state_dict()`` records the epoch, the micro-batches this rank has *trained*, and what the schedule
depends on (stats fingerprint, dp_size, micro-batches per step, seed, config). ``load_state_dict`` refuses
a state from other stats or another world layout with an InputError -- unless ``reshard=True``: then the
samples the old world had not consumed yet are re-balanced deterministically for the new ``dp_size`` (the
same remainder on every rank), and the epoch finishes on the new world exactly once per sample.

Trained, not handed out: a DataLoader with workers pulls ``num_workers x prefetch_factor`` micro-batches
ahead of the training loop, so the count the sampler has handed out runs ahead of what was trained, and a
checkpoint of it would skip the prefetched micro-batches on resume. The training loop therefore reports
what it finished with ``mark_trained(n)`` (e.g. ``n = num_microbatches`` after each optimizer step). Once
it does, ``state_dict()`` records that count and a new iteration starts after the last trained
micro-batch. A loop that never calls it gets the handed-out count, which is exact only with
``num_workers=0`` (nothing is pulled ahead).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from omnibal.data.balance.api import BalanceConfig, balance
from omnibal.errors import InputError

STATE_VERSION = 1


def _config_hash(config: BalanceConfig) -> str:
    return hashlib.blake2b(json.dumps(config.to_dict(), sort_keys=True).encode(), digest_size=8).hexdigest()


class BalancedBatchSampler:
    """Micro-batches of rank ``dp_rank`` (see the module docstring). Iterating resumes where it stopped."""

    def __init__(self, stats, *, dp_rank: int, dp_size: int, num_microbatches: int = 1, seed: int = 0,
                 epoch: int = 0, config: BalanceConfig | None = None) -> None:
        if not isinstance(dp_size, int) or dp_size < 1:
            raise InputError(f"must be a positive integer, got {dp_size!r}", source="dp_size", field="dp_size")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise InputError(f"must be in [0, {dp_size}), got {dp_rank!r}", source="dp_rank", field="dp_rank")
        self.stats = stats
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.num_microbatches = num_microbatches
        self.seed = seed
        self.config = config or BalanceConfig()
        self._fingerprint = stats.fingerprint()
        self._epoch = int(epoch)
        self._issued = 0  # micro-batches of this rank handed out (to a DataLoader) in the current epoch
        self._trained = 0  # ... of which the training loop reported trained (mark_trained)
        self._tracking = False  # whether the training loop reports trained micro-batches at all
        self._remainder: dict | None = None  # set after a reshard: rows and layout of the rest of the epoch
        self._cache: tuple | None = None

    # -- schedule -----------------------------------------------------------------------------------
    def schedule(self):
        """The schedule this rank's stream comes from (cached per epoch)."""
        key = (self._epoch, json.dumps(self._remainder, sort_keys=True) if self._remainder else None)
        if self._cache is None or self._cache[0] != key:
            if self._remainder is None:
                sched = balance(self.stats, dp_size=self.dp_size, num_microbatches=self.num_microbatches,
                                seed=self.seed, epoch=self._epoch, config=self.config)
                rows = None
            else:
                rows = np.asarray(self._remainder["rows"], np.int64)
                sched = balance(self.stats.take(rows), dp_size=self.dp_size, num_microbatches=self.num_microbatches,
                                seed=self.seed, epoch=self._epoch, config=self.config)
            self._cache = (key, sched, rows)
        return self._cache[1], self._cache[2]

    def _stream(self) -> list[np.ndarray]:
        sched, rows = self.schedule()
        packs = sched.pack_ids[:, self.dp_rank, :].reshape(-1)
        out = [sched.pack(int(k)) for k in packs]
        return [rows[mb] if rows is not None else mb for mb in out]

    # -- torch BatchSampler protocol ----------------------------------------------------------------
    def __iter__(self):
        stream = self._stream()
        if self._tracking:  # handed out but never trained (prefetched by an iterator now gone): again
            self._issued = self._trained
        while self._issued < len(stream):
            mb = stream[self._issued]
            self._issued += 1
            yield mb.tolist()

    def __len__(self) -> int:
        sched, _ = self.schedule()
        return sched.num_steps * self.num_microbatches

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (a new shuffle)."""
        if int(epoch) != self._epoch or self._remainder is not None:
            self._issued = self._trained = 0
        self._epoch = int(epoch)
        self._remainder = None

    # -- resume -------------------------------------------------------------------------------------
    def mark_trained(self, num_microbatches: int = 1) -> None:
        """Report that the training loop finished the next ``num_microbatches`` micro-batches it received
        from this sampler (see the module docstring); from now on ``state_dict()`` records this count."""
        n = int(num_microbatches)
        if n < 0 or self._trained + n > self._issued:
            raise InputError(f"{self._trained} of {self._issued} micro-batches handed out are trained; "
                             f"{num_microbatches!r} more cannot be", source="mark_trained",
                             field="num_microbatches")
        self._tracking = True
        self._trained += n

    @property
    def trained_microbatches(self) -> int:
        """Micro-batches of the current epoch the state records: trained (reported by ``mark_trained``),
        or handed out while the training loop reports nothing."""
        return self._trained if self._tracking else self._issued

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "epoch": self._epoch, "consumed_microbatches": self.trained_microbatches,
                "dp_size": self.dp_size, "num_microbatches": self.num_microbatches, "seed": self.seed,
                "stats_fingerprint": self._fingerprint, "config_hash": _config_hash(self.config),
                "remainder": self._remainder}

    def load_state_dict(self, state: dict, *, reshard: bool = False) -> None:
        """Continue exactly where ``state`` stopped. With ``reshard=True`` a state from another ``dp_size``
        (or micro-batch count) is accepted: the rest of its epoch is re-balanced for this world."""
        for key in ("epoch", "consumed_microbatches", "dp_size", "num_microbatches", "seed", "stats_fingerprint"):
            if key not in state:
                raise InputError(f"sampler state lacks {key!r}", source="state_dict", field=key)
        if state["stats_fingerprint"] != self._fingerprint:
            raise InputError("sampler state comes from other stats (fingerprint "
                             f"{state['stats_fingerprint']} != {self._fingerprint})", source="state_dict",
                             field="stats_fingerprint")
        if state["seed"] != self.seed or state.get("config_hash", _config_hash(self.config)) != _config_hash(self.config):
            raise InputError("sampler state was made with another seed or balance config", source="state_dict",
                             field="seed")
        same_world = state["dp_size"] == self.dp_size and state["num_microbatches"] == self.num_microbatches
        if not same_world and not reshard:
            raise InputError(f"sampler state is for dp_size={state['dp_size']} x {state['num_microbatches']} "
                             f"micro-batches, this sampler has dp_size={self.dp_size} x {self.num_microbatches}; "
                             f"pass reshard=True to re-balance the rest of the epoch", source="state_dict",
                             field="dp_size")
        self._epoch = int(state["epoch"])
        self._remainder = state.get("remainder")
        if same_world:
            self._issued = self._trained = int(state["consumed_microbatches"])
            return
        # the old world's stream, rebuilt from the state alone, minus what it consumed
        old = BalancedBatchSampler(self.stats, dp_rank=0, dp_size=state["dp_size"],
                                   num_microbatches=state["num_microbatches"], seed=self.seed,
                                   epoch=self._epoch, config=self.config)
        old._remainder = self._remainder
        sched, rows = old.schedule()
        k = int(state["consumed_microbatches"])
        step, micro = divmod(k, sched.num_microbatches)
        left = [sched.pack(int(p)) for p in sched.pack_ids[step + 1:].reshape(-1)]
        if step < sched.num_steps:
            left += [sched.pack(int(p)) for p in sched.pack_ids[step, :, micro:].reshape(-1)]
        remaining = np.sort(np.concatenate(left)) if left else np.zeros(0, np.int64)
        if rows is not None:
            remaining = np.sort(rows[remaining])
        if len(remaining) < self.dp_size * self.num_microbatches:
            raise InputError(f"only {len(remaining)} samples left in the epoch, fewer than dp_size x micro-batches "
                             f"= {self.dp_size * self.num_microbatches}; start the next epoch instead",
                             source="state_dict", field="dp_size")
        self._remainder = {"rows": remaining.tolist()}
        self._issued = self._trained = 0
