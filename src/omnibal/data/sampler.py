"""`BalancedBatchSampler`: one DP rank's micro-batches of a balanced schedule, as a torch BatchSampler.

It yields lists of dataset indices, one list per micro-batch, in step order: step 0 micro-batch 0..M-1,
step 1, ... Every rank builds the same schedule from (stats, config, seed, epoch) on its own -- no
torch.distributed call -- and takes its own row of it. The DataLoader iterates the batch sampler in the main
process and hands index lists to its workers, so workers need nothing from it.

Cross-rank check: the schedule is a pure function of its inputs and independent of the machine, but a rank
given other statistics, config, seed or omnibal version builds another one, and the ranks would then train
their slots of different schedules (samples lost or repeated). ``schedule_fingerprint()`` identifies the
schedule this rank's stream comes from; given an ``exchange`` (a callable from this rank's fingerprint to
every rank's, in rank order: the trainer's collective, e.g.
:func:`omnibal.train.distributed.fingerprint_exchange`), every iteration checks, at its first micro-batch
and once per schedule, that all ranks built the same one, and raises
:class:`~omnibal.errors.ScheduleMismatch` naming the ranks that did not. The sampler itself never looks up
a process group; the exchange is a collective, so every rank must iterate (or call
``check_agreement()``) at the same point.

Semantics:

* **Re-iterable.** Each ``iter()`` yields the whole current epoch from its start (the same order every
  time: same epoch, same schedule), unless a *resume position* is pending; then it yields the rest of the
  epoch from there. A position is pending (a) after ``load_state_dict(state)`` on the same world, until the
  next iteration starts (takes its first micro-batch), and (b) while the training loop reports
  ``mark_trained`` and has trained only part of the epoch (an iteration left part-way, e.g. a DataLoader
  iterator that died with prefetched micro-batches): the next iteration restarts after the last trained
  micro-batch. An iteration left part-way by a loop that reports nothing, or one that ran to the end
  (with ``mark_trained``: whose micro-batches were all trained), leaves nothing pending. ``len()`` is
  always exactly the number of micro-batches the next ``iter()`` yields. Only the newest iteration moves
  the counters.
* **Epochs.** ``set_epoch(e)`` with ``e`` other than the current epoch starts epoch ``e`` from its beginning
  (a new shuffle) and forgets any resume position and reshard remainder. With the current epoch it changes
  nothing, so the usual resume loop ``load_state_dict(state); for epoch in range(state_epoch, N):
  set_epoch(epoch); ...`` continues the resumed (or resharded) epoch instead of training it again.
* **Fixed caps.** The micro-batch buffer (Q_v tiles, Q_t tokens; ``sampler.caps``) is chosen once per run
  and holds for every epoch, so a trainer sizes its buffers once. When the config fixes both
  ``max_tiles`` and ``max_tokens`` they are the caps. Otherwise epoch 0 is the balancer's own schedule
  (free cap search on the full stats) and its caps are the run's; every later epoch and every reshard
  remainder is balanced with ``max_tiles``/``max_tokens`` fixed to them. The balancer's fixed-cap search
  packs to the fewest packs that leave ``token_slack / 2`` of room, tighter than the packer can fill, so
  the sampler sets ``token_slack`` to the room epoch 0 had (later epochs aim at epoch 0's pack count) and,
  should a few packs still come out over a cap (the packer lets a pack overflow Q_t by a few tokens),
  balances the epoch again with 1% more room (deterministic,
  so all ranks agree; at most ``FIXED_CAP_TRIES`` tries, then an InputError naming the cap). Later epochs
  ask the balancer for epoch 0's step count (``BalanceConfig.num_steps``), so every epoch has the same
  length whenever it fits (a reshard remainder takes the fewest steps that fit it). No sample is dropped.
  Methods that cannot pack under caps (``random``, ``length-grouped``) are refused.

Resume: ``state_dict()`` records the epoch, the micro-batches this rank has *trained*, the caps and what
the schedule depends on (stats fingerprint, dp_size, micro-batches per step, seed, config). ``load_state_dict``
refuses a state from other stats, another seed/config, another world layout or other caps with an
InputError naming the field -- unless ``reshard=True`` (for another layout, whose caps differ too): then the
samples the old world had not consumed yet are re-balanced deterministically for this sampler's ``dp_size``
and caps (the same remainder on every rank), and the epoch finishes on the new world exactly once per
sample.

Trained, not handed out: a DataLoader with workers pulls ``num_workers x prefetch_factor`` micro-batches
ahead of the training loop (and even without workers the micro-batch in the loop's hands is handed out
before it is trained), so the count the sampler has handed out runs ahead of what was trained, and a
checkpoint of it would skip those micro-batches on resume. The training loop therefore reports what it
finished with ``mark_trained(n)`` (e.g. ``n = num_microbatches`` after each optimizer step), and
``state_dict()`` records only that count, whenever it is taken: before the first ``mark_trained`` it records
nothing trained in the epoch (the resume position, after a resume). A loop that never reports resumes at the
start of its epoch: samples trained again, never lost. ``trained_reported`` says whether the loop reports
(it decides where a re-iteration restarts, see "Re-iterable").

Every field of a state is checked before any is used (types, ranges, remainder rows distinct and inside
the statistics, consumed micro-batches inside the epoch): a bad state is an InputError naming the field,
never a replay, a skipped epoch or an IndexError.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from omnibal.data.balance.api import BalanceConfig, balance
from omnibal.errors import InputError, ScheduleMismatch
from omnibal.layout import BalanceMethod
from omnibal.validate import check_positive_int, is_int

if TYPE_CHECKING:
    from omnibal.data.balance.schedule import Schedule

STATE_VERSION = 3
"""3: the state says whether the training loop reports trained micro-batches (``trained_reported``)."""
READABLE_VERSIONS = (2, 3)
STATE_KEYS = ("version", "epoch", "consumed_microbatches", "trained_reported", "dp_size", "num_microbatches", "seed",
              "stats_fingerprint", "config_hash", "caps", "remainder")
FIXED_CAP_TRIES = 8
"""Tries of one epoch under the fixed caps, each with ``SLACK_STEP`` more room than the last."""
SLACK_STEP = 0.01
CAP_METHODS = (BalanceMethod.OMNIBAL, BalanceMethod.ISF, BalanceMethod.ISF_ASSIGN)
"""Balancer methods that pack under fixed caps (the others form micro-batches by sample count)."""


def _config_hash(config: BalanceConfig) -> str:
    return hashlib.blake2b(json.dumps(config.to_dict(), sort_keys=True).encode(), digest_size=8).hexdigest()


def _check_int(value, name: str, low: int) -> int:
    if not is_int(value) or value < low:
        raise InputError(f"must be an integer >= {low}, got {value!r}", source=name, field=name)
    return int(value)


def balance_under_caps(stats, *, dp_size: int, num_microbatches: int, seed: int, epoch: int,
                       config: BalanceConfig):
    """``balance()``; when the omnibal balancer cannot pack under a fixed cap, try again with
    ``SLACK_STEP`` more ``token_slack`` (more packs, more room), up to ``FIXED_CAP_TRIES`` tries."""
    fixed = config.max_tiles is not None or config.max_tokens is not None
    tries = FIXED_CAP_TRIES if fixed and config.method == "omnibal" else 1
    last, attempt = None, config
    for k in range(tries):
        if k and attempt.token_slack >= 0.49:  # no more room to give (BalanceConfig wants < 0.5)
            break
        attempt = dataclasses.replace(config, token_slack=min(config.token_slack + k * SLACK_STEP, 0.49))
        try:
            return balance(stats, dp_size=dp_size, num_microbatches=num_microbatches, seed=seed, epoch=epoch,
                           config=attempt if k else config)
        except InputError as exc:
            if exc.source != "caps" or tries == 1:
                raise
            last = exc
    raise InputError(f"epoch {epoch} does not pack under the caps (tiles {config.max_tiles}, tokens "
                     f"{config.max_tokens}) with token_slack up to {attempt.token_slack:.3f}: {last.message}",
                     source="caps", field=last.field) from last


@dataclasses.dataclass(frozen=True)
class CapPlan:
    """The run's caps and the config every schedule under them is balanced with."""

    caps: tuple[int, int]
    """(Q_v tiles, Q_t tokens) per micro-batch, for the whole run."""
    config: BalanceConfig
    """The user's config with both caps fixed (and, for omnibal, ``token_slack`` set to epoch 0's room)."""
    epoch0: Schedule | None
    """Epoch 0's schedule the caps come from (None when the user's config fixes both caps)."""


