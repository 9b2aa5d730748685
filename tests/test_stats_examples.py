"""`omnibal stats` on the project's own examples gives the hand-computed InternVL tile counts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omnibal.cli import main
from omnibal.examples import ANNOTATIONS, IMAGES_DIR, TOKENIZER
from omnibal.stats.annotations import AnnotationConfig, compute_stats
from omnibal.stats.io import load_stats
from omnibal.stats.tiles import TileConfig, choose_grids, image_size

# Worked by hand with the rule in facts.md (max 12 tiles + thumbnail when the grid has more than one):
#   square 448x448 -> (1,1) = 1            wide 1920x1080 -> ratio 1.78: (2,1)/(4,2) tie at 2, area
#   tall 300x900 -> (1,3) + 1 = 4              2073600 > 0.5*448^2*8 -> (4,2) = 8 + 1 = 9
#   tiny 16x16 -> (1,1) = 1                tiny 40x30 -> ratio 4/3 exactly -> (4,3) = 12 + 1 = 13 (the rule
#   chart 800x600 -> (4,3) + 1 = 13            picks the closest ratio whatever the size)
#   large 3000x3000 -> (3,3) + 1 = 10      photo 1000x750 -> (4,3) + 1 = 13
#   rotated 640x200, EXIF 6 -> shown 200x640, ratio 0.3125 -> (1,3) + 1 = 4 (unrotated: (3,1) + 1 = 4)
#   strip 4000x300 -> (12,1) + 1 = 13
#   multi-0: square + wide = 1 + 9 = 10     multi-1: tall + tiny16 + chart = 4 + 1 + 13 = 18
#   text-0, text-1: 1 dummy tile each       given-size-0: 800x600 given, file absent -> 13
EXPECTED = {
    "single-0": 1, "single-1": 9, "single-2": 4, "single-3": 1, "single-4": 13, "single-5": 13,
    "single-6": 10, "single-7": 13, "single-8": 4, "single-9": 13, "multi-0": 10, "multi-1": 18,
    "text-0": 1, "text-1": 1, "given-size-0": 13,
}  # fmt: skip
IMAGES = {"multi-0": 2, "multi-1": 3, "text-0": 0, "text-1": 0}
RECORDS = [json.loads(line) for line in ANNOTATIONS.read_text().splitlines()]


def test_examples_are_small_and_complete():
    total = sum(p.stat().st_size for p in ANNOTATIONS.parent.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total < 300_000
    assert [r["id"] for r in RECORDS] == list(EXPECTED)


def test_rotated_example_is_read_rotated():
    assert image_size(IMAGES_DIR / "rotated_640x200_exif6.jpg") == (200, 640)
    cols, rows = choose_grids([200], [640])
    assert (int(cols[0]), int(rows[0])) == (1, 3)


def test_tokenizer_vocabulary():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    assert tok.get_vocab_size() == 1143  # trained with target 2048: the small corpus runs out of merges
    assert tok.token_to_id("<img>") is not None and len(tok.encode("What is shown?").ids) < 8


def test_tokenizer_loads_in_transformers():
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER))
    assert len(fast) == 1143  # transformers loads the same vocabulary (not the 1-token failure mode)
    auto = AutoTokenizer.from_pretrained(str(TOKENIZER.parent), local_files_only=True)
    assert len(auto) == 1143


@pytest.mark.parametrize("workers", [1, 2])
def test_compute_stats_on_examples(workers):
    from tokenizers import Tokenizer

    stats, report = compute_stats(ANNOTATIONS,
                                  AnnotationConfig(tokenizer=str(TOKENIZER), workers=workers, chunk_size=4))
    assert stats.tiles.tolist() == list(EXPECTED.values())
    assert stats.images.tolist() == [IMAGES.get(k, 1) for k in EXPECTED]
    tok = Tokenizer.from_file(str(TOKENIZER))
    text = [sum(len(tok.encode(t["value"].replace("<image>", ""), add_special_tokens=False).ids)
                for t in r["conversations"]) for r in RECORDS]  # fmt: skip
    images = stats.images.astype(np.int64)
    expected_tokens = np.array(text) + 256 * stats.tiles * (images > 0) + 2 * images
    assert stats.tokens.tolist() == expected_tokens.tolist()
    assert report.token_count_method.startswith("tokenizer:")
    assert report.num_images == 16 and report.num_sizes_given == 1 and report.num_headers_read == 15


def test_cli_on_examples_writes_the_same_tiles(tmp_path, capsys):
    out = tmp_path / "ex.parquet"
    rc = main(["stats", str(ANNOTATIONS), "--image-root", str(ANNOTATIONS.parent), "--workers", "1",
               "--out", str(out), "--quiet"])  # fmt: skip
    assert rc == 0
    assert "ESTIMATE" in capsys.readouterr().err
    assert load_stats(out).tiles.tolist() == list(EXPECTED.values())


def test_knobs_on_examples():
    base = dict(workers=1)
    no_dummy = compute_stats(ANNOTATIONS, AnnotationConfig(count_dummy_tile=False, **base))[0]
    assert no_dummy.tiles.tolist()[12:14] == [0, 0]
    six = compute_stats(ANNOTATIONS, AnnotationConfig(tiles=TileConfig(max_tiles=6), **base))[0]
    assert six.tiles.tolist()[5] == 7  # 800x600 -> (3,2) + 1 with max 6
    split = compute_stats(ANNOTATIONS, AnnotationConfig(split_max_tiles=True, **base))[0]
    # multi-1 has 3 images: max 12 // 3 = 4 per image: tall (1,3)+1 = 4, tiny 1, chart 800x600 -> (2,2)+1 = 5
    assert split.tiles.tolist()[11] == 10
    estimate = compute_stats(ANNOTATIONS, AnnotationConfig(**base))[1]
    assert estimate.token_count_method == "estimate"
