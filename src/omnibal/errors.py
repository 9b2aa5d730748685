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
