"""Whether a Hugging Face checkpoint folder holds whole weight files, checked without loading them.

A weight file cut short (a copy interrupted, a disk that filled, a process killed inside ``save_pretrained``)
otherwise fails deep inside ``from_pretrained`` with a safetensors or pickle traceback, in every rank, after
the ranks have started; or a Trainer checkpoint folder without weights is picked for a resume. Checked
here: the weight files the folder names exist (``model.safetensors``, a sharded index's files, or
``pytorch_model.bin``), each safetensors file's header parses and its tensors end exactly at the file's
end, and each ``.bin`` is a whole zip archive (torch's format). Reads headers only: milliseconds.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path

from omnibal.errors import InputError

SAFE = "model.safetensors"
BIN = "pytorch_model.bin"
MAX_HEADER = 100 << 20
"""Largest safetensors header read (the format's own limit)."""


def weight_files(folder: str | os.PathLike, *, field: str = "hf_model") -> list[Path]:
    """The weight files of a checkpoint folder (a sharded index's files, else the single file), each present;
    an InputError naming the folder when it has none, or an index that lists a missing shard."""
    root = Path(folder)
    for name in (SAFE, BIN):
        index = root / f"{name}.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise InputError(f"unreadable shard index: {type(exc).__name__}: {exc}", source=str(index),
                                 field=field) from None
            missing = [s for s in shards if not (root / s).is_file()]
            if missing:
                raise InputError(f"lists {len(missing)} weight file(s) that are not there, e.g. {missing[0]}",
                                 source=str(index), field=field)
            return [root / s for s in shards]
        if (root / name).is_file():
            return [root / name]
    raise InputError(f"no weights: neither {SAFE} nor {BIN} (nor a sharded index of them)", source=str(root),
                     field=field)


def check_weights(folder: str | os.PathLike, *, field: str = "hf_model") -> None:
    """Every weight file of ``folder`` whole (see the module docstring), or an InputError naming the file."""
    for path in weight_files(folder, field=field):
        if path.suffix == ".safetensors":
            _check_safetensors(path, field)
        elif not zipfile.is_zipfile(path):
            raise InputError("not a whole torch weight file (truncated or corrupt zip archive)", source=str(path),
                             field=field)


def _check_safetensors(path: Path, field: str) -> None:
    def bad(what: str) -> InputError:
        return InputError(f"{what}: the file is truncated or corrupt", source=str(path), field=field)

    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, shorter than a safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER, size - 8):
                raise bad(f"header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"unreadable header ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    ends = [t.get("data_offsets", [0, 0])[1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    end = 8 + length + max((e for e in ends if isinstance(e, int)), default=0)
    if end != size:
        raise bad(f"its tensors end at byte {end}, the file has {size}")
