from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from omnibal import examples
from omnibal.data.collate import IGNORE_INDEX, CollateConfig, collate
from omnibal.data.realdata import RealDataConfig, RealDataset
from omnibal.errors import InputError
from omnibal.stats import annotations as stats_annotations
from omnibal.stats.tiles import TileConfig, count_tiles

pytest.importorskip("tokenizers")

TEXTS = ["What is shown in the chart?", "A bar chart of sales by year.", "Describe the image.",
         "Two cats sit on a red sofa near a window.", "Which year had the most sales?", "2019 had the most."]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """A small LLaVA-style set: a wide image, a tall one with EXIF rotation, a two-image record, a text-only one."""
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("llava")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (30, 100, 3), dtype=np.uint8)).save(root / "wide.png")
    tall = Image.fromarray(rng.integers(0, 255, (90, 40, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: a viewer sees it 90 x 40
    tall.save(root / "tall.jpg", exif=exif)
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / "small.png")
    records = [
        {"id": "a", "image": "wide.png", "conversations": [{"from": "human", "value": "<image>\n" + TEXTS[0]},
                                                           {"from": "gpt", "value": TEXTS[1]}]},
        {"id": "b", "image": "tall.jpg", "conversations": [{"from": "human", "value": TEXTS[2]},
                                                           {"from": "gpt", "value": TEXTS[3]},
                                                           {"from": "human", "value": TEXTS[4]},
                                                           {"from": "gpt", "value": TEXTS[5]}]},
        {"image": ["small.png", "wide.png"], "conversations": [
            {"from": "human", "value": "<image> left, right <image>" + TEXTS[0]}, {"from": "gpt", "value": TEXTS[1]}]},
        {"id": "d", "conversations": [{"from": "human", "value": TEXTS[4]}, {"from": "gpt", "value": TEXTS[5]}]},
    ]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return root, tok


def _config(root, **kw):
    return RealDataConfig(tokenizer=str(root / "tokenizer.json"), tiles=TileConfig(max_tiles=6, tile_size=32),
                          tokens_per_tile=4, tokens_per_turn=3, tokens_per_sample=1, **kw)


def test_sizes_follow_the_tile_rule_and_the_token_count(example):
    root, tok = example
    ds = RealDataset(root / "train.jsonl", _config(root))
    count = lambda text: len(tok.encode(text.replace("<image>", ""), add_special_tokens=False).ids)  # noqa: E731
    tiles = [int(count_tiles([100], [30], TileConfig(max_tiles=6, tile_size=32))[0]),
             int(count_tiles([90], [40], TileConfig(max_tiles=6, tile_size=32))[0]),
             1 + int(count_tiles([100], [30], TileConfig(max_tiles=6, tile_size=32))[0]), 1]
    assert tiles[0] > 1 and tiles[1] > 1
    texts = [["<image>\n" + TEXTS[0], TEXTS[1]], TEXTS[2:6], ["<image> left, right <image>" + TEXTS[0], TEXTS[1]],
             TEXTS[4:6]]
    images = [1, 1, 2, 0]
    for i, s in enumerate(ds[i] for i in range(len(ds))):
        assert s["pixel_values"].shape == (tiles[i], 3, 32, 32), i
        expected = (1 + sum(count(t) + 3 for t in texts[i]) + images[i] * 2
                    + (tiles[i] * 4 if images[i] else 0))
        assert s["input_ids"].shape == (expected,), i
        assert int((s["input_ids"] == ds.image_token_id).sum()) == (tiles[i] * 4 if images[i] else 0)
        # targets are exactly the assistant turns' text tokens
        answers = texts[i][1::2]
        assert int((s["labels"] != IGNORE_INDEX).sum()) == sum(count(t) for t in answers)
    # the EXIF-rotated image is tiled as seen (90 x 40: wide), not as stored (40 x 90: tall)
    raw = RealDataset(root / "train.jsonl", _config(root, apply_exif=False))[1]
    assert raw["pixel_values"].shape[0] == int(count_tiles([40], [90], TileConfig(max_tiles=6, tile_size=32))[0])


def test_image_tokens_sit_where_the_placeholder_was_and_pixels_are_normalised(example):
    root, tok = example
    ds = RealDataset(root / "train.jsonl", _config(root))
    s = ds[2]  # "<image> left, right <image>..." : first block right after the template, second after "right"
    ids = s["input_ids"].tolist()
    first = ids.index(ds.image_start_id)
    assert first == 1 + 3  # sample template, turn template
    ends = [k for k, x in enumerate(ids) if x == ds.image_end_id]
    starts = [k for k, x in enumerate(ids) if x == ds.image_start_id]
    between = "".join(tok.id_to_token(i) for i in ids[ends[0] + 1:starts[1]]).replace("\u0120", " ")
    assert between.strip() == "left, right"
    assert abs(float(s["pixel_values"].mean())) < 1.5 and float(s["pixel_values"].std()) > 0.5
    cfg = CollateConfig(num_tiles=16, num_tokens=256, image_size=32, tokens_per_tile=4,
                        image_token_id=ds.image_token_id)
    mb = collate([ds[i] for i in range(len(ds))], cfg)
    assert mb.num_real_tokens == sum(len(ds[i]["input_ids"]) for i in range(len(ds)))
    assert int(mb.sizes[0, 0]) == sum(ds[i]["pixel_values"].shape[0] for i in range(len(ds)))


def test_bad_records_are_named(example, tmp_path):
    root, _ = example
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"image": "missing.png", "conversations": [{"from": "human", "value": "hi"}]}) + "\n"
                   + json.dumps({"image": ["a.png"], "conversations": [{"from": "human", "value": "<image><image>"}]})
                   + "\n{oops\n" + json.dumps({"image": "wide.png"}) + "\n")
    # the reader `omnibal stats` uses checks every record when the file is read: the first bad one is named
    with pytest.raises(InputError, match=r"line 2.*placeholder"):
        RealDataset(bad, _config(root))
    bad.write_text(bad.read_text().split("\n")[0] + "\n" + json.dumps({"image": "wide.png"}) + "\n")
    with pytest.raises(InputError, match=r"line 2.*'conversations'.*missing"):
        RealDataset(bad, _config(root))
    bad.write_text(bad.read_text().split("\n")[0] + "\n")
    ds = RealDataset(bad, _config(root, image_root=str(root)))
    with pytest.raises(InputError, match=r"line 1.*'image'.*missing.png"):
        ds[0]


