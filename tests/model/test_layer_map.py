"""Stage layer maps and the one global -> stage-local translation."""

from __future__ import annotations

import pytest
from stagecache.runtime.errors import LayerNotOwnedError
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.layer_map import build_layout

FLASH = load_spec("deepseek-v4-flash")


def test_flash_stage1_maps_count_inside_the_stage():
    s1 = build_layout(FLASH, 4).stages[1]  # global layers [10, 21): 10 is ratio 4
    assert (s1.start, s1.end, s1.local_layers) == (10, 21, 11)
    first = s1.layers[0]
    assert (first.local, first.global_id, first.compress_ratio) == (0, 10, 4)
    assert first.compress_layer_id == 0 and first.c4_state_id == 0  # not the global C4 index (4)
    assert s1.pool_map("c4") == {0: 0, 2: 1, 4: 2, 6: 3, 8: 4, 10: 5}
    assert s1.pool_map("c128") == {1: 0, 3: 1, 5: 2, 7: 3, 9: 4}
    assert s1.pool_map("c4_state") == s1.pool_map("c4")
    assert s1.pool_map("swa") == {i: i for i in range(11)}
    assert s1.expected_buffers() == {"swa": 11, "c4": 6, "c128": 5, "c4_state": 6, "c128_state": 5, "indexer": 6,
                                     "c4_indexer_state": 6}
    assert s1.pool_map("c4_indexer_state") == s1.pool_map("c4_state")  # the assembler's c4_state mapping


def test_ratio0_layers_have_null_ids():
    s0 = build_layout(FLASH, 4).stages[0]
    assert [(e.compress_layer_id, e.c4_state_id) for e in s0.layers[:2]] == [(None, None)] * 2
    assert s0.layers[3].to_dict() == {"local": 3, "global": 3, "compress_ratio": 128,
                                      "compress_layer_id": 0, "c4_state_id": None}


def test_translation_raises_for_layers_the_stage_does_not_own():
    s2 = build_layout(FLASH, 4).stages[2]
    assert s2.local_id(21) == 0 and s2.pool_index("c128", 21) == 0
    with pytest.raises(LayerNotOwnedError, match=r"stage 2 owns global layers \[21, 32\); layer 5"):
        s2.local_id(5)
    with pytest.raises(LayerNotOwnedError, match="compress ratio 4 and no C128 KV buffer"):
        s2.pool_index("c128", 22)


def test_an_out_of_stage_layer_is_a_value_error_as_sglang_raises():
    """sglang's mapping errors are ValueErrors; ours is one too (and a KeyError for lookups)."""
    s2 = build_layout(FLASH, 4).stages[2]
    with pytest.raises(ValueError, match="stage 2 owns"):
        s2.local_id(43)
    with pytest.raises(KeyError):
        s2.local_id(0)
