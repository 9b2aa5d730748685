"""Samples matched to a Hugging Face checkpoint (``RealDataConfig.from_hf``, ``omnibal.data.hf_conventions``):
the tile size, tokens per tile, tile cap, markers and token ids come from the checkpoint's own files; the samples
run through the HF forward; a hand-made config that does not fit the model is refused by field before any
forward (``RealDataset.check_model``, ``OmnibalTrainer``); ``omnibal stats --hf-model`` counts what the dataset
builds; ``omnibal train`` refuses statistics made for another convention. Tiny random-init models built from
config objects (one layer each), the packaged example annotations and tokenizer: single process, a few seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from omnibal.cli import main  # noqa: E402
from omnibal.data.realdata import RealDataConfig, RealDataset  # noqa: E402
from omnibal.errors import InputError  # noqa: E402
from omnibal.stats.io import load_stats  # noqa: E402
from omnibal.stats.tiles import TileConfig  # noqa: E402

torch.set_num_threads(1)
EXAMPLES = Path(__file__).resolve().parents[1] / "src" / "omnibal" / "examples"
ANNOTATIONS = EXAMPLES / "annotations.jsonl"
TOKENIZER = EXAMPLES / "tokenizer.json"  # <img> = 1, </img> = 2, <IMG_CONTEXT> = 3 (added tokens)
VOCAB = 1152
TOKENS_PER_TILE = {"llava": 16, "internvl": 4}  # 32 px tiles of 8 px patches; InternVL's pixel shuffle 0.5
NORM = {"image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3]}


def _build(kind: str):
    tf = transformers
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB)
    torch.manual_seed(0)
    if kind == "llava":
        cfg = tf.LlavaConfig(vision_config=tf.CLIPVisionConfig(image_size=32, patch_size=8, **vision),
                             text_config=tf.LlamaConfig(**text), image_token_id=3, vision_feature_layer=-1)
        return tf.LlavaForConditionalGeneration(cfg).float()
    cfg = tf.InternVLConfig(vision_config=tf.InternVLVisionConfig(image_size=[32, 32], patch_size=[8, 8], **vision),
                            text_config=tf.Qwen2Config(**text), image_token_id=3, downsample_ratio=0.5)
    return tf.InternVLForConditionalGeneration(cfg).float()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{kind: (folder, model)}``: a saved tiny checkpoint with the example tokenizer; InternVL's with a
    ``preprocessor_config.json`` (tile cap 3, its own mean and std)."""
    root = tmp_path_factory.mktemp("hf-matched")
    out = {}
    for kind in ("llava", "internvl"):
        model = _build(kind)
        folder = root / kind
        model.save_pretrained(folder)
        shutil.copy(TOKENIZER, folder / "tokenizer.json")
        if kind == "internvl":
            doc = {"image_processor_type": "GotOcr2ImageProcessor", "min_patches": 1, "max_patches": 3, **NORM}
            (folder / "preprocessor_config.json").write_text(json.dumps(doc))
        out[kind] = (folder, model)
    return out


def _samples(ds: RealDataset) -> list[dict]:
    """Every sample that builds (the example file has a record whose image is missing on purpose)."""
    out = []
    for i in range(len(ds)):
        try:
            out.append(ds[i])
        except InputError:
            continue
    return out