def test_rows_follow_the_statistics_whatever_omnibal_stats_skipped(example, tmp_path):
    """`omnibal stats --on-error skip` drops a broken record: row 0 of its statistics is the file's second
    record, and the dataset (given the statistics) must build that record for row 0, not the broken one."""
    from omnibal.stats.annotations import compute_stats

    root, _ = example
    good = (root / "train.jsonl").read_text().splitlines()
    ann = tmp_path / "skip.jsonl"
    ann.write_text("\n".join([json.dumps({"id": "broken", "conversations": []})] + good) + "\n")
    cfg = _config(root, image_root=str(root))
    stats, report = compute_stats(ann, cfg.annotation_config(on_error="skip"))
    assert report.num_skipped == 1 and len(stats) == 4
    ds = RealDataset(ann, cfg, stats=stats)
    plain = RealDataset(root / "train.jsonl", _config(root))
    assert len(ds) == 4 and ds.locators[0] == "line 2"
    for i in range(4):
        assert ds.key(i) == int(stats.keys[i])
        s = ds[i]
        assert (s["pixel_values"].shape[0], len(s["input_ids"])) == (stats.tiles[i], stats.tokens[i])
        assert torch.equal(s["input_ids"], plain[i]["input_ids"])  # the same record as in the clean file
    # statistics of another file, or made with other settings, are refused by name
    other = stats.take(np.array([1, 0, 2, 3]))
    moved = type(stats)(tiles=other.tiles, tokens=other.tokens, images=other.images, keys=stats.keys, source="x")
    with pytest.raises(InputError, match=r"row 0.*other settings"):
        RealDataset(ann, cfg, stats=moved)[0]
    foreign = type(stats)(tiles=stats.tiles, tokens=stats.tokens, images=stats.images,
                          keys=stats.keys + np.uint64(1), source="x")
    with pytest.raises(InputError, match=r"row 0.*matches no valid record"):
        RealDataset(ann, cfg, stats=foreign)


def test_duplicate_ids_and_images_outside_the_root_are_refused(example, tmp_path):
    root, _ = example
    rec = {"id": "same", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(InputError, match=r"line 1 and line 2 have the same id"):
        RealDataset(dup, _config(root))
    inside = tmp_path / "imgs"
    inside.mkdir()
    out = tmp_path / "outside.jsonl"
    out.write_text(json.dumps({"image": "../imgs/../../x.png", **rec}) + "\n")
    ds = RealDataset(out, _config(root, image_root=str(inside)))
    with pytest.raises(InputError, match="outside the image root"):  # as `omnibal stats` refuses it
        ds[0]


def test_dataloader_workers_can_pickle_the_dataset(example):
    import pickle

    root, _ = example
    ds = RealDataset(root / "train.jsonl", _config(root))
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[0]["input_ids"], ds[0]["input_ids"])


