"""Resume on another DP size: re-balance what the old world had not trained yet, for the new world.

The trainer's schedule is fixed per world (``dp_size`` x micro-batches), so a checkpoint's ``next_step``
means nothing to a schedule built for another ``dp_size``. A checkpoint of a run on the balancer's schedule
therefore records how that schedule was built (:func:`balance_record`: layout, seed, epoch, balance config,
stats fingerprint, and -- after an earlier reshard -- the rows and step offset of its remainder). On resume
with ``reshard=True`` the trainer rebuilds the old stream from that record alone, checks it against the
checkpoint's schedule fingerprint, and hands the untrained rest of the epoch to
:class:`omnibal.data.sampler.BalancedBatchSampler` (``load_state_dict(reshard=True)``), which re-balances
exactly those samples for the new ``dp_size`` with the same balancer, seed and config. The result is a
:class:`ResumedSchedule`: steps ``< step_offset`` belong to the old world (already trained), later steps
are the re-balanced remainder. Deterministic: every rank (and every retry) gets the same remainder.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from omnibal.data.balance.api import BalanceConfig
from omnibal.data.balance.cost import BalanceCost
from omnibal.data.balance.schedule import Schedule
from omnibal.data.sampler import BalancedBatchSampler
from omnibal.errors import InputError
from omnibal.validate import is_int

if TYPE_CHECKING:
    from omnibal.train.feed import ScheduleLike


@dataclass(frozen=True, eq=False)
class ResumedSchedule:
    """The rest of an epoch re-balanced for a new world, numbered after the steps the old world trained.

    ``microbatch(step, ...)`` of step ``step_offset + s`` is micro-batch ``s`` of ``inner`` (a schedule over
    ``stats.take(rows)``, mapped back to dataset rows; ``rows`` None: over the dataset rows themselves). The
    steps before ``step_offset`` run nothing: they only keep the step numbers of the old world's epoch. A
    multi-level ``inner`` keeps its levels, SP degrees and micro-batch counts (:meth:`step_sp`,
    :meth:`step_microbatches`, numbered the same way)."""

    inner: ScheduleLike
    rows: np.ndarray | None
    step_offset: int
    source: str = "<resharded schedule>"
    record: dict | None = None
    """How to build it again (:mod:`omnibal.train.reshard_kinds`; None: the balancer's, :func:`balance_record`)."""

    @property
    def dp_size(self) -> int:
        return self.inner.dp_size

    @property
    def num_microbatches(self) -> int:
        return self.inner.num_microbatches

    @property
    def caps(self):
        return self.inner.caps

    @property
    def num_steps(self) -> int:
        return self.step_offset + self.inner.num_steps

    # levels of a multi-level inner (the steps before step_offset count as level 0: they never run)
    @property
    def levels(self):
        own = getattr(self.inner, "levels", None)
        return None if own is None else (0,) * self.step_offset + tuple(own)

    @property
    def level_sp(self):
        return getattr(self.inner, "level_sp", None)

    @property
    def level_microbatches(self):
        return getattr(self.inner, "level_microbatches", None)

    @property
    def meta(self) -> dict:
        return getattr(self.inner, "meta", {})

    @property
    def epoch(self) -> int:
        return int(getattr(self.inner, "epoch", 0))

    def step_sp(self) -> np.ndarray:
        own = self.inner.step_sp() if hasattr(self.inner, "step_sp") else np.ones(self.inner.num_steps, np.int64)
        return np.concatenate([np.ones(self.step_offset, np.int64), np.asarray(own, np.int64)])

    def step_microbatches(self) -> np.ndarray:
        own = getattr(self.inner, "step_microbatches", None)
        own = own() if own is not None else np.full(self.inner.num_steps, self.inner.num_microbatches, np.int64)
        return np.concatenate([np.full(self.step_offset, self.num_microbatches, np.int64), np.asarray(own, np.int64)])

    def leader_mask(self) -> np.ndarray:
        """The inner's: the rows of ``pack_ids`` (its own steps only)."""
        return self.inner.leader_mask()

    # CSR view (dataset rows): fingerprints, index checks and buffer shapes read the inner's steps only (the
    # steps before step_offset have no micro-batches to read)
    @functools.cached_property
    def _csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        inner = self.inner
        if getattr(inner, "pack_ids", None) is not None:
            return np.asarray(inner.pack_samples), np.asarray(inner.pack_offsets), np.asarray(inner.pack_ids)
        shape = (inner.num_steps, inner.dp_size, inner.num_microbatches)
        mbs = [np.asarray(inner.microbatch(s, r, k), np.int64) for s, r, k in np.ndindex(*shape)]
        offsets = np.concatenate([[0], np.cumsum([len(mb) for mb in mbs], dtype=np.int64)]).astype(np.int64)
        samples = np.concatenate(mbs) if mbs else np.zeros(0, np.int64)
        return samples, offsets, np.arange(len(mbs), dtype=np.int64).reshape(shape)

    @property
    def pack_samples(self) -> np.ndarray:
        own = self._csr[0]
        return own if self.rows is None else self.rows[own]

    @property
    def pack_offsets(self) -> np.ndarray:
        return self._csr[1]

    @property
    def pack_ids(self) -> np.ndarray:
        return self._csr[2]

    def microbatch(self, step: int, dp_rank: int, micro: int) -> np.ndarray:
        if step < self.step_offset:
            raise InputError(f"step {step} was trained by the world before the reshard (this schedule starts at "
                             f"step {self.step_offset})", source=self.source, field="steps")
        own = self.inner.microbatch(step - self.step_offset, dp_rank, micro)
        return np.asarray(own) if self.rows is None else self.rows[own]


def balance_record(schedule) -> dict | None:
    """How ``schedule`` was built, enough to rebuild it from the stats; None when it is not the balancer's."""
    inner, rows, offset = schedule, None, 0
    if isinstance(schedule, ResumedSchedule):
        inner, rows, offset = schedule.inner, schedule.rows, schedule.step_offset
    config = getattr(inner, "meta", {}).get("config") if isinstance(getattr(inner, "meta", None), dict) else None
    if config is None or not getattr(inner, "stats_fingerprint", ""):
        return None
    return {"dp_size": int(inner.dp_size), "num_microbatches": int(inner.num_microbatches), "seed": int(inner.seed),
            "epoch": int(inner.epoch), "config": config, "rows": None if rows is None else rows.tolist(),
            "step_offset": int(offset)}


def _config_from_dict(d: dict, source: str):
    try:
        fields = dict(d)
        fields["cost"] = BalanceCost.from_dict(fields["cost"])
        return BalanceConfig(**fields)
    except (TypeError, KeyError, ValueError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"unreadable balance config: {exc}", source=source, field="sampler.balance") from exc


def _check_record(rec: dict, source: str) -> None:
    """The fields :func:`balance_record` writes, with their types (a manifest is input like any other)."""
    def bad(msg: str, field: str) -> InputError:
        return InputError(msg, source=source, field=f"sampler.balance.{field}")

    for name, low in (("dp_size", 1), ("num_microbatches", 1), ("seed", 0), ("epoch", 0), ("step_offset", 0)):
        value = rec.get(name)
        if not is_int(value) or value < low:
            raise bad(f"must be an integer >= {low}, got {value!r:.60}", name)
    if not isinstance(rec.get("config"), dict):
        raise bad("must be the balance config (an object)", "config")
    rows = rec.get("rows")
    if rows is not None and (not isinstance(rows, list) or not all(is_int(r)
                                                                   and r >= 0 for r in rows)):
        raise bad("must be null or a list of row indices", "rows")


def _fingerprints(schedule, fingerprint) -> tuple[str, ...]:
    """The fingerprints ``schedule`` has as built and as read back from its JSON form: a schedule file (``omnibal
    balance --out``) numbers its packs in the order of their slots, so the same micro-batches hash differently
    from the balancer's own arrays."""
    own = fingerprint(schedule)
    if not isinstance(schedule, Schedule):
        return (own,)
    return own, fingerprint(Schedule.from_dict(json.loads(schedule.to_json())))


def reshard_schedule(manifest: dict, stats, *, dp_size: int, num_microbatches: int, source: str,
                     fingerprint):
    """The rest of the checkpoint's epoch, re-balanced for ``dp_size`` x ``num_microbatches`` (a
    :class:`ResumedSchedule`; with the checkpoint's own layout, its own schedule rebuilt).

    ``fingerprint`` is :func:`omnibal.train.feed.schedule_fingerprint` (to check the rebuilt old schedule
    is the one the checkpoint was trained on)."""
    sampler = manifest.get("sampler") or {}
    rec = sampler.get("balance")
    if not isinstance(rec, dict):
        raise InputError("checkpoint does not record how its schedule was built (not the balancer's schedule, or "
                         "written by an older omnibal): it can only resume on the same dp x pp", source=source,
                         field="sampler.balance")
    if stats is None:
        raise InputError("resharding needs the dataset's statistics on global rank 0", source=source,
                         field="dataset")
    _check_record(rec, source)
    config = _config_from_dict(rec["config"], source)
    old_rows = None if rec.get("rows") is None else np.asarray(rec["rows"], np.int64)
    offset = int(rec.get("step_offset", 0))
    next_step = int(sampler["next_step"])
    # the old world's stream, rebuilt from the record alone; it must be the stream the checkpoint trained
    old = BalancedBatchSampler(stats, dp_rank=0, dp_size=rec["dp_size"], num_microbatches=rec["num_microbatches"],
                               seed=rec["seed"], epoch=rec["epoch"], config=config)
    old._remainder = None if old_rows is None else old._check_remainder({"rows": old_rows.tolist()})
    old_inner, _ = old.schedule()
    old_schedule = old_inner if old_rows is None else ResumedSchedule(old_inner, old_rows, offset)
    if sampler.get("schedule_fingerprint") not in _fingerprints(old_schedule, fingerprint):
        raise InputError("rebuilding the checkpoint's schedule from its record gave another schedule (other stats "
                         "or balancer version?): cannot tell which samples are left", source=source,
                         field="sampler.schedule_fingerprint")
    if not offset <= next_step <= old_schedule.num_steps:
        raise InputError(f"next_step {next_step} outside the checkpoint's schedule [{offset}, "
                         f"{old_schedule.num_steps}]", source=source, field="sampler.next_step")
    if rec["dp_size"] == dp_size and rec["num_microbatches"] == num_microbatches:
        return old_schedule  # same layout: continue the checkpoint's own stream (e.g. an earlier remainder)
    state = old.state_dict()
    state["consumed_microbatches"] = (next_step - offset) * int(rec["num_microbatches"])
    new = BalancedBatchSampler(stats, dp_rank=0, dp_size=dp_size, num_microbatches=num_microbatches,
                               seed=rec["seed"], epoch=rec["epoch"], config=config)
    new.load_state_dict(state, reshard=True)  # re-balances exactly the untrained rest for the new world
    inner, rows = new.schedule()
    return ResumedSchedule(inner, np.asarray(rows, np.int64), next_step,
                           f"rest of the epoch after step {next_step}, re-balanced for dp_size {dp_size}")
