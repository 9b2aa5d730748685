"""Which ``checkpoint-N`` folder an :class:`~omnibal.integrations.hf.OmnibalTrainer` resumes from.

``Trainer`` writes a checkpoint in several files one after the other (weights, optimizer and scheduler, RNG
states, ``trainer_state.json``, then the callbacks' files: omnibal's per-rank sampler states). A process
killed inside that sequence (SIGKILL, a lost node, a full disk) leaves the newest folder without some of
them, and ``get_last_checkpoint`` picks it by name alone: every rank then failed with "Can't find a valid
checkpoint" and a traceback. A folder is *complete* when it has, checked without loading them: whole weight
files (:mod:`omnibal.train.hf_weights`; not checked when DeepSpeed or FSDP write their own layout), a whole
``optimizer.pt`` (unless the run saves the model only), a readable ``trainer_state.json`` and every rank's
sampler state, written at that state's ``global_step``. Resume takes the newest complete folder and names
every newer one it skipped, with what it lacks.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

from omnibal.errors import InputError
from omnibal.train.hf_weights import check_weights

STATE_FILE = "omnibal_sampler_rank{rank}.json"
"""Per-rank sampler state written into every checkpoint folder."""
STATE_FORMAT = "omnibal.hf_sampler/1"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
_FOLDER = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_problem(folder: str | Path, *, world_size: int, weights: bool = True,
                       optimizer: bool = True) -> str | None:
    """What ``folder`` lacks to be a complete checkpoint of a ``world_size``-process run (None: complete).
    ``weights`` / ``optimizer``: whether this run's Trainer writes them as plain files there."""
    folder = Path(folder)
    try:
        step = json.loads((folder / TRAINER_STATE).read_text())["global_step"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"no readable {TRAINER_STATE} ({type(exc).__name__})"
    if weights:
        try:
            check_weights(folder, field="weights")
        except InputError as exc:
            return exc.message if exc.source == str(folder) else f"{Path(exc.source).name}: {exc.message}"
    if optimizer and not zipfile.is_zipfile(folder / OPTIMIZER):
        return f"{OPTIMIZER} missing or cut short"
    for rank in range(world_size):
        name = STATE_FILE.format(rank=rank)
        if not (folder / name).is_file():
            return f"no omnibal sampler state {name}"
        try:
            record = json.loads((folder / name).read_text())
        except (OSError, ValueError) as exc:
            return f"unreadable omnibal sampler state {name} ({type(exc).__name__})"
        if not isinstance(record, dict) or record.get("format") != STATE_FORMAT \
                or not isinstance(record.get("sampler"), dict):
            return f"{name} is not an omnibal sampler state"
        if record.get("global_step") != step:
            return f"{name} is of step {record.get('global_step')!r}, {TRAINER_STATE} of step {step!r}"
    return None


def checkpoint_folders(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-N`` folders of ``output_dir``, newest (largest N) first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _FOLDER.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def newest_complete(output_dir: str | Path, **checks) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint folder of ``output_dir`` (None: there is none) and one line per newer
    folder skipped, naming it and what it lacks (``checks``: :func:`checkpoint_problem`'s keywords)."""
    skipped = []
    for folder in checkpoint_folders(output_dir):
        why = checkpoint_problem(folder, **checks)
        if why is None:
            return folder, skipped
        skipped.append(f"skipped incomplete checkpoint {folder}: {why}")
    return None, skipped
