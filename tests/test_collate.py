from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal.data.collate import (
    IGNORE_INDEX,
    META_IMAGE_INDEX,
    META_LABELS,
    META_POSITION_IDS,
    META_SEGMENT_IDS,
    CollateConfig,
    collate,
    stack_carries,
)
from omnibal.errors import InputError
from train_helpers import collate_cfg, pack, tiny_dataset, tiny_spec

SPEC = tiny_spec()
TPT = SPEC.llm_tokens_per_tile  # 4
IMG = SPEC.llm.vocab_size - 1


def _samples(tiles, tokens):
    ds = tiny_dataset(SPEC, tiles=tiles, tokens=tokens)
    return [ds[i] for i in range(len(tiles))]


def test_pack_layout():
    samples = _samples([2, 0, 1], [12, 5, 9])
    mb = pack(SPEC, samples, num_tiles=4, num_tokens=32)
    assert mb.pixel_values.shape == (1, 4, 3, 32, 32) and mb.token_meta.shape == (1, 5, 32)
    assert mb.sizes.tolist() == [[3, 26]] and mb.cu_seqlens.tolist() == [0, 12, 17, 26]
    assert mb.tile_mask.tolist() == [[True, True, True, False]]
    assert torch.count_nonzero(mb.pixel_values[0, 3]) == 0
    assert torch.equal(mb.pixel_values[0, 2], samples[2]["pixel_values"][0])
    seg = mb.token_meta[0, META_SEGMENT_IDS]
    assert seg.tolist() == [0] * 12 + [1] * 5 + [2] * 9 + [-1] * 6
    assert mb.token_meta[0, META_POSITION_IDS, 12:17].tolist() == list(range(5))
    # image slots point at consecutive feature rows, tile after tile across samples
    img = mb.token_meta[0, META_IMAGE_INDEX]
    assert img[img >= 0].tolist() == list(range(3 * TPT))
    assert torch.equal(mb.input_ids[0][img >= 0], torch.full((3 * TPT,), IMG))
    # labels are shifted inside each sample and never cross into the next one
    for s, start in zip(samples, [0, 12, 17]):
        n = len(s["input_ids"])
        assert torch.equal(mb.labels[0, start:start + n - 1], s["labels"][1:])
        assert mb.labels[0, start + n - 1] == IGNORE_INDEX
    assert mb.num_targets == sum(int((s["labels"][1:] != IGNORE_INDEX).sum()) for s in samples)


def test_pad_to_longest_rows_are_processed_padding():
    samples = _samples([1, 0], [10, 4])
    mb = pack(SPEC, samples, num_tiles=4, num_tokens=32, mode="pad_to_longest")
    assert mb.sizes.tolist() == [[1, 20]] and mb.cu_seqlens.tolist() == [0, 10, 20]
    assert mb.token_meta[0, META_SEGMENT_IDS, :20].tolist() == [0] * 10 + [1] * 10
    assert mb.token_meta[0, META_POSITION_IDS, 10:20].tolist() == list(range(10))
    assert (mb.token_meta[0, META_LABELS, 13:20] == IGNORE_INDEX).all()
    assert mb.num_real_tokens == 14


def test_overflow_names_the_sample():
    samples = _samples([1, 2, 1], [8, 12, 6])
    with pytest.raises(InputError, match=r"sample 1.*'tiles'"):
        pack(SPEC, samples, num_tiles=2, num_tokens=64)
    with pytest.raises(InputError, match=r"sample 2.*'tokens'"):
        pack(SPEC, samples, num_tiles=8, num_tokens=25)
    with pytest.raises(InputError, match=r"sample 1.*'tokens'"):  # rows of 12: the second row overflows
        pack(SPEC, samples, num_tiles=8, num_tokens=23, mode="pad_to_longest")
    bad = dict(samples[0], input_ids=samples[0]["input_ids"].clone())
    bad["input_ids"][int(torch.nonzero(bad["input_ids"] == IMG)[0])] = 1  # one slot short
    with pytest.raises(InputError, match="image tokens"):
        pack(SPEC, [bad])
    with pytest.raises(InputError, match="mode"):
        CollateConfig(num_tiles=1, num_tokens=1, image_size=32, tokens_per_tile=4, image_token_id=0, mode="x")


def test_stack_carries_concatenates_micro_batches():
    a = pack(SPEC, _samples([1], [8]), num_tiles=2, num_tokens=16)
    b = pack(SPEC, _samples([0, 1], [4, 7]), num_tiles=2, num_tokens=16)
    stacked = stack_carries([a, b])
    assert [t.shape[0] for t in stacked] == [2, 2, 2]
    assert torch.equal(stacked[1].tensor_split(2)[1], b.token_meta)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6)), min_size=1, max_size=5),
       st.sampled_from(["pack", "pad_to_longest"]))
def test_segments_positions_and_targets_property(sizes, mode):
    tiles = [v for v, _ in sizes]
    tokens = [v * TPT + 1 + extra for v, extra in sizes]
    samples = _samples(tiles, tokens)
    row = max(tokens) if mode == "pad_to_longest" else None
    need = row * len(tokens) if row else sum(tokens)
    mb = collate(samples, collate_cfg(SPEC, max(sum(tiles), 1), need + 3, mode))
    lengths = torch.diff(mb.cu_seqlens).tolist()
    assert lengths == ([row] * len(tokens) if row else tokens)
    seg = mb.token_meta[0, META_SEGMENT_IDS]
    pos = mb.token_meta[0, META_POSITION_IDS]
    for k, (s, e) in enumerate(zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist())):
        assert (seg[s:e] == k).all() and pos[s:e].tolist() == list(range(e - s))
    assert (seg[need:] == -1).all() and int(mb.sizes[0, 1]) == need
    assert mb.num_targets == sum(int((s["labels"][1:] != IGNORE_INDEX).sum()) for s in samples)
    img = mb.token_meta[0, META_IMAGE_INDEX]
    assert sorted(img[img >= 0].tolist()) == list(range(sum(tiles) * TPT))


def test_image_slots_are_never_targets_even_if_the_sample_labels_them():
    s = _samples([1], [10])[0]
    s = dict(s, labels=s["input_ids"].clone())  # a careless dataset: every token labelled
    mb = pack(SPEC, [s], num_tiles=2, num_tokens=16)
    assert mb.num_targets == 10 - 1 - TPT
    assert not (mb.labels == IMG).any()
