"""Step checkpoints: model + optimizer per pipeline stage, sampler state and step, with a checksum manifest.

Layout (the folder must be shared by all ranks, e.g. a network file system on several nodes)::

    <dir>/step_00000012/stage_0.pt        model and optimizer state of stage 0 (written by dp rank 0)
    <dir>/step_00000012/stage_1.pt
    <dir>/step_00000012/manifest.json     written last: the commit point of the checkpoint

Every file is written to a temporary name, fsynced and renamed, so a crash leaves either the old state
or a complete new file, never a half-written one under the final name. The manifest records each file's
size and SHA-256, the world (dp, pp), the model identity, the stage layer ranges, the step and the
sampler state, and the SHA-256 of its own fields (``manifest_sha256``: an edited ``next_step`` is as corrupt
as a flipped byte in a stage file); its ``step`` must be its folder's and the sampler's ``next_step``. A step
folder without a manifest, or whose files or fields do not match it, is *corrupt*: resuming skips it with a
warning and takes the newest valid one. A valid checkpoint of another world size, model
or stage layout is refused with an InputError (resuming it would silently train something else).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omnibal.errors import InputError
from omnibal.outputs import write_bytes  # temporary file + fsync + rename, the umask's mode
from omnibal.validate import is_int

FORMAT = 2
"""Version 2: the manifest holds the SHA-256 of its own fields (``manifest_sha256``)."""
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def stage_file(stage: int) -> str:
    return f"stage_{stage}.pt"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def param_signature(module: torch.nn.Module) -> list[list]:
    """Names, shapes and dtypes of a module's state: what a checkpoint must match to be loaded."""
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in module.state_dict().items()]


