"""A step's samples as ``--on-error`` says, and what a run tells about its data.

The statistics of real data read image headers only (fast), so an image whose header is fine but whose
pixels are truncated or corrupt is found only when a step decodes it. With ``on_error="raise"`` (the
default) that stops the run, naming the step, the rank, the file and the record; with ``"skip"`` the sample
is left out of its micro-batch and reported (on stderr by the rank that found it, in the run's summary),
never trained and never in the ledger. A micro-batch whose every sample was skipped still runs, as a pack
that trains nothing (one ignored token), so every rank and every pipeline stage runs the same micro-batches.

Notices (records, samples or checkpoints skipped, samples left untrained, a resume re-balanced) are about
the data, not progress: they reach stderr and the summary JSON whether or not the run is quiet.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from omnibal.data.collate import IGNORE_INDEX
from omnibal.errors import InputError
from omnibal.layout import OnError

ON_ERROR = tuple(OnError)
PLACEHOLDER_INDEX = -1
"""The dataset index of the pack that stands in for a micro-batch whose every sample was skipped."""


def placeholder_sample(image_size: int) -> dict:
    """A sample that trains nothing: one ignored token, no tile."""
    return {"pixel_values": torch.zeros(0, 3, image_size, image_size),
            "input_ids": torch.zeros(1, dtype=torch.int64),
            "labels": torch.full((1,), IGNORE_INDEX, dtype=torch.int64), "index": PLACEHOLDER_INDEX}


def real_indices(indices: Sequence[int]) -> list[int]:
    """``indices`` without the placeholder's."""
    return [int(i) for i in indices if int(i) != PLACEHOLDER_INDEX]


class SampleReader:
    """Reads dataset rows for one rank under an ``--on-error`` policy; keeps what it skipped.

    ``warn(line)``: where this rank says what it skipped (every rank: a bad image is found by the rank that
    reads it); ``where``: how this rank is named in that line."""

    def __init__(self, dataset, on_error: str = "raise", *, warn: Callable[[str], None] | None = None,
                 where: str = "") -> None:
        if on_error not in ON_ERROR:
            raise InputError(f"must be one of {ON_ERROR}, got {on_error!r}", source="--on-error", field="on_error")
        self.dataset = dataset
        self.on_error = on_error
        self.warn = warn
        self.where = where
        self.skipped: list[dict] = []
        """One entry per skipped sample: step, dataset index, key (when the dataset has keys) and the error."""

    def read(self, indices, *, step: int, report: bool = True) -> list[dict]:
        """The samples of ``indices`` (dataset rows); with ``skip``, those that cannot be built are left out
        and, when ``report`` (one rank per SP group reports its group's), recorded and said."""
        out = []
        for i in indices:
            try:
                out.append(self.dataset[int(i)])
            except InputError as exc:
                if self.on_error != "skip":
                    raise
                if report:
                    self._skip(step, int(i), exc)
        return out

    def _skip(self, step: int, index: int, exc: InputError) -> None:
        key = self.dataset.key(index) if hasattr(self.dataset, "key") else None
        self.skipped.append({"step": step, "index": index, "key": key, "error": str(exc)})
        if self.warn is not None:
            self.warn(f"{self.where + ': ' if self.where else ''}step {step}: skipped sample {index} "
                      f"(--on-error skip): {exc}")
