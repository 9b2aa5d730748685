"""Fuzzing the trainer's real-data path (issue 20: "extend the fuzzing to the HF/real-data path"): adversarial
annotation records and image bytes through what ``omnibal train --annotations`` does -- statistics computed with
``on_error="skip"``, :class:`omnibal.data.realdata.RealDataset` joined to them by key, every sample built.

Promise (docs/guarantees.md, "Error behaviour on bad input"): every record either becomes a sample whose tiles and
tokens are exactly its statistics row, or is refused with an InputError naming the annotation file; never another
exception type.
"""

from __future__ import annotations

import io
import json
from itertools import count
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError

pytest.importorskip("tokenizers")

from omnibal.data.realdata import RealDataConfig, RealDataset  # noqa: E402
from omnibal.stats.annotations import compute_stats  # noqa: E402
from omnibal.stats.tiles import TileConfig  # noqa: E402

TOKENIZER = Path(__file__).resolve().parents[1] / "src" / "omnibal" / "examples" / "tokenizer.json"
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])
_n = count()


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 128, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


GOOD = {"id": "a", "image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                                                       {"from": "gpt", "value": "A grey square."}]}
leaf = (st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True) | st.text(max_size=8)
        | st.sampled_from(["<image>", "<image><image>", "a.png", "b.png", "../a.png", "/etc/passwd", "sub/../a.png"]))
json_any = st.recursive(leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    st.sampled_from(["from", "value", "x"]), kids, max_size=3), max_leaves=6)
record = st.one_of(
    st.just(GOOD),
    st.builds(lambda k, v: {**GOOD, k: v}, st.sampled_from(["id", "image", "conversations", "width"]), json_any),
    st.builds(lambda t, k, v: {**GOOD, "conversations": [dict(GOOD["conversations"][0], **{k: v}) if t == 0 else
                                                         GOOD["conversations"][0], GOOD["conversations"][1]]},
              st.integers(0, 1), st.sampled_from(["from", "value"]), json_any),
    st.builds(lambda k: {x: v for x, v in GOOD.items() if x != k}, st.sampled_from(["id", "image", "conversations"])),
)
image_bytes = st.one_of(st.builds(_png, st.integers(1, 90), st.integers(1, 90)),
                        st.builds(lambda w, h, cut: _png(w, h)[:cut], st.integers(1, 40), st.integers(1, 40),
                                  st.integers(0, 120)),
                        st.binary(max_size=64))


@FUZZ
@given(records=st.lists(record, min_size=1, max_size=4), images=st.lists(image_bytes, min_size=2, max_size=2),
       jsonl=st.booleans(), skip=st.booleans())
def test_any_annotation_and_image_becomes_a_sample_of_its_stats_row_or_a_named_error(tmp_path_factory, records,
                                                                                    images, jsonl, skip):
    root = tmp_path_factory.mktemp(f"real{next(_n)}")
    for name, data in zip(("a.png", "b.png"), images):
        (root / name).write_bytes(data)
    records = [dict(r, id=f"{r['id']}{i}") if isinstance(r.get("id"), str) else r for i, r in enumerate(records)]
    path = root / ("ann.jsonl" if jsonl else "ann.json")
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n" if jsonl else json.dumps(records))
    config = RealDataConfig(tokenizer=str(TOKENIZER), tiles=TileConfig(max_tiles=4, tile_size=16), tokens_per_tile=2)
    try:
        stats, _ = compute_stats(path, config.annotation_config(on_error="skip" if skip else "raise", workers=1))
        dataset = RealDataset(path, config, stats=stats)
        samples = [dataset[i] for i in range(len(dataset))]
    except InputError as exc:
        assert str(path) in str(exc) or "ann." in str(exc), exc
        return
    for i, sample in enumerate(samples):
        assert sample["pixel_values"].shape[0] == int(stats.tiles[i])
        assert len(sample["input_ids"]) == int(stats.tokens[i]) == len(sample["labels"])
        assert sample["key"] == int(stats.keys[i])
