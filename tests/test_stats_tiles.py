"""The InternVL tile rule: the cross-check table, hand-computed cases, and a scalar reference."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnibal.errors import InputError
from omnibal.stats.tiles import TileConfig, candidate_grids, choose_grids, count_tiles, image_size

# facts.md (../shared/docs, beside the repository) (max 12, thumbnail on), plus the square thresholds it states
CROSS_CHECK = [
    (448, 448, (1, 1), 1),
    (224, 224, (1, 1), 1),
    (800, 600, (4, 3), 13),
    (1920, 1080, (4, 2), 9),
    (100, 2000, (1, 12), 13),
    (4000, 300, (12, 1), 13),
    (1000, 1000, (3, 3), 10),
    (3000, 3000, (3, 3), 10),
    (633, 633, (1, 1), 1),
    (634, 634, (2, 2), 5),
    (950, 950, (2, 2), 5),
    (951, 951, (3, 3), 10),
]


@pytest.mark.parametrize("w,h,grid,tiles", CROSS_CHECK)
def test_cross_check_table(w, h, grid, tiles):
    cols, rows = choose_grids([w], [h])
    assert (int(cols[0]), int(rows[0])) == grid
    assert count_tiles([w], [h]).tolist() == [tiles]


def test_max_six_and_no_thumbnail():
    six = TileConfig(max_tiles=6)
    assert [tuple(map(int, g)) for g in zip(*choose_grids([800, 1000], [600, 1000], six))] == [(3, 2), (2, 2)]
    assert count_tiles([800, 1000], [600, 1000], six).tolist() == [7, 5]
    no_thumb = TileConfig(use_thumbnail=False)
    assert count_tiles([800, 448, 1920], [600, 448, 1080], no_thumb).tolist() == [12, 1, 8]


def test_hand_computed_cases():
    # tiny: 10x10 -> 1 tile; wide 2:1 small -> (2,1) since 2 is the only closest ratio: 2+1
    # tall 1:3 at 300x900 -> (1,3) + thumbnail = 4; huge 10000x10000 -> (3,3) + 1
    # 600x400 and 300x200: ratio 1.5 matches (3,2) exactly -> 6 + 1
    w = [10, 400, 300, 10000, 600, 300]
    h = [10, 200, 900, 10000, 400, 200]
    assert count_tiles(w, h).tolist() == [1, 3, 4, 10, 7, 7]
    # with max 2, ratio 1.5 is equally far from (1,1) and (2,1): the larger grid wins only when the image
    # has more than half its pixels: 600x400 = 240000 > 0.5*448^2*2 = 200704; 300x200 does not
    assert count_tiles([600, 300], [400, 200], TileConfig(max_tiles=2)).tolist() == [3, 1]
    # min_tiles 2 removes (1,1): a square picks (2,2) whatever its size
    assert count_tiles([10], [10], TileConfig(min_tiles=2, max_tiles=12)).tolist() == [5]


def _reference(w: int, h: int, cfg: TileConfig) -> int:
    """The rule written as InternVL states it, one image at a time."""
    aspect = w / h
    best_diff, best = float("inf"), (1, 1)
    for cols, rows in candidate_grids(cfg.min_tiles, cfg.max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best_diff, best = diff, (cols, rows)
        elif diff == best_diff and w * h > 0.5 * cfg.tile_size * cfg.tile_size * cols * rows:
            best = (cols, rows)
    n = best[0] * best[1]
    return n + 1 if cfg.use_thumbnail and n != 1 else n


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 9000), st.integers(1, 9000)), min_size=1, max_size=40),
    max_tiles=st.integers(1, 16),
    min_tiles=st.integers(1, 3),
    thumb=st.booleans(),
    tile=st.sampled_from([224, 336, 448]),
)
def test_vectorised_rule_matches_scalar_reference(sizes, max_tiles, min_tiles, thumb, tile):
    cfg = TileConfig(min_tiles=min(min_tiles, max_tiles), max_tiles=max_tiles, use_thumbnail=thumb, tile_size=tile)
    w, h = zip(*sizes)
    got = count_tiles(w, h, cfg).tolist()
    assert got == [_reference(a, b, cfg) for a, b in sizes]
    assert all(1 <= t <= cfg.max_tiles_per_image for t in got)


def test_candidate_grids_ordered_by_area_and_complete():
    grids = candidate_grids(1, 12)
    areas = [c * r for c, r in grids]
    assert areas == sorted(areas) and len(grids) == len(set(grids)) == 35
    assert max(areas) == 12 and (4, 3) in grids and (12, 1) in grids


def test_bad_sizes_and_configs():
    with pytest.raises(InputError):
        count_tiles([0], [10])
    with pytest.raises(InputError):
        count_tiles([float("nan")], [10])
    with pytest.raises(InputError):
        TileConfig(min_tiles=3, max_tiles=2)


def test_image_size_header_and_exif(tmp_path):
    from PIL import Image

    img = Image.new("RGB", (640, 200), (200, 30, 30))
    exif = Image.Exif()
    exif[0x0112] = 6
    img.save(tmp_path / "rot.jpg", exif=exif.tobytes())
    img.save(tmp_path / "plain.png")
    assert image_size(tmp_path / "rot.jpg") == (200, 640)
    assert image_size(tmp_path / "rot.jpg", apply_exif=False) == (640, 200)
    assert image_size(tmp_path / "plain.png") == (640, 200)
    with pytest.raises(InputError, match="not found") as exc:
        image_size(tmp_path / "missing.png", source="ann.jsonl", record="line 3")
    assert "ann.jsonl" in str(exc.value) and "line 3" in str(exc.value) and exc.value.field == "image"
    (tmp_path / "junk.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    with pytest.raises(InputError, match="unreadable image header"):
        image_size(tmp_path / "junk.jpg", source="ann.jsonl", record="line 4")
