"""Checkpoints under faults: a writer killed (SIGKILL) at a random moment, files truncated or flipped at any
byte, manifests rewritten into anything JSON can hold.

Promises (docs/guarantees.md, "Checkpoints"):

* atomic: a file under its final name is always complete (temporary file + fsync + rename), so a writer
  killed at any moment leaves the previous checkpoints intact and at most an incomplete newest one;
* detected: a checkpoint whose files do not match the manifest's sizes and SHA-256 (or that has no
  manifest) is refused with an ``InputError`` naming the file; resuming skips it, says so, and takes the
  newest good one;
* contained: whatever the manifest says, resuming never crashes with another exception type and never reads
  a file outside the checkpoint folder.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.train import checkpoint as ckpt

torch = pytest.importorskip("torch")

WORLD = {"dp_size": 2, "pp_size": 2}
LAYERS = [[0, 3], [3, 6]]
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])



def _stage(seed: int, width: int = 8):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, width)).sum().backward()
    opt.step()
    return model, opt


def write_checkpoint(root, step: int, *, width: int = 8) -> None:
    """What the trainer does: every stage file, then the manifest (the commit point)."""
    records = []
    for stage in range(2):
        model, opt = _stage(step * 10 + stage, width)
        records.append(ckpt.write_stage_file(root, step, stage, model=model, optimizer=opt))
    ckpt.write_manifest(root, step, stage_records=records, world=WORLD, model_id="m:1", stage_layers=LAYERS,
                        sampler={"next_step": step, "schedule_fingerprint": "f"})


_TEMPLATE: list = []


def two_checkpoints(tmp_path_factory):
    """A folder with good checkpoints at steps 1 and 2 (written once, copied per example)."""
    import shutil

    if not _TEMPLATE:
        template = tmp_path_factory.mktemp("template")
        write_checkpoint(template, 1)
        write_checkpoint(template, 2)
        _TEMPLATE.append(template)
    root = tmp_path_factory.mktemp("ck")
    shutil.copytree(_TEMPLATE[0], root, dirs_exist_ok=True)
    return root


def find(root):
    return ckpt.find_latest_valid(root, world=WORLD, model_id="m:1", stage_layers=LAYERS)


# ------------------------------------------------------------------------------ damaged stage files
@FUZZ
@given(stage=st.integers(0, 1), cut=st.floats(0, 1, exclude_max=True), flips=st.lists(
    st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), max_size=3), truncate=st.booleans())
def test_any_damage_to_a_stage_file_is_detected(tmp_path_factory, stage, cut, flips, truncate):
    root = two_checkpoints(tmp_path_factory)
    target = ckpt.step_dir(root, 2) / ckpt.stage_file(stage)
    data = bytearray(target.read_bytes())
    if truncate:
        data = data[: int(cut * len(data))]
    for at, xor in flips:
        if data:
            data[int(at * len(data))] ^= xor
    assume(bytes(data) != target.read_bytes())  # a change that changes nothing tests nothing
    target.write_bytes(bytes(data))
    with pytest.raises(InputError) as exc:
        ckpt.verify(ckpt.step_dir(root, 2))
    assert ckpt.stage_file(stage) in str(exc.value)
    found = find(root)
    assert found.path == ckpt.step_dir(root, 1)
    assert len(found.skipped) == 1 and "step_00000002" in found.skipped[0]


@FUZZ
@given(cut=st.integers(0, 400))
def test_truncated_manifest_is_skipped(tmp_path_factory, cut):
    root = two_checkpoints(tmp_path_factory)
    manifest = ckpt.step_dir(root, 2) / ckpt.MANIFEST
    data = manifest.read_bytes()
    assume(cut < len(data))
    manifest.write_bytes(data[:cut])
    found = find(root)
    assert found.path == ckpt.step_dir(root, 1) and len(found.skipped) == 1


# ------------------------------------------------------------------------------ adversarial manifests
json_any = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**40) | st.floats(allow_nan=False) | st.text(max_size=12)
    | st.sampled_from(["stage_0.pt", "../step_00000001/stage_0.pt", "/etc/hostname", "manifest.json", ""]),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
        st.sampled_from(["file", "stage", "bytes", "sha256", "params", "next_step", "x"]), kids, max_size=4),
    max_leaves=8)
manifest_keys = st.sampled_from(["format", "step", "world", "model_id", "stage_layers", "sampler", "files"])
file_keys = st.sampled_from(["file", "stage", "bytes", "sha256", "params"])


@FUZZ
@given(edits=st.lists(st.one_of(
    st.tuples(st.just("top"), manifest_keys, json_any),
    st.tuples(st.just("del"), manifest_keys, st.none()),
    st.tuples(st.just("file"), st.tuples(st.integers(0, 1), file_keys), json_any),
    st.tuples(st.just("file-del"), st.tuples(st.integers(0, 1), file_keys), st.none()),
), min_size=1, max_size=3), resign=st.booleans())
def test_adversarial_manifest_never_crashes_resume(tmp_path_factory, edits, resign):
    """A manifest rewritten into anything: resume falls back to the older good checkpoint, or refuses with an
    InputError; no KeyError/TypeError from deep inside, and no file outside the checkpoint is trusted. Half
    the manifests get their checksum recomputed after the edit, so the field checks behind it are fuzzed
    too."""
    root = two_checkpoints(tmp_path_factory)
    manifest = ckpt.step_dir(root, 2) / ckpt.MANIFEST
    doc = json.loads(manifest.read_text())
    for kind, key, value in edits:
        if kind == "top":
            doc[key] = value
        elif kind == "del":
            doc.pop(key, None)
        elif (isinstance(doc.get("files"), list) and len(doc["files"]) > key[0]
              and isinstance(doc["files"][key[0]], dict)):
            if kind == "file":
                doc["files"][key[0]][key[1]] = value
            else:
                doc["files"][key[0]].pop(key[1], None)
    manifest.write_text(json.dumps(resigned(doc) if resign else doc))
    try:
        found = find(root)
    except InputError:
        return  # a valid-looking checkpoint of another world/model: refused with a named error
    assert found.path is not None
    if found.path == ckpt.step_dir(root, 2):
        # accepted: then every file it lists is inside the folder, present, and matches its checksum
        for rec in found.manifest["files"]:
            path = (found.path / rec["file"]).resolve()
            assert path.parent == found.path.resolve(), f"manifest points outside the checkpoint: {rec['file']}"
            assert ckpt.sha256_file(path) == rec["sha256"]
        assert isinstance(found.manifest.get("sampler", {}).get("next_step"), int), "resume needs next_step"
    else:
        assert found.path == ckpt.step_dir(root, 1) and found.skipped


def resigned(doc):
    """``doc`` with its own checksum recomputed (when it is an object): what an edit plus a forged checksum gives."""
    if isinstance(doc, dict):
        doc = {**doc, "manifest_sha256": ckpt.manifest_digest(doc)}
    return doc


@pytest.mark.parametrize("field,value", [("next_step", 9), ("next_step", 1000), ("step", 3), ("world", {"dp_size": 2,
                         "pp_size": 2, "x": 1}), ("stage_layers", [[0, 3], [3, 7]]), ("model_id", "m:2")])
def test_any_edited_manifest_field_makes_the_checkpoint_corrupt(tmp_path, field, value):
    """Issue 20, case 1: the SHA-256s covered the stage files, not the manifest's own fields, so an edited
    ``next_step`` was trusted (steps skipped, exit 0). Now every field is inside the manifest's checksum: the
    checkpoint is skipped as corrupt and the previous good one is used."""
    write_checkpoint(tmp_path, 1)
    write_checkpoint(tmp_path, 2)
    manifest = ckpt.step_dir(tmp_path, 2) / ckpt.MANIFEST
    doc = json.loads(manifest.read_text())
    if field == "next_step":
        doc["sampler"]["next_step"] = value
    else:
        doc[field] = value
    manifest.write_text(json.dumps(doc, indent=3))
    found = find(tmp_path)
    assert found.path == ckpt.step_dir(tmp_path, 1) and len(found.skipped) == 1
    assert "manifest_sha256" in found.skipped[0]


@pytest.mark.parametrize("edit", ["file-entry-without-sha256", "file-entry-without-file", "file-entry-null-file",
                                  "sampler-null", "sampler-missing", "files-of-strings"])
def test_malformed_manifest_is_skipped_as_corrupt(tmp_path, edit):
    write_checkpoint(tmp_path, 1)
    write_checkpoint(tmp_path, 2)
    manifest = ckpt.step_dir(tmp_path, 2) / ckpt.MANIFEST
    doc = json.loads(manifest.read_text())
    if edit == "file-entry-without-sha256":
        del doc["files"][0]["sha256"]
    elif edit == "file-entry-without-file":
        del doc["files"][0]["file"]
    elif edit == "file-entry-null-file":
        doc["files"][0]["file"] = None
    elif edit == "sampler-null":
        doc["sampler"] = None
    elif edit == "sampler-missing":
        del doc["sampler"]
    else:
        doc["files"] = ["stage_0.pt", "stage_1.pt"]
    manifest.write_text(json.dumps(resigned(doc)))  # past the checksum: the schema checks refuse it
    found = find(tmp_path)
    assert found.path == ckpt.step_dir(tmp_path, 1) and len(found.skipped) == 1


def test_manifest_pointing_outside_the_checkpoint_is_refused(tmp_path):
    """A manifest whose file entry is ``../step_00000001/stage_0.pt`` (or absolute) must not make resume load
    another checkpoint's weights under this step's name."""
    write_checkpoint(tmp_path, 1)
    write_checkpoint(tmp_path, 2)
    manifest = ckpt.step_dir(tmp_path, 2) / ckpt.MANIFEST
    doc = json.loads(manifest.read_text())
    older = json.loads((ckpt.step_dir(tmp_path, 1) / ckpt.MANIFEST).read_text())
    doc["files"][0] = {**older["files"][0], "file": "../step_00000001/stage_0.pt"}
    manifest.write_text(json.dumps(resigned(doc)))  # past the checksum: the file-name check refuses it
    with pytest.raises(InputError):
        ckpt.verify(ckpt.step_dir(tmp_path, 2))
    assert find(tmp_path).path == ckpt.step_dir(tmp_path, 1)


# ------------------------------------------------------------------------------ killed while writing
def _writer(root: str, first_step: int, ready) -> None:  # runs in a forked child until killed
    torch.set_num_threads(1)
    step = first_step
    ready.set()
    while True:
        write_checkpoint(root, step, width=256)  # ~0.5 MB per stage file: writes take a while
        step += 1


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_writer_killed_at_random_moments_never_leaves_a_partial_file(tmp_path):
    rng = random.Random(1234)
    ctx = multiprocessing.get_context("fork")
    next_step = 1
    for round_ in range(6):
        ready = ctx.Event()
        proc = ctx.Process(target=_writer, args=(str(tmp_path), next_step, ready), daemon=True)
        proc.start()
        assert ready.wait(20)
        time.sleep(rng.uniform(0.02, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert proc.exitcode == -signal.SIGKILL
        steps = ckpt.list_steps(tmp_path)
        # every file under a final name is complete: it loads, and matches the manifest when there is one
        for step in steps:
            folder = ckpt.step_dir(tmp_path, step)
            doc = None
            if (folder / ckpt.MANIFEST).is_file():
                doc = json.loads((folder / ckpt.MANIFEST).read_text())  # complete JSON, never half a file
            for stage in range(2):
                f = folder / ckpt.stage_file(stage)
                if f.is_file():
                    torch.load(f, weights_only=True)
                    if doc is not None:
                        rec = next(r for r in doc["files"] if r["stage"] == stage)
                        assert ckpt.sha256_file(f) == rec["sha256"]
        found = find(tmp_path)
        complete = [s for s in steps if (ckpt.step_dir(tmp_path, s) / ckpt.MANIFEST).is_file()]
        if complete:
            assert found.path == ckpt.step_dir(tmp_path, complete[-1]), (round_, steps, found.skipped)
            assert ckpt.verify(found.path)["step"] == complete[-1]
        # an incomplete newest folder is reported as skipped, never silently used
        incomplete = [s for s in steps if s > (complete[-1] if complete else 0)]
        assert len(found.skipped) == len(incomplete)
        next_step = (steps[-1] + 1) if steps else 1
    assert ckpt.list_steps(tmp_path), "the writer never got a checkpoint down: kills came too early"