def write_stage_file(root: str | Path, step: int, stage: int, *, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer | None) -> dict:
    """Save one stage's state atomically; returns its manifest record (name, bytes, sha256, signature)."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": None if optimizer is None else optimizer.state_dict(),
                "step": step, "stage": stage}, buf)
    data = buf.getvalue()
    path = step_dir(root, step) / stage_file(stage)
    fresh = not path.parent.exists()
    try:
        write_bytes(path, data)
    except BaseException:
        if fresh:  # a step folder this write made and left empty (a full disk) is no checkpoint to skip later
            with contextlib.suppress(OSError):
                path.parent.rmdir()  # only when empty: another stage's file may be there
        raise
    return {"file": path.name, "stage": stage, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "params": param_signature(model)}


def write_manifest(root: str | Path, step: int, *, stage_records: list[dict], world: dict, model_id: str,
                   stage_layers: list[list[int]], sampler: dict, extra: dict | None = None) -> Path:
    """Commit a checkpoint: write its manifest (after every stage file is in place)."""
    doc = {"format": FORMAT, "step": step, "world": world, "model_id": model_id, "stage_layers": stage_layers,
           "sampler": sampler, "files": sorted(stage_records, key=lambda r: r["stage"]), **(extra or {})}
    doc["manifest_sha256"] = manifest_digest(doc)
    path = step_dir(root, step) / MANIFEST
    write_bytes(path, json.dumps(doc, indent=1).encode())
    return path


def manifest_digest(doc: dict) -> str:
    """SHA-256 of a manifest's fields (all but ``manifest_sha256`` itself), in a canonical JSON form."""
    fields = {k: v for k, v in doc.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Found:
    """The checkpoint chosen for resuming, and the corrupt ones skipped on the way."""

    path: Path | None
    manifest: dict | None
    skipped: list[str] = field(default_factory=list)
    """One line per skipped (corrupt or incomplete) newer checkpoint."""


def verify(path: Path) -> dict:
    """Load and check a checkpoint folder's manifest and files; raises InputError when corrupt."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise InputError("no manifest: the checkpoint was not completed (crash while writing?)", source=str(path))
    try:
        doc = json.loads(mpath.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:  # ValueError: bad JSON, huge ints
        raise InputError(f"unreadable manifest: {type(exc).__name__}: {str(exc)[:200]}", source=str(mpath)) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), list):
        raise InputError(f"not an omnibal checkpoint manifest of format {FORMAT}", source=str(mpath), field="format")
    if doc.get("manifest_sha256") != manifest_digest(doc):
        raise InputError("the manifest's fields do not match its own SHA-256 (edited or corrupt manifest)",
                         source=str(mpath), field="manifest_sha256")
    _check_schema(doc, str(mpath))
    m = _STEP_DIR.match(path.name)
    if m is not None and doc["step"] != int(m.group(1)):
        raise InputError(f"step {doc['step']} in the manifest of folder {path.name}", source=str(mpath), field="step")
    if doc["sampler"]["next_step"] != doc["step"]:
        raise InputError(f"sampler next_step {doc['sampler']['next_step']} differs from the checkpoint's step "
                         f"{doc['step']}", source=str(mpath), field="sampler.next_step")
    for rec in doc["files"]:
        fpath = path / rec["file"]
        if not fpath.is_file():
            raise InputError("file listed in the manifest is missing", source=str(fpath))
        size = fpath.stat().st_size
        if size != rec["bytes"]:
            raise InputError(f"size {size} bytes, manifest says {rec['bytes']} (truncated?)", source=str(fpath),
                             field="bytes")
        if sha256_file(fpath) != rec["sha256"]:
            raise InputError("SHA-256 does not match the manifest (corrupt file)", source=str(fpath),
                             field="sha256")
    return doc



def _check_schema(doc: dict, source: str) -> None:
    """Every field resuming reads, with its type; file names must be plain names inside the folder (a
    manifest never makes resume read another checkpoint's or any other file)."""
    def bad(msg: str, field: str) -> InputError:
        return InputError(msg, source=source, field=field)

    if not is_int(doc.get("step")) or doc["step"] < 0:
        raise bad(f"step must be an integer >= 0, got {doc.get('step')!r}", "step")
    sampler = doc.get("sampler")
    if not isinstance(sampler, dict) or not is_int(sampler.get("next_step")) or sampler["next_step"] < 0:
        raise bad(f"sampler must hold an integer next_step, got {sampler!r}", "sampler")
    if not isinstance(doc.get("world"), dict) or not isinstance(doc.get("model_id"), str):
        raise bad("world (object) and model_id (string) are required", "world")
    if not isinstance(doc.get("stage_layers"), list):
        raise bad("stage_layers must be a list", "stage_layers")
    files = doc["files"]
    if not files:
        raise bad("lists no files", "files")
    stages = []
    for k, rec in enumerate(files):
        if not isinstance(rec, dict):
            raise bad(f"file entry {k} is not an object", "files")
        name = rec.get("file")
        if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
                or name == MANIFEST or Path(name).name != name):
            raise bad(f"file entry {k}: {name!r} is not a file name inside the checkpoint folder", "file")
        if not is_int(rec.get("stage")) or not is_int(rec.get("bytes")) or rec["bytes"] < 0:
            raise bad(f"file entry {k}: stage and bytes must be integers", "files")
        sha = rec.get("sha256")
        if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise bad(f"file entry {k}: sha256 must be 64 hex digits", "sha256")
        if not isinstance(rec.get("params"), list):
            raise bad(f"file entry {k}: params must be a list", "params")
        stages.append(rec["stage"])
    if sorted(stages) != list(range(len(files))):
        raise bad(f"stage files {sorted(stages)} are not one per stage 0..{len(files) - 1}", "files")


def check_compatible(doc: dict, *, source: str, world: dict, model_id: str, stage_layers: list[list[int]],
                     any_dp_size: bool = False) -> None:
    """Refuse a valid checkpoint made for another world, model or stage layout (``any_dp_size``: accept
    another DP size with the same pp size, for a resume that re-shards the data)."""
    other = doc.get("world")
    if any_dp_size and isinstance(other, dict) and other.get("pp_size") == world.get("pp_size"):
        pass
    elif other != world:
        raise InputError(f"checkpoint was written by world {doc.get('world')}, this run is {world}; resume with "
                         f"the same dp x pp, or pass reshard=True (`omnibal train --resume --reshard`) to "
                         f"re-balance the rest of the epoch for another dp size", source=source, field="world")
    if doc.get("model_id") != model_id:
        raise InputError(f"checkpoint is of model {doc.get('model_id')!r}, this run trains {model_id!r}",
                         source=source, field="model_id")
    if doc.get("stage_layers") != stage_layers:
        raise InputError(f"checkpoint stage layers {doc.get('stage_layers')} differ from this run's {stage_layers}",
                         source=source, field="stage_layers")


def list_steps(root: str | Path) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(steps)


def find_latest_valid(root: str | Path, *, world: dict, model_id: str, stage_layers: list[list[int]],
                      any_dp_size: bool = False) -> Found:
    """Newest checkpoint whose files match their manifest; corrupt ones are skipped (and listed).

    A valid checkpoint that is incompatible with this run raises InputError instead of being skipped.
    """
    found = Found(None, None)
    for step in reversed(list_steps(root)):
        path = step_dir(root, step)
        try:
            doc = verify(path)
        except InputError as exc:
            found.skipped.append(f"skipped corrupt checkpoint: {exc}")
            continue
        check_compatible(doc, source=str(path), world=world, model_id=model_id, stage_layers=stage_layers,
                         any_dp_size=any_dp_size)
        found.path, found.manifest = path, doc
        return found
    return found


def load_stage_file(path: Path, manifest: dict, stage: int, *, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None, map_location: Any = "cpu") -> None:
    """Load one stage's model and optimizer state after checking the parameter signature."""
    rec = next((r for r in manifest["files"] if r["stage"] == stage), None)
    if rec is None:
        raise InputError(f"checkpoint has no file for stage {stage}", source=str(path), field="files")
    mine = param_signature(model)
    if rec["params"] != mine:
        diff = next(((a, b) for a, b in zip(rec["params"], mine) if a != b), None)
        raise InputError(f"stage {stage} parameters differ from the checkpoint's (first difference: checkpoint "
                         f"{diff[0] if diff else rec['params'][len(mine):][:1]}, model "
                         f"{diff[1] if diff else mine[len(rec['params']):][:1]})", source=str(path / rec["file"]),
                         field="params")
    state = torch.load(path / rec["file"], map_location=map_location, weights_only=True)
    if (state.get("step"), state.get("stage")) != (manifest["step"], stage):  # the manifest's step, cross-checked
        raise InputError(f"stage file holds step {state.get('step')} stage {state.get('stage')}, the manifest says "
                         f"step {manifest['step']} stage {stage}", source=str(path / rec["file"]), field="step")
    model.load_state_dict(state["model"])
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])


def prune(root: str | Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints (never an incomplete newer one being written)."""
    steps = list_steps(root)
    for step in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