def test_stats_property_measures_every_sample(example):
    root, _ = example
    ds = RealDataset(root / "train.jsonl", _config(root))
    st = ds.stats
    assert st.tiles.tolist() == [ds[i]["pixel_values"].shape[0] for i in range(len(ds))]
    assert st.tokens.tolist() == [len(ds[i]["input_ids"]) for i in range(len(ds))]
    assert st.images.tolist() == [1, 1, 2, 0]


def test_the_project_examples_have_exactly_the_sizes_omnibal_stats_computes():
    from omnibal.stats.tokens import TokenConfig

    # small tiles keep the test fast; the rule and the token layout are what is compared
    ann = stats_annotations.AnnotationConfig(tokenizer=str(examples.TOKENIZER), tiles=TileConfig(tile_size=28),
                                       tokens=TokenConfig(tokens_per_tile=4, image_marker_tokens=2, tokens_per_turn=2,
                                                          tokens_per_sample=1))
    expected, _ = stats_annotations.compute_stats(examples.ANNOTATIONS, ann)
    ds = RealDataset(examples.ANNOTATIONS, RealDataConfig.like_stats(ann))
    assert len(ds) == len(expected) >= 10
    assert ds.image_token_id == 3 and ds.image_start_id == 1  # the tokenizer's own <IMG_CONTEXT>, <img>
    checked = 0
    for i in range(len(ds)):
        rec = ds.records[i]
        if "width" in rec:  # sizes given in the record and no image file: stats need no pixels, samples do
            with pytest.raises(InputError, match="image not found"):
                ds[i]
            continue
        s = ds[i]
        assert s["pixel_values"].shape[0] == expected.tiles[i], rec.get("id")
        assert len(s["input_ids"]) == expected.tokens[i], rec.get("id")
        assert s["key"] == int(expected.keys[i]), rec.get("id")
        checked += 1
    assert checked >= 12


def test_real_samples_train_the_reference_model(example):
    from omnibal.cost.spec import LLMSpec, ModelSpec, VisionSpec
    from omnibal.train.model import VLM

    root, _ = example
    ds = RealDataset(root / "train.jsonl", _config(root))
    spec = ModelSpec(name="real-tiny", vision=VisionSpec(num_layers=1, hidden=32, num_heads=4, mlp_hidden=64,
                                                          image_size=32, patch_size=8),
                     llm=LLMSpec(num_layers=1, hidden=32, num_heads=4, num_kv_heads=2, mlp_hidden=64,
                                 vocab_size=ds.vocab_size_needed))
    model = VLM(spec)
    assert spec.llm_tokens_per_tile == ds.config.tokens_per_tile
    cfg = model.collate_config(num_tiles=16, num_tokens=256, image_token_id=ds.image_token_id)
    batch = collate([ds[i] for i in range(len(ds))], cfg)
    loss, count = model.loss(batch)
    loss.backward()
    assert int(count) == batch.num_targets > 0 and torch.isfinite(loss).all()
    assert model.vision.embed.patch.weight.grad.abs().sum() > 0  # the real image tiles reached the loss


def test_default_internvl_settings_equal_the_omnibal_stats_cli(tmp_path):
    """448 px tiles, 256 tokens per tile, max 12 + thumbnail: what `omnibal stats` writes for the examples."""
    from omnibal.cli import main
    from omnibal.stats.io import load_stats

    out = tmp_path / "stats.jsonl"
    assert main(["stats", str(examples.ANNOTATIONS), "--tokenizer", str(examples.TOKENIZER), "--out", str(out),
                 "--quiet"]) == 0
    loaded = load_stats(out)
    expected = loaded[0] if isinstance(loaded, tuple) else loaded
    ds = RealDataset(examples.ANNOTATIONS, RealDataConfig(tokenizer=str(examples.TOKENIZER)))
    for i in range(len(ds)):
        if "width" in ds.records[i]:
            continue  # size given, image file absent: only the statistics can be made
        s = ds[i]
        assert (s["pixel_values"].shape[0], len(s["input_ids"])) == (expected.tiles[i], expected.tokens[i]), i
        assert s["pixel_values"].shape[1:] == (3, 448, 448)


def test_records_without_an_id_get_the_key_omnibal_stats_gives(example):
    from omnibal.stats.table import index_keys

    root, _ = example
    ds = RealDataset(root / "train.jsonl", _config(root))
    assert "id" not in ds.records[2]
    # keys join stats to the dataset, so they must not depend on how the path was spelled
    assert ds.key(2) == int(index_keys("train.jsonl", 3)[2])
    assert RealDataset(str(root / "." / "train.jsonl"), _config(root)).key(2) == ds.key(2)
