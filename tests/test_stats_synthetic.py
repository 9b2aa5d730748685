"""The synthetic InternVL-like mixture: deterministic, shaped like the rule allows, documented knobs work."""

from __future__ import annotations

import numpy as np
import pytest

from omnibal.errors import InputError
from omnibal.stats.synthetic import (
    INTERNVL_12_SFT,
    SyntheticConfig,
    mixture_layout,
    split_counts,
    synthetic_internvl_mixture,
)
from omnibal.stats.tiles import TileConfig


def test_default_weights_are_the_1_2m_mixture():
    assert sum(p.weight for p in INTERNVL_12_SFT) == 1_200_000


def test_deterministic_and_seeded():
    a = synthetic_internvl_mixture(20_000, seed=3)
    assert a.equals(synthetic_internvl_mixture(20_000, seed=3))
    b = synthetic_internvl_mixture(20_000, seed=4)
    assert not np.array_equal(a.tokens, b.tokens)
    assert len(a) == 20_000 and len(set(a.keys.tolist())) == 20_000


def test_values_follow_the_tile_rule_and_token_budget():
    s = synthetic_internvl_mixture(50_000, seed=0)
    assert s.tiles.min() >= 1 and s.tiles.max() <= 5
    # the published statistics' rule (max 4 + thumbnail): 2 tiles is impossible, 5 is reachable
    counts = np.bincount(s.tiles, minlength=6)
    assert counts[2] == 0 and counts[5] > 0 and counts[1] > 0
    with_images = s.images > 0
    text = s.tokens[with_images] - 256 * s.tiles[with_images] - 2
    assert text.min() >= 8  # text floor of every profile
    layout = dict((n, (a, b)) for n, a, b in mixture_layout(50_000))
    a, b = layout["text_only"]
    assert (s.images[a:b] == 0).all() and (s.tiles[a:b] == 1).all()
    a, b = layout["synthetic_bar_charts"]
    assert (s.tiles[a:b] == 1).all()  # 448x448 charts are one tile


def test_knobs_dummy_tile_max_tiles_and_clip():
    cfg = SyntheticConfig(count_dummy_tile=False, tiles=TileConfig(max_tiles=6), max_tokens=2048)
    s = synthetic_internvl_mixture(30_000, seed=1, config=cfg)
    assert s.tiles.max() <= 7 and s.tokens.max() <= 2048
    assert ((s.images == 0) == (s.tiles == 0)).all()


def test_split_counts_exact_and_bad():
    c = split_counts(7, [1, 1, 1])
    assert c.sum() == 7 and sorted(c.tolist()) == [2, 2, 3]
    with pytest.raises(InputError):
        split_counts(0, [1])
