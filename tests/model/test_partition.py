"""PP partition: sglang's get_pp_indices rules, explicit partitions, and tiling."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.model.partition import parse_partition, partition_layers, pp_indices


def test_flash_pp4_gives_the_extra_layers_to_the_last_stages():
    assert [(s.start, s.end) for s in partition_layers(43, 4)] == [(0, 10), (10, 21), (21, 32), (32, 43)]


@pytest.mark.parametrize("layers,pp,expected", [
    (61, 8, [7, 7, 7, 8, 8, 8, 8, 8]),
    (12, 4, [3, 3, 3, 3]),
    (10, 3, [3, 3, 4]),
    (5, 5, [1, 1, 1, 1, 1]),
])
def test_even_split_remainder_to_last(layers, pp, expected):
    assert [s.num_layers for s in partition_layers(layers, pp)] == expected


def test_explicit_partition_overrides_and_is_checked():
    part = parse_partition("11,11,11,10")
    assert [(s.start, s.end) for s in partition_layers(43, 4, part)] == [(0, 11), (11, 22), (22, 33), (33, 43)]
    with pytest.raises(ConfigError, match="has 3 entries, expected pp_size=4"):
        partition_layers(43, 4, parse_partition("11,11,21"))
    with pytest.raises(ConfigError, match="sums to 44, expected num_layers=43"):
        partition_layers(43, 4, parse_partition("11,11,11,11"))
    with pytest.raises(ConfigError, match="at least one layer"):
        partition_layers(43, 4, parse_partition("22,21,0,0"))
    with pytest.raises(ConfigError, match="comma-separated integers"):
        parse_partition("11,x")


def test_pp_size_bounds():
    with pytest.raises(ConfigError, match=">= 1"):
        partition_layers(10, 0)
    with pytest.raises(ConfigError, match="larger than the model's 10 layers"):
        partition_layers(10, 11)
    with pytest.raises(ConfigError, match="out of range"):
        pp_indices(10, 4, 4)


@given(layers=st.integers(1, 200), data=st.data())
def test_slices_tile_all_layers_like_sglang(layers, data):
    pp = data.draw(st.integers(1, min(layers, 16)))
    slices = partition_layers(layers, pp)
    assert slices[0].start == 0 and slices[-1].end == layers
    assert all(a.end == b.start for a, b in zip(slices, slices[1:], strict=False))
    sizes = [s.num_layers for s in slices]
    base, rem = divmod(layers, pp)
    assert sizes == [base] * (pp - rem) + [base + 1] * rem