def plan_caps(stats, *, dp_size: int, num_microbatches: int, seed: int, config: BalanceConfig) -> CapPlan:
    """Choose the run's caps once (see the module docstring)."""
    if config.max_tiles is not None and config.max_tokens is not None:
        return CapPlan((int(config.max_tiles), int(config.max_tokens)), config, None)
    first = balance_under_caps(stats, dp_size=dp_size, num_microbatches=num_microbatches, seed=seed, epoch=0,
                               config=config)
    caps = (int(first.caps.tiles), int(first.caps.tokens))
    fixed = dataclasses.replace(config, max_tiles=caps[0], max_tokens=caps[1])
    if config.method == "omnibal":
        # the fixed-cap search takes the fewest packs whose mean load is <= Q_t (1 - token_slack / 2):
        # with epoch 0's room it takes epoch 0's pack count (minus a hair, so that count qualifies)
        used = np.ones(len(stats), bool)
        used[first.dropped] = False
        fill = float(stats.tokens[used].sum()) / (caps[1] * max(first.num_packs, 1))
        fixed = dataclasses.replace(fixed, token_slack=float(min(max(2 * (1 - fill) - 1e-6, 0.0), 0.49)),
                                    num_steps=int(first.num_steps))  # every epoch as long as epoch 0
    return CapPlan(caps, fixed, first)


