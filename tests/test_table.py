import numpy as np
import pytest

from omnibal.errors import InputError
from omnibal.stats.table import SampleStats, index_keys


def test_columns_are_typed_readonly_and_keys_distinct():
    s = SampleStats.from_arrays(tiles=[1, 5, 13], tokens=[300, 1500, 4000], source="t")
    assert s.tiles.dtype == np.int32 and s.keys.dtype == np.uint64
    assert s.images.tolist() == [1, 1, 1]
    assert len(set(s.keys.tolist())) == 3
    with pytest.raises(ValueError):
        s.tiles[0] = 7


@pytest.mark.parametrize(
    "field,tiles,tokens,match",
    [
        ("tokens", [1, 2], [10, 0], "index 1"),
        ("tiles", [-1, 2], [10, 10], "index 0"),
        ("tokens", [1, 2], [10.0, float("nan")], "whole number"),
        ("tiles", [1, 10**6], [10, 10], "out of range|must be in"),
    ],
)
def test_bad_values_name_field_and_record(field, tiles, tokens, match):
    with pytest.raises(InputError, match=match) as exc:
        SampleStats.from_arrays(tiles=tiles, tokens=tokens, source="bad.json")
    assert exc.value.field == field and "bad.json" in str(exc.value)


def test_replicate_take_concat_fingerprint():
    s = SampleStats.from_arrays(tiles=[1, 2, 3], tokens=[10, 20, 30], source="x")
    r = s.replicate(8)
    assert r.tiles.tolist() == [1, 2, 3, 1, 2, 3, 1, 2]
    assert len(set(r.keys.tolist())) == 8
    assert r.take([0, 1, 2]).equals(s)
    c = SampleStats.concat([s, s.take([2])])
    assert c.tokens.tolist() == [10, 20, 30, 30]
    assert s.fingerprint() == s.take([0, 1, 2]).fingerprint() != r.fingerprint()


def test_index_keys_stable_across_calls():
    assert np.array_equal(index_keys("a.json", 5), index_keys("a.json", 5))
    assert not np.array_equal(index_keys("a.json", 5), index_keys("b.json", 5))


def test_pack_features_sums_packs_and_handles_empty_ones_anywhere():
    from omnibal.cost.table import pack_features

    tiles, tokens = np.array([1, 2, 3, 4]), np.array([10, 20, 30, 40])
    f = pack_features(tiles, tokens, np.array([0, 0, 2, 2, 4, 4]))  # empty first, middle and last packs
    assert f[:, 0].tolist() == [1, 1, 1, 1, 1]
    assert f[:, 1].tolist() == [0, 3, 0, 7, 0]
    assert f[:, 2].tolist() == [0, 30, 0, 70, 0]
    assert f[:, 3].tolist() == [0, 500, 0, 2500, 0]
    assert pack_features(tiles[:0], tokens[:0], np.array([0, 0])).tolist() == [[1, 0, 0, 0]]
    assert pack_features(tiles, tokens, np.array([0])).shape == (0, 4)
