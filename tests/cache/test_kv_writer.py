"""The deterministic KV writer: same prefix -> same bytes, anything else -> detected."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from plans import pools as make_pools
from stagecache.runtime.cache.kv_writer import KvWriter, page_hashes
from stagecache.runtime.model.families import load_spec, spec_from_config
from stagecache.runtime.model.families.deepseek_v4 import HOST_CACHED
from stagecache.runtime.model.layer_map import build_layout


def _pools(num_pages=8, stage=2):
    spec = load_spec("tiny-v4")
    return make_pools(spec, build_layout(spec, 4).stages[stage], 128, num_pages)


def test_page_hashes_chain_over_the_prefix():
    a = np.arange(300)
    b = a.copy()
    b[130] += 1  # second page differs
    ha, hb = page_hashes(a, 128), page_hashes(b, 128)
    assert len(ha) == 3  # the partial page has a hash too
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]  # later pages inherit the change
    assert page_hashes(a[:256], 128)[1] == ha[1]
    assert page_hashes(a[:200], 128)[1] != ha[1]  # length is part of a partial page's hash


def test_same_prefix_same_bytes_in_other_pages_and_verify_is_clean():
    pools = _pools()
    w = KvWriter(pools)
    h = w.hashes(np.arange(3 * 128))
    w.write(h, [0, 1, 2])
    w.write(h[:2], [5, 6])
    for pool in HOST_CACHED:
        for buf in pools.buffers[pool]:
            assert torch.equal(buf[0], buf[5]) and torch.equal(buf[1], buf[6])
            assert not torch.equal(buf[0], buf[1])
    assert w.verify(h, [0, 1, 2]) == [] and w.verify(h[:2], [5, 6]) == []
    # swapped pages, wrong prefix: every buffer of every pool reports it
    bad = w.verify(h[:2], [1, 0])
    assert len(bad) == 2 * sum(len(pools.buffers[p]) for p in HOST_CACHED)
    assert {m.pool for m in bad} == set(HOST_CACHED)
    assert all(m.wrong_bytes > 0.9 * pools.page_bytes(m.pool) for m in bad)


def test_layers_and_pools_get_different_bytes():
    pools = _pools()
    w = KvWriter(pools)
    w.write(w.hashes(np.arange(128)), [3])
    seen = set()
    for pool in HOST_CACHED:
        for buf in pools.buffers[pool]:
            seen.add(bytes(buf[3, :64].numpy()))
    assert len(seen) == sum(len(pools.buffers[p]) for p in HOST_CACHED)


def test_single_byte_corruption_is_located():
    pools = _pools()
    w = KvWriter(pools)
    h = w.hashes(np.arange(2 * 128))
    w.write(h, [4, 7])
    gid = pools.stage_map.pool_layers("indexer")[1].global_id
    pools.get_raw_buffer("indexer", gid)[7, 11] ^= 0x01
    (m,) = w.verify(h, [4, 7], page_offset=10)
    assert (m.stage, m.pool, m.global_layer, m.page_index, m.page_id, m.wrong_bytes, m.where) == (
        2, "indexer", gid, 11, 7, 1, "device")


def test_unaligned_page_bytes_use_the_byte_path():
    cfg = {"num_hidden_layers": 3, "compress_ratios": [0, 4, 4], "sliding_window": 8,
           "head_dim": 64, "qk_rope_head_dim": 16, "index_head_dim": 30}
    spec = spec_from_config(cfg, "odd")
    pools = make_pools(spec, build_layout(spec, 1).stages[0], 4, 6)
    assert pools.page_bytes("indexer") == 30  # 1 row of 30 FP8 dims (no scale block below 128 dims)
    w = KvWriter(pools)
    h = w.hashes(np.arange(12))
    w.write(h, [0, 1, 2])
    assert w.verify(h, [0, 1, 2]) == []
    pools.get_raw_buffer("indexer", 2)[1, 29] ^= 0x80
    assert [(m.pool, m.global_layer, m.page_id) for m in w.verify(h, [0, 1, 2])] == [("indexer", 2, 1)]


def test_length_mismatch_is_refused():
    w = KvWriter(_pools())
    with pytest.raises(ValueError, match="2 page hashes for 1 pages"):
        w.write(w.hashes(np.arange(256)), [0])
