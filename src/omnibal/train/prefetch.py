"""Load the next step's micro-batches while the current step computes.

The first pipeline stage reads and collates its samples (images decoded and tiled, text tokenized) before
every step; on a GPU that is time the device waits. :class:`StepPrefetcher` runs the loader for step
``s + 1`` on one background thread as soon as step ``s`` has its batches: image decoding (Pillow) and
tokenization (``tokenizers``) release the GIL, so the loading overlaps the step's kernels. The loader is a
pure function of the step (the schedule and the dataset), so a prefetched result is the one a direct call
would return; errors surface, unchanged, at the step that needs the batches.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class StepPrefetcher:
    """``get(step)`` returns ``load(step)`` and starts ``load(step + 1)`` in the background.

    ``key()`` names what the loads depend on besides the step (e.g. the schedule after a reshard): a
    prefetched result of another key is thrown away. ``close()`` waits for a load in flight and stops the
    thread."""

    def __init__(self, load: Callable[[int], Any], *, key: Callable[[], Any] = lambda: None,
                 last_step: Callable[[], int]) -> None:
        self._load = load
        self._key = key
        self._last_step = last_step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omnibal-prefetch")
        self._pending: tuple[int, Any, Future] | None = None

    def get(self, step: int):
        pending, self._pending = self._pending, None
        if pending is not None and pending[:2] == (step, self._key()):
            result = pending[2].result()
        else:
            if pending is not None:
                pending[2].cancel()
            result = self._load(step)
        if step + 1 <= self._last_step():
            self._pending = (step + 1, self._key(), self._pool.submit(self._load, step + 1))
        return result

    def close(self) -> None:
        if self._pending is not None:
            self._pending[2].cancel()
            self._pending = None
        self._pool.shutdown(wait=True)
