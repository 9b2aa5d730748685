from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from omnibal.data.collate import IGNORE_INDEX, PackCollator
from omnibal.errors import InputError
from train_helpers import collate_cfg, tiny_dataset, tiny_spec

SPEC = tiny_spec()


def test_samples_have_the_stats_shapes_and_are_deterministic():
    tiles, tokens = [0, 1, 3, 2], [5, 9, 40, 30]
    ds = tiny_dataset(SPEC, tiles, tokens, seed=7)
    for i, (v, t) in enumerate(zip(tiles, tokens)):
        s = ds[i]
        assert s["pixel_values"].shape == (v, 3, 32, 32) and s["input_ids"].shape == (t,) == s["labels"].shape
        assert int((s["input_ids"] == SPEC.llm.vocab_size - 1).sum()) == v * SPEC.llm_tokens_per_tile
        text = t - v * SPEC.llm_tokens_per_tile
        assert int((s["labels"] != IGNORE_INDEX).sum()) == min(round(0.5 * text), text - 1)
        again = tiny_dataset(SPEC, tiles, tokens, seed=7)[i]
        assert all(torch.equal(s[k], again[k]) for k in ("pixel_values", "input_ids", "labels"))
    other = tiny_dataset(SPEC, tiles, tokens, seed=8)[2]
    assert not torch.equal(other["input_ids"], ds[2]["input_ids"])


def test_too_few_tokens_for_the_tiles_is_named():
    with pytest.raises(InputError, match=r"index 1.*'tokens'"):
        tiny_dataset(SPEC, [1, 2], [9, 8])


def test_dataloader_workers_with_the_pack_collator():
    ds = tiny_dataset(SPEC, [1, 0, 2, 1], [9, 5, 12, 7])
    packs = [[0, 1], [2, 3]]
    loader = DataLoader(ds, batch_sampler=packs, num_workers=2, collate_fn=PackCollator(collate_cfg(SPEC, 4, 24)),
                        multiprocessing_context="fork")
    batches = list(loader)
    assert [b.sample_indices for b in batches] == [(0, 1), (2, 3)]
    assert [b.sizes.tolist() for b in batches] == [[[1, 14]], [[3, 19]]]


def test_text_only_rows_with_a_dummy_tile_run_the_encoder_but_fill_no_slot():
    from omnibal.data.collate import collate
    from omnibal.data.dataset import SyntheticSampleConfig, SyntheticVLMDataset
    from omnibal.stats.table import SampleStats

    stats = SampleStats.from_arrays(tiles=[1, 2], tokens=[6, 12], images=[0, 1], source="dummy")
    ds = SyntheticVLMDataset(stats, SyntheticSampleConfig(image_size=32, tokens_per_tile=4, vocab_size=64,
                                                    image_token_id=63))
    s0 = ds[0]
    assert s0["pixel_values"].shape[0] == 1 and not (s0["input_ids"] == 63).any()
    mb = collate([s0, ds[1]], collate_cfg(SPEC, 4, 24))
    assert mb.sizes.tolist() == [[3, 18]]
    img = mb.image_index[0]
    # the dummy tile is slot 0; the second sample's two tiles fill rows 4..11
    assert img[img >= 0].tolist() == list(range(4, 12))


def test_stats_for_model_swaps_the_image_token_count_of_image_rows_only():
    from omnibal.data.dataset import stats_for_model
    from omnibal.stats.table import SampleStats

    stats = SampleStats.from_arrays(tiles=[1, 3, 1], tokens=[300, 800, 40], images=[1, 1, 0], source="s")
    out = stats_for_model(stats, 16)
    assert out.tokens.tolist() == [300 - 240, 800 - 3 * 240, 40]
    assert np.array_equal(out.keys, stats.keys) and np.array_equal(out.tiles, stats.tiles)
    with pytest.raises(InputError, match=r"index 0.*'tokens'"):
        stats_for_model(SampleStats.from_arrays(tiles=[2], tokens=[500], source="s"), 16)


def test_real_statistics_make_a_dataset_for_the_tiny_preset(shared_stats_dir):
    from omnibal.cost.presets import get_model_preset
    from omnibal.data.dataset import SyntheticSampleConfig, SyntheticVLMDataset, stats_for_model
    from omnibal.stats.io import load_stats

    loaded = load_stats(shared_stats_dir / "ai2d_train_12k_wh_token_lengths.json")
    stats = loaded[0] if isinstance(loaded, tuple) else loaded
    spec = get_model_preset("tiny")
    model_stats = stats_for_model(stats, spec.llm_tokens_per_tile)
    ds = SyntheticVLMDataset(model_stats, SyntheticSampleConfig(image_size=spec.vision.image_size,
                                                          tokens_per_tile=spec.llm_tokens_per_tile,
                                                          vocab_size=spec.llm.vocab_size,
                                                          image_token_id=spec.llm.vocab_size - 1))
    for i in (0, len(ds) // 2, len(ds) - 1):
        s = ds[i]
        assert s["pixel_values"].shape[0] == stats.tiles[i]
        assert len(s["input_ids"]) == model_stats.tokens[i] == stats.tokens[i] - 240 * stats.tiles[i]
