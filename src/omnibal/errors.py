"""Errors a user can act on.

Every error caused by user input is an :class:`InputError` (a ``ValueError``) whose message names the
input (file or argument), the record (line number or index) and the field, so a user can go straight to
the bad spot. ``assert`` is kept for internal invariants only.
"""

from __future__ import annotations


class OmnibalError(Exception):
    """Base class of every error omnibal raises on purpose."""


class InputError(OmnibalError, ValueError):
    """Bad user input: a file, a record in it, or a field of a record.

    ``source`` is the file path or argument name, ``record`` a human locator such as ``"line 12"`` or
    ``"index 3"``, ``field`` the field or column name. All three are optional and kept as attributes so
    callers (``--on-error skip``) can count and report what they skipped.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        record: str | int | None = None,
        field: str | None = None,
    ) -> None:
        self.message = message
        self.source = None if source is None else str(source)
        self.record = f"index {record}" if isinstance(record, int) else record
        self.field = field
        super().__init__(self._format())

    def _format(self) -> str:
        where = [p for p in (self.source, self.record) if p]
        if self.field:
            where.append(f"field {self.field!r}")
        return f"{': '.join(where)}: {self.message}" if where else self.message

    def __reduce__(self):  # keep keyword-only arguments across pickling (DataLoader workers, mp tests)
        return (_rebuild_input_error, (type(self), self.message, self.source, self.record, self.field))


def _rebuild_input_error(cls, message, source, record, field):
    return cls(message, source=source, record=record, field=field)


class ScheduleMismatch(InputError):
    """Ranks of one job built different schedules for the same epoch. Every rank builds the schedule on its
    own, so ranks that disagree (other statistics, config, seed or omnibal version on some node) would each
    train their own slots of different schedules: some samples twice, others never. ``ranks``: the ranks
    whose schedule differs from the most common one (ties: from the lowest rank's)."""

    def __init__(self, message: str, *, ranks=(), source: str | None = None, record: str | int | None = None,
                 field: str | None = None) -> None:
        self.ranks = tuple(int(r) for r in ranks)
        super().__init__(message, source=source, record=record, field=field)

    def __reduce__(self):
        return (_rebuild_schedule_mismatch, (self.message, self.ranks, self.source, self.record, self.field))

    @classmethod
    def check(cls, fingerprints, *, source: str, describe=None) -> None:
        """Raise when the schedule fingerprints of all ranks (in rank order, e.g. an all-gather) are not all
        equal; ``describe(rank)`` names a rank in the message (default ``rank N``)."""
        fingerprints = [str(f) for f in fingerprints]
        if len(set(fingerprints)) <= 1:
            return
        counts = {f: fingerprints.count(f) for f in fingerprints}
        common = next(f for f in fingerprints if counts[f] == max(counts.values()))
        odd = [r for r, f in enumerate(fingerprints) if f != common]
        name = describe or (lambda r: f"rank {r}")
        theirs = ", ".join(f"{name(r)} has {fingerprints[r]}" for r in odd[:8])
        more = f" (and {len(odd) - 8} more ranks)" if len(odd) > 8 else ""
        raise cls(f"the ranks built different schedules: {theirs}{more}, the other {len(fingerprints) - len(odd)} of "
                  f"{len(fingerprints)} ranks {common}; each rank would train its slots of a different schedule, "
                  f"losing or repeating samples: give every rank the same statistics, balance config, seed and "
                  f"omnibal version", ranks=odd, source=source, field="schedule_fingerprint")


def _rebuild_schedule_mismatch(message, ranks, source, record, field):
    return ScheduleMismatch(message, ranks=ranks, source=source, record=record, field=field)
