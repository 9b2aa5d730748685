"""Exceptions that cross from a spawned rank to its parent: the exception itself, with the rank's formatted
stack as its cause (a traceback object cannot be pickled), never a separate text to parse."""

from __future__ import annotations

import pickle


def one_line(exc: BaseException) -> str:
    """``Type: message`` (the type alone when the message is empty)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class RemoteTraceback(Exception):
    """The stack of an exception a rank raised, as the rank formatted it (a traceback object does not cross
    the process boundary): set as that exception's ``__cause__``, as ``concurrent.futures`` does, so Python
    prints it under the exception and the exception alone carries it."""

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


def remote_traceback(exc: BaseException | None) -> str | None:
    """The rank's formatted stack that travelled with ``exc`` (``None`` when none did: an omnibal error's one
    line says it all)."""
    cause = exc.__cause__ if exc is not None else None
    return str(cause) if isinstance(cause, RemoteTraceback) else None


def _with_cause(exc: BaseException, trace: str) -> BaseException:
    exc.__cause__ = RemoteTraceback(trace)
    return exc


class _WithTraceback:
    """Pickles ``exc`` so that it arrives with ``trace`` as its ``RemoteTraceback`` cause (pickling an
    exception drops ``__cause__``)."""

    def __init__(self, exc: BaseException, trace: str) -> None:
        self.exc, self.trace = exc, trace

    def __reduce__(self):
        return _with_cause, (self.exc, self.trace)


def sendable(exc: BaseException, trace: str | None = None):
    """What a rank puts on the result queue for ``exc``: ``exc`` itself when it survives pickling, else a
    RuntimeError naming it; with ``trace``, pickled so that it arrives with that as its ``RemoteTraceback``."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # an exception whose constructor takes other arguments than its args, or holds a lock
        exc = RuntimeError(one_line(exc))
    return exc if trace is None else _WithTraceback(exc, trace)