def test_from_hf_takes_the_checkpoints_tiles_tokens_markers_and_ids(checkpoints):
    folder, model = checkpoints["internvl"]
    cfg = RealDataConfig.from_hf(folder)
    assert cfg.tiles == TileConfig(min_tiles=1, max_tiles=3, tile_size=32, use_thumbnail=True)
    assert (cfg.tokens_per_tile, cfg.image_marker_tokens) == (4, 2)
    assert (cfg.image_token_id, cfg.image_start_id, cfg.image_end_id) == (3, 1, 2)
    assert cfg.tokenizer == str(folder) and list(cfg.image_mean) == NORM["image_mean"]
    assert RealDataConfig.from_hf(folder, max_tiles=6, tokens_per_turn=2).tiles.max_tiles == 6
    # a config or a model object: the same, less what only the folder has (tile cap, normalisation)
    for other in (model.config, model):
        got = RealDataConfig.from_hf(other, tokenizer=TOKENIZER)
        assert (got.tiles.tile_size, got.tokens_per_tile, got.image_marker_tokens, got.image_start_id) == (32, 4, 2, 1)
        assert got.tiles.max_tiles == 12
    folder, _ = checkpoints["llava"]
    cfg = RealDataConfig.from_hf(folder, max_tiles=6)  # a Llava image is one tile whatever the cap
    assert cfg.tiles == TileConfig(min_tiles=1, max_tiles=1, tile_size=32, use_thumbnail=False)
    assert (cfg.tokens_per_tile, cfg.image_marker_tokens, cfg.image_token_id) == (16, 0, 3)


@pytest.mark.parametrize("kind", ["llava", "internvl"])
def test_samples_from_from_hf_run_through_the_hf_forward(checkpoints, kind):
    from omnibal.integrations.hf import HFPackCollator

    folder, model = checkpoints[kind]
    ds = RealDataset(ANNOTATIONS, RealDataConfig.from_hf(folder))
    ds.check_model(folder)
    ds.check_model(model)
    samples = _samples(ds)
    assert len(samples) >= 10 and (kind == "llava" or any(s["pixel_values"].shape[0] > 2 for s in samples))
    with torch.no_grad():
        for s in samples[:4]:
            has_image = bool((s["input_ids"] == 3).any())
            out = model(input_ids=s["input_ids"][None], pixel_values=s["pixel_values"] if has_image else None,
                        labels=s["labels"][None])
            assert torch.isfinite(out.loss)
        batch = HFPackCollator.for_model(model, tokens_per_tile=TOKENS_PER_TILE[kind])(samples)
        assert torch.isfinite(model(**batch).loss)


def _refused(ds, model, field: str):
    with pytest.raises(InputError, match=rf"^RealDataConfig of .*annotations.jsonl: field '{field}': the data has"):
        ds.check_model(model)


def test_a_config_that_does_not_fit_the_model_is_refused_by_field(checkpoints):
    folder, model = checkpoints["internvl"]
    base = dict(tokenizer=str(TOKENIZER))
    # the blind defaults (448 px tiles, 256 tokens): before, HF's "Image features and image tokens do not match"
    _refused(RealDataset(ANNOTATIONS, RealDataConfig(**base)), folder, "tiles.tile_size")
    tiles = TileConfig(tile_size=32)
    _refused(RealDataset(ANNOTATIONS, RealDataConfig(**base, tiles=tiles)), model, "tokens_per_tile")
    _refused(RealDataset(ANNOTATIONS, RealDataConfig(**base, tiles=tiles, tokens_per_tile=4, image_marker_tokens=0)),
             model, "image_marker_tokens")
    _refused(RealDataset(ANNOTATIONS, RealDataConfig(**base, tiles=tiles, tokens_per_tile=4, image_token_id=7)),
             model, "image_token_id")
    _refused(RealDataset(ANNOTATIONS, RealDataConfig(**base, tiles=tiles, tokens_per_tile=4, image_start_id=9)),
             model, "image_start_id")
    folder, model = checkpoints["llava"]
    llava = dict(base, tiles=tiles, tokens_per_tile=16)
    _refused(RealDataset(ANNOTATIONS, RealDataConfig(**llava)), model, "image_marker_tokens")  # no <img> for Llava
    _refused(RealDataset(ANNOTATIONS, RealDataConfig(**llava, image_marker_tokens=0)), model, "tiles.max_tiles")
    one = TileConfig(max_tiles=1, tile_size=32, use_thumbnail=False)
    RealDataset(ANNOTATIONS, RealDataConfig(**dict(llava, tiles=one), image_marker_tokens=0)).check_model(model)


