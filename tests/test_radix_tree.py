"""The radix tree alone: page-granular keys, splits, duplicates, locks, LRU, invariants.

The random-stream test drives a real ``HiCache`` (real pools, real copies) with
hypothesis-generated requests over a tiny alphabet, so prefixes collide,
split and get evicted/reloaded all the time; after every step the tree
invariants and the page accounting against both allocators must hold, and
once every request finished no lock may remain.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stagecache.runtime.cache.hicache import CacheOutOfPagesError, HiCache
from stagecache.runtime.cache.kv_writer import KvWriter
from stagecache.runtime.cache.radix import RadixError, RadixTree
from stagecache.runtime.cache.traces import Request
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.memory.pools import StagePools
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.model.spec import load_spec
from stagecache.runtime.transfer.controller import TransferController
from stagecache.runtime.transfer.stats import TransferStats

PS = 4


def toks(*pages):
    """Tokens of whole pages: page value v -> [v, v, v, v]."""
    return [v for p in pages for v in [p] * PS]


def test_match_is_page_granular_and_splits_nodes():
    t = RadixTree(PS)
    created, dups = t.insert(toks(1, 2, 3), [10, 11, 12])
    assert len(created) == 1 and dups == [] and t.num_nodes == 1
    m = t.match(toks(1, 2) + [9, 9])  # 2 whole pages match, the partial page never does
    assert m.device_pages == 2 and [n.device for n in m.nodes] == [[10, 11]]
    assert t.num_nodes == 2  # split at the page boundary
    t.check()
    m = t.match(toks(1, 2, 3), max_pages=1)
    assert m.pages == 1 and m.nodes[0].device == [10]
    t.check()


def test_insert_reports_duplicates_and_adopts_host_only_pages():
    t = RadixTree(PS)
    t.insert(toks(1, 2), [0, 1])
    created, dups = t.insert(toks(1, 2, 3), [0, 5, 6])  # page 1 same id, page 2 computed twice
    assert dups == [5] and [n.device for n in created] == [[6]]
    leaf = created[0]
    t.set_host(leaf, [40])
    t.set_device(leaf, None)  # evicted to host
    created, dups = t.insert(toks(1, 2, 3), [0, 1, 7])
    assert created == [] and dups == [] and leaf.device == [7]  # adopted, no reload needed
    t.check()


def test_insert_rejects_partial_pages_and_wrong_page_counts():
    t = RadixTree(PS)
    with pytest.raises(RadixError, match="whole pages"):
        t.insert([1, 2, 3], [0])
    with pytest.raises(RadixError, match="2 pages of tokens but 1 device pages"):
        t.insert(toks(1, 2), [0])


def _evict(t, node):
    t.set_device(node, None)
    t.remove_leaf(node)


def test_lru_pops_least_recent_device_leaf_and_skips_locked():
    t = RadixTree(PS)
    a, _ = t.insert(toks(1), [0])
    b, _ = t.insert(toks(2), [1])
    c, _ = t.insert(toks(3), [2])
    t.match(toks(1))  # a is now the most recent
    t.lock(b[0])
    order = []
    while (n := t.pop_device_lru()) is not None:
        order.append(n)
        _evict(t, n)
    assert order == [c[0], a[0]]  # b is locked: never offered
    t.unlock(b[0])
    assert t.pop_device_lru() is b[0]
    with pytest.raises(RadixError, match="below zero"):
        t.unlock(b[0])
    t.check()


def test_parent_becomes_evictable_only_after_its_device_children():
    t = RadixTree(PS)
    t.insert(toks(1, 2), [0, 1])
    t.insert(toks(1, 3), [0, 2])  # splits: [1] -> {[2], [3]}
    order = []
    while (n := t.pop_device_lru()) is not None:
        order.append(n.key[0])
        t.set_device(n, None)
        if not n.children:
            t.remove_leaf(n)
        else:
            t.set_host(n, [9])  # keep it resident somewhere
    assert order[-1] == 1 and sorted(order[:2]) == [2, 3]
    t.check()


# -- random request streams through a real HiCache ------------------------------------------
_SPEC = load_spec("tiny-v4")
_STAGE = build_layout(_SPEC, 4).stages[2]
PAGE = 128

# a request = a path of "page symbols" from a 3-letter alphabet (so prefixes are shared a lot)
_req = st.tuples(
    st.lists(st.integers(0, 2), min_size=1, max_size=4),  # full pages of the prompt
    st.integers(1, PAGE - 1),  # tokens of a partial prompt page
    st.integers(0, PAGE + 3),  # answer tokens
)
# the largest request: 4 + 1 prompt pages + 2 answer pages = 7 pages, so >= 8 device pages always fit one
_ops = st.lists(st.tuples(st.sampled_from(["begin", "begin", "finish", "finish", "abort"]), _req),
                min_size=5, max_size=60)


def _request(spec, i):
    pages, tail, out = spec
    prompt = [v for p in pages for v in [100 + p] * PAGE] + [7] * tail
    answer = [1000 + i] * out
    return Request("h", i, np.asarray(prompt, np.int32), np.asarray(answer, np.int32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, policy=st.sampled_from(["write_back", "write_through", "write_through_selective"]),
       device_pages=st.integers(8, 11), host_pages=st.integers(1, 10))
def test_random_streams_keep_invariants_and_bytes(ops, policy, device_pages, host_pages):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pools = StagePools(_SPEC, _STAGE, PAGE, device_pages)
        host = HostPools(pools, num_pages=host_pages)
        cache = HiCache(pools, host, TransferController(pools, host, TransferStats()),
                        write_policy=policy)
        writer = KvWriter(pools)
        running = []
        for i, (op, spec) in enumerate(ops):
            if op == "begin" or not running:
                try:
                    h = cache.begin(_request(spec, i))
                except CacheOutOfPagesError:
                    assert running, "out of pages with nothing running"
                else:
                    assert writer.verify(h.prefix_hashes, h.prefix_pages) == []
                    writer.write(h.new_hashes, h.new_pages)
                    running.append(h)
            else:
                h = running.pop(0)
                (cache.finish if op == "finish" else cache.abort)(h)
            cache.check()
            assert pools.allocator.num_free + pools.allocator.num_used == device_pages
        for h in running:
            cache.finish(h)
        cache.check()
        assert all(n.lock_ref == 0 for n in cache.tree.nodes() if n is not cache.tree.root)
        assert pools.allocator.num_used == cache.tree.device_pages  # nothing leaked
        s = cache.stats
        assert s.device_hit_tokens + s.host_hit_tokens + s.miss_tokens == s.looked_up_tokens
    finally:
        torch.set_num_threads(old)
