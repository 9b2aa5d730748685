"""Checks of user-given numbers, one owner for each: every config and function that takes a count, a size
or a rate validates it here, so the rule (what counts as an integer, bool refused, numpy integers accepted)
and the message (:class:`omnibal.errors.InputError` naming the input) are the same everywhere."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

from omnibal.errors import InputError


def is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_positive_int(value: Any, name: str, *, source: str | None = None) -> int:
    """``value`` as an ``int`` if it is an integer >= 1, else InputError naming ``source`` (default ``name``)
    and the field ``name``."""
    if not is_int(value) or value < 1:
        raise InputError(f"must be a positive integer, got {value!r}", source=source or name, field=name)
    return int(value)


def check_non_negative_int(value: Any, name: str, *, source: str | None = None) -> int:
    """``value`` as an ``int`` if it is an integer >= 0, else InputError."""
    if not is_int(value) or value < 0:
        raise InputError(f"must be an integer >= 0, got {value!r}", source=source or name, field=name)
    return int(value)


def check_positive_number(value: Any, name: str, *, source: str | None = None) -> float:
    """``value`` as a ``float`` if it is a finite real number > 0 (bool refused), else InputError."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
        raise InputError(f"must be a finite number > 0, got {value!r}", source=source or name, field=name)
    return float(value)


def check_non_negative_number(value: Any, name: str, *, source: str | None = None) -> float:
    """``value`` as a ``float`` if it is a finite real number >= 0 (bool refused), else InputError."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value < 0:
        raise InputError(f"must be a finite number >= 0, got {value!r}", source=source or name, field=name)
    return float(value)