def test_omnibal_trainer_refuses_such_a_dataset_before_any_forward(checkpoints, tmp_path):
    from transformers import TrainingArguments

    from omnibal.integrations.hf import OmnibalTrainer

    _, model = checkpoints["internvl"]
    bad = RealDataset(ANNOTATIONS, RealDataConfig(tokenizer=str(TOKENIZER), tiles=TileConfig(tile_size=32)))
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=1, use_cpu=True, report_to=[])
    with pytest.raises(InputError, match="'tokens_per_tile': the data has tokens_per_tile 256, the model takes 4"):
        OmnibalTrainer(model=model, args=args, train_dataset=bad)


def test_from_hf_refuses_what_the_checkpoint_sets_and_a_tokenizer_without_markers(checkpoints, tmp_path):
    folder, _ = checkpoints["internvl"]
    with pytest.raises(InputError, match=r"^RealDataConfig.from_hf: field 'tokens_per_tile': set by the checkpoint"):
        RealDataConfig.from_hf(folder, tokens_per_tile=256)
    no_markers = tmp_path / "tokenizer.json"
    no_markers.write_text(TOKENIZER.read_text().replace('"<img>"', '"<image_start>"'))
    with pytest.raises(InputError, match=r"field 'tokenizer': internvl wraps every image in <img> \.\.\. </img>"):
        RealDataConfig.from_hf(folder, tokenizer=no_markers)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(folder / "config.json", bare / "config.json")
    with pytest.raises(InputError, match=r"bare/config.json: field 'tokenizer': no tokenizer given"):
        RealDataConfig.from_hf(bare)


def test_stats_hf_model_counts_what_the_dataset_builds(checkpoints, tmp_path, capsys):
    folder, _ = checkpoints["internvl"]
    out = tmp_path / "stats.jsonl"
    argv = ["stats", str(ANNOTATIONS), "--hf-model", str(folder), "--on-error", "skip", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 0
    stats = load_stats(out)
    assert str(stats.convention) == "internvl/4"
    ds = RealDataset(ANNOTATIONS, RealDataConfig.from_hf(folder))  # no stats: the sizes are compared here
    built = 0
    for i, key in enumerate(stats.keys):
        row = int(np.flatnonzero(ds.keys == key)[0])
        images = ds.records[row].get("image") or []
        if not all((EXAMPLES / p).is_file() for p in ([images] if isinstance(images, str) else images)):
            continue  # the record whose image is missing on purpose (counted from its width/height)
        s = ds[row]
        assert (s["pixel_values"].shape[0], len(s["input_ids"])) == (stats.tiles[i], stats.tokens[i]), i
        built += 1
    assert built >= 10
    assert stats.tiles[stats.images == 1].max() == 4  # 3 tiles + the thumbnail: the checkpoint's cap
    capsys.readouterr()
    assert main([*argv, "--tile-size", "448"]) == 2
    assert "omnibal stats: error: --tile-size: set by --hf-model" in capsys.readouterr().err


def test_train_refuses_statistics_made_for_another_convention(checkpoints, tmp_path):
    from omnibal.train.hf_run import real_stats

    folder, _ = checkpoints["internvl"]
    blind = tmp_path / "blind.jsonl"  # omnibal stats without --hf-model: 448 px tiles, 256 tokens per tile
    assert main(["stats", str(ANNOTATIONS), "--tokenizer", str(TOKENIZER), "--on-error", "skip", "--quiet",
                 "--out", str(blind)]) == 0
    cfg = SimpleNamespace(stats_path=str(blind), annotations_path=str(ANNOTATIONS), on_error="skip")
    with pytest.raises(InputError, match=r"blind.jsonl: field 'convention': made for InternVL tiles, 256 tokens per "
                                         r"tile .* takes InternVL tiles, 4 tokens per tile .*--hf-model"):
        real_stats(cfg, RealDataConfig.from_hf(folder))