class BalancedBatchSampler:
    """Micro-batches of rank ``dp_rank`` (see the module docstring for the semantics)."""

    def __init__(self, stats, *, dp_rank: int, dp_size: int, num_microbatches: int = 1, seed: int = 0,
                 epoch: int = 0, config: BalanceConfig | None = None,
                 exchange: Callable[[str], Sequence[str]] | None = None) -> None:
        check_positive_int(dp_size, "dp_size")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise InputError(f"must be in [0, {dp_size}), got {dp_rank!r}", source="dp_rank", field="dp_rank")
        self.config = config or BalanceConfig()
        if self.config.method not in CAP_METHODS:
            raise InputError(f"the sampler keeps one micro-batch buffer for the whole run, and method "
                             f"{self.config.method!r} does not pack under caps; use one of {', '.join(CAP_METHODS)}",
                             source="config", field="method")
        self.stats = stats
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.num_microbatches = _check_int(num_microbatches, "num_microbatches", 1)
        self.seed = _check_int(seed, "seed", 0)
        self._fingerprint = stats.fingerprint()
        self._epoch = _check_int(epoch, "epoch", 0)
        self._issued = 0  # position after the last micro-batch handed out (to a DataLoader) in this epoch
        self._trained = 0  # ... of which the training loop reported trained (mark_trained)
        self._tracking = False  # whether the training loop reports trained micro-batches at all
        self._pending: int | None = None  # resume position set by load_state_dict, until the next iter()
        self._generation = 0  # the newest iterator's number: only it moves the counters
        self._remainder: dict | None = None  # set after a reshard: rows of the rest of the epoch
        self._plan: CapPlan | None = None
        self._cache: dict | None = None
        self._exchange = exchange  # this rank's schedule fingerprint -> every rank's (see the module docstring)

    # -- caps and schedule --------------------------------------------------------------------------
    @property
    def caps(self) -> tuple[int, int]:
        """(Q_v tiles, Q_t tokens) of every micro-batch of every epoch of this run (chosen once)."""
        return self._cap_plan().caps

    def _cap_plan(self) -> CapPlan:
        if self._plan is None:
            self._plan = plan_caps(self.stats, dp_size=self.dp_size, num_microbatches=self.num_microbatches,
                                   seed=self.seed, config=self.config)
        return self._plan

    def schedule(self):
        """``(schedule, rows)`` this rank's stream comes from (cached): the epoch's schedule, or after a
        reshard the remainder's schedule over ``stats.take(rows)`` (``rows`` None otherwise)."""
        entry = self._entry(self._epoch, self._remainder)
        return entry["schedule"], entry["rows"]

    def _entry(self, epoch: int, remainder: dict | None) -> dict:
        c = self._cache
        if c is not None and c["epoch"] == epoch and c["remainder"] is remainder:
            return c
        plan = self._cap_plan()
        layout = dict(dp_size=self.dp_size, num_microbatches=self.num_microbatches, seed=self.seed, epoch=epoch)
        rows = None
        if remainder is not None:
            rows = np.asarray(remainder["rows"], np.int64)
            # the rest of an epoch has its own length: the fewest steps that fit it
            sched = balance_under_caps(self.stats.take(rows), config=dataclasses.replace(plan.config, num_steps=None),
                                       **layout)
        elif epoch == 0 and plan.epoch0 is not None:
            sched = plan.epoch0
        else:
            sched = balance_under_caps(self.stats, config=plan.config, **layout)
        assert (sched.caps.tiles, sched.caps.tokens) == plan.caps, (sched.caps, plan.caps)
        self._cache = {"epoch": epoch, "remainder": remainder, "schedule": sched, "rows": rows, "stream": None}
        return self._cache

    def schedule_fingerprint(self) -> str:
        """Fingerprint of the schedule this rank's stream comes from (``Schedule.fingerprint``, and after a
        reshard the remainder's rows): every rank of the job must have the same."""
        sched, rows = self.schedule()
        if rows is None:
            return sched.fingerprint()
        rows_bytes = np.ascontiguousarray(rows, "<i8").tobytes()
        return hashlib.sha256(sched.fingerprint().encode() + rows_bytes).hexdigest()[:32]

    def check_agreement(self) -> None:
        """With an ``exchange``: compare this schedule's fingerprint with every rank's (once per schedule)
        and raise :class:`~omnibal.errors.ScheduleMismatch` naming the ranks that built another. A collective:
        every rank calls it at the same point (iteration does, at its first micro-batch)."""
        entry = self._entry(self._epoch, self._remainder)
        if self._exchange is None or entry.get("agreed"):
            return
        ScheduleMismatch.check(list(self._exchange(self.schedule_fingerprint())),
                               source=f"BalancedBatchSampler (epoch {self._epoch})")
        entry["agreed"] = True

    def _stream(self) -> list[np.ndarray]:
        entry = self._entry(self._epoch, self._remainder)
        if entry["stream"] is None:
            sched, rows = entry["schedule"], entry["rows"]
            packs = [sched.pack(int(k)) for k in sched.pack_ids[:, self.dp_rank, :].reshape(-1)]
            entry["stream"] = [rows[mb] if rows is not None else mb for mb in packs]
        return entry["stream"]

    # -- torch BatchSampler protocol ----------------------------------------------------------------
    def _next_start(self, total: int) -> int:
        """Where the next ``iter()`` starts (see "Re-iterable" in the module docstring)."""
        if self._pending is not None:
            return self._pending
        if self._tracking and self._trained < total:
            return self._trained
        return 0

    def __iter__(self):
        # a generator: nothing happens before the first next() (a multi-worker DataLoader calls iter() twice
        # and consumes only the second iterator), so the iteration "starts" at its first micro-batch
        self.check_agreement()
        stream = self._stream()
        start = self._next_start(len(stream))
        self._pending = None
        self._issued = self._trained = start
        self._generation += 1
        generation = self._generation
        for k in range(start, len(stream)):
            if generation == self._generation:  # an older iterator still yields, but moves no counter
                self._issued = k + 1
            yield stream[k].tolist()

    def __len__(self) -> int:
        total = len(self._stream())
        return total - self._next_start(total)

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Another epoch: start it from its beginning (a new shuffle; any resume position and reshard
        remainder are forgotten). The current epoch: nothing changes (a pending resume continues)."""
        epoch = _check_int(epoch, "epoch", 0)
        if epoch != self._epoch:
            self._epoch = epoch
            self._remainder = self._pending = None
            self._issued = self._trained = 0
            self._generation += 1

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
        """Micro-batches of the current epoch the state records: those reported by ``mark_trained`` (plus the
        resume position), never those only handed out: prefetched is not trained."""
        return self._trained

    def state_dict(self) -> dict:
        tiles, tokens = self.caps
        return {"version": STATE_VERSION, "epoch": self._epoch, "consumed_microbatches": self.trained_microbatches,
                "trained_reported": self._tracking, "dp_size": self.dp_size,
                "num_microbatches": self.num_microbatches, "seed": self.seed,
                "stats_fingerprint": self._fingerprint, "config_hash": _config_hash(self.config),
                "caps": {"tiles": tiles, "tokens": tokens}, "remainder": self._remainder}

    def _check_state(self, state: dict) -> tuple[int, int]:
        if not isinstance(state, dict):
            raise InputError(f"a sampler state is a dict, got {type(state).__name__}", source="state_dict")
        for key in ("epoch", "consumed_microbatches", "dp_size", "num_microbatches", "seed", "stats_fingerprint",
                    "caps"):
            if key not in state:
                raise InputError(f"sampler state lacks {key!r}", source="state_dict", field=key)
        unknown = sorted(str(k) for k in state if k not in STATE_KEYS)
        if unknown:
            raise InputError(f"unknown key {unknown[0]!r} in a sampler state", source="state_dict", field=unknown[0])
        if state.get("version", 2) not in READABLE_VERSIONS:
            raise InputError(f"sampler state version {state.get('version')!r:.40} is not one this omnibal reads "
                             f"{READABLE_VERSIONS}", source="state_dict", field="version")
        for key, low in (("epoch", 0), ("consumed_microbatches", 0), ("dp_size", 1), ("num_microbatches", 1),
                         ("seed", 0)):
            value = state[key]
            if not is_int(value) or value < low:
                raise InputError(f"must be an integer >= {low}, got {value!r:.40}", source="state_dict", field=key)
        if not isinstance(state.get("trained_reported", False), bool):
            raise InputError("must be true or false", source="state_dict", field="trained_reported")
        if state["stats_fingerprint"] != self._fingerprint:
            raise InputError("sampler state comes from other stats (fingerprint "
                             f"{state['stats_fingerprint']} != {self._fingerprint})", source="state_dict",
                             field="stats_fingerprint")
        if state["seed"] != self.seed:
            raise InputError(f"sampler state was made with seed {state['seed']!r}, this sampler has {self.seed}",
                             source="state_dict", field="seed")
        if state.get("config_hash", _config_hash(self.config)) != _config_hash(self.config):
            raise InputError("sampler state was made with another balance config", source="state_dict",
                             field="config_hash")
        caps = state["caps"]
        values = [caps.get(k) for k in ("tiles", "tokens")] if isinstance(caps, dict) else [None]
        if not all(is_int(v) and v >= 1 for v in values):
            raise InputError(f"caps must be {{'tiles': int >= 1, 'tokens': int >= 1}}, got {caps!r:.60}",
                             source="state_dict", field="caps")
        return values[0], values[1]

    def _check_remainder(self, remainder):
        """A state's reshard remainder: None or ``{"rows": [distinct dataset rows]}``."""
        if remainder is None:
            return None
        rows = remainder.get("rows") if isinstance(remainder, dict) else None
        ok = isinstance(rows, list) and all(is_int(r)
                                            and 0 <= r < len(self.stats) for r in rows)
        arr = np.asarray(rows if ok and rows else [None])
        if (arr.ndim != 1 or arr.dtype.kind not in "iu" or len(np.unique(arr)) != len(arr)
                or (len(arr) and (arr.min() < 0 or arr.max() >= len(self.stats)))):
            raise InputError(f"remainder must be {{'rows': [distinct rows in [0, {len(self.stats)})]}}",
                             source="state_dict", field="remainder")
        return remainder

    def load_state_dict(self, state: dict, *, reshard: bool = False) -> None:
        """Continue exactly where ``state`` stopped: the next iteration yields the rest of its epoch. With
        ``reshard=True`` a state from another ``dp_size`` or micro-batch count (and so other caps) is
        accepted: the rest of its epoch is re-balanced for this world under this sampler's caps. Caps that
        differ on the same layout mean another balancer: its stream cannot be rebuilt, refused either way."""
        caps = self._check_state(state)
        epoch = _check_int(state["epoch"], "epoch", 0)
        consumed = _check_int(state["consumed_microbatches"], "consumed_microbatches", 0)
        same_layout = state["dp_size"] == self.dp_size and state["num_microbatches"] == self.num_microbatches
        if not same_layout and not reshard:
            raise InputError(f"sampler state is for dp_size={state['dp_size']} x {state['num_microbatches']} "
                             f"micro-batches, this sampler has dp_size={self.dp_size} x {self.num_microbatches}; "
                             f"pass reshard=True to re-balance the rest of the epoch", source="state_dict",
                             field="dp_size")
        if same_layout and caps != self.caps and not reshard:
            raise InputError(f"sampler state was made with caps (tiles, tokens) = {caps}, this sampler has "
                             f"{self.caps}; pass reshard=True to re-balance the rest of the epoch under "
                             f"this sampler's caps", source="state_dict", field="caps")
        if same_layout and caps == self.caps:
            remainder = self._check_remainder(state.get("remainder"))
            total = len(self._entry(epoch, remainder)["schedule"].pack_ids) * self.num_microbatches
            if consumed > total:
                raise InputError(f"{consumed} micro-batches consumed, but the epoch has {total}",
                                 source="state_dict", field="consumed_microbatches")
            pending = consumed
        else:
            remainder = {"rows": self._untrained_rows(state, caps, epoch, consumed).tolist()}
            try:
                self._entry(epoch, remainder)
            except InputError as exc:
                raise InputError(f"the {len(remainder['rows'])} samples left in the epoch do not pack under "
                                 f"this sampler's caps {self.caps} with dp_size x micro-batches = "
                                 f"{self.dp_size} x {self.num_microbatches} ({exc.message}); start the next "
                                 f"epoch instead", source="state_dict", field="caps") from exc
            pending = None
        self._epoch, self._remainder, self._pending = epoch, remainder, pending
        self._issued = self._trained = pending or 0
        self._tracking = bool(state.get("trained_reported", False))  # the loop reports trained micro-batches
        self._generation += 1

    def _untrained_rows(self, state: dict, caps: tuple[int, int], epoch: int, consumed: int) -> np.ndarray:
        """Dataset rows the state's world had not consumed yet in its epoch (sorted), rebuilt from the state."""
        old = BalancedBatchSampler(self.stats, dp_rank=0, dp_size=state["dp_size"],
                                   num_microbatches=state["num_microbatches"], seed=self.seed, epoch=epoch,
                                   config=self.config)
        if old.caps != caps:
            raise InputError(f"sampler state has caps {caps}, but its world rebuilt gives {old.caps} (another "
                             f"omnibal version?): cannot tell which samples it trained", source="state_dict",
                             field="caps")
        old._remainder = self._check_remainder(state.get("remainder"))
        sched, rows = old.schedule()
        step, micro = divmod(consumed, sched.num_microbatches)
        if step > sched.num_steps or (step == sched.num_steps and micro):
            raise InputError(f"{consumed} micro-batches consumed, but the epoch has "
                             f"{sched.num_steps * sched.num_microbatches}", source="state_dict",
                             field="consumed_microbatches")
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
        return remaining
