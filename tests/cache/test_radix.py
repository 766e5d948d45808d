"""The radix tree alone: page keys, duplicates, adoption, locks, eviction order, invariants, size.

The random-stream test drives a real ``HiCache`` (real pools, real copies) with
hypothesis-generated requests over a tiny alphabet, so prefixes collide and
pages get evicted/reloaded all the time; after every step the tree invariants
and the page accounting against both allocators must hold, and once every
request finished no lock may remain.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plans import pools as make_pools
from stagecache.runtime.cache.eviction import LFUAging, make_policy
from stagecache.runtime.cache.hicache import CacheOutOfPagesError, HiCache
from stagecache.runtime.cache.kv_writer import KvWriter
from stagecache.runtime.cache.radix import DEVICE, HOST, RadixError, RadixTree
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.traces.readers import Request
from stagecache.runtime.transfer.controller import TransferController
from stagecache.runtime.transfer.stats import TransferStats


def chain(tree, keys, pages, after=-1):
    """Insert ``keys`` below ``after`` and return their nodes (created or found)."""
    tree.insert(after, keys, pages)
    return [tree.node_of(k) for k in keys]


def evict(tree, node):
    tree.set_device(node, -1)
    tree.remove(node)


def test_match_follows_keys_and_stops_at_the_first_miss_or_limit():
    t = RadixTree()
    created, dups = t.insert(-1, [1, 2, 3], [10, 11, 12])
    assert len(created) == 3 and dups == [] and t.num_nodes == 3 and t.device_pages == 3
    m = t.match([1, 2, 9, 3], limit=4)
    assert (m.pages, m.device, m.host) == (2, 2, 0) and [t.dev[s] for s in m.path] == [10, 11]
    assert t.match([1, 2, 3], limit=1).pages == 1
    t.set_host(m.path[1], 40)
    t.set_host(created[2], 41)
    t.set_device(created[2], -1)  # page 3 on host only: a match is a device run + a host run
    m = t.match([1, 2, 3], limit=3)
    assert (m.device, m.host) == (2, 1)
    t.check()


def test_insert_reports_duplicates_and_adopts_host_only_pages():
    t = RadixTree()
    t.insert(-1, [1, 2], [0, 1])
    created, dups = t.insert(-1, [1, 2, 3], [0, 5, 6])  # page 2 computed twice: 5 is spare
    assert dups == [5] and [t.dev[s] for s in created] == [6]
    leaf = created[0]
    t.set_host(leaf, 40)
    t.set_device(leaf, -1)  # evicted to host
    created, dups = t.insert(-1, [1, 2, 3], [0, 1, 7])
    assert created == [] and dups == [] and t.dev[leaf] == 7  # adopted, no reload needed
    t.check()


def test_keys_that_are_not_chained_are_refused():
    t = RadixTree()
    t.insert(-1, [1, 2], [0, 1])
    with pytest.raises(RadixError, match="not chained"):
        t.insert(-1, [5, 2], [2, 3])  # 2 already follows 1
    with pytest.raises(RadixError, match="not chained"):
        t.match([2], limit=1)


def test_lru_pops_least_recent_device_leaf_and_skips_locked():
    t = RadixTree()
    a, b, c = (chain(t, [k], [k])[0] for k in (1, 2, 3))
    t.match([1], limit=1)  # a is now the most recent
    t.lock_path(b)
    order = []
    while (s := t.pop(DEVICE)) >= 0:
        order.append(s)
        evict(t, s)
    assert order == [c, a]  # b is locked: never offered
    t.unlock_path(b)
    assert t.pop(DEVICE) == b
    with pytest.raises(RadixError, match="below zero"):
        t.unlock_path(b)
    t.check()


def test_parent_becomes_evictable_only_after_its_device_children():
    t = RadixTree()
    root, two = chain(t, [1, 2], [0, 1])
    three = chain(t, [3], [2], after=root)[0]
    order = []
    while (s := t.pop(DEVICE)) >= 0:
        order.append(s)
        t.set_device(s, -1)
        if t.nchild[s]:
            t.set_host(s, 9)  # keep it resident somewhere
        else:
            t.remove(s)
    assert order[-1] == root and sorted(order[:2]) == sorted([two, three])
    t.check()


def test_host_candidates_are_host_leaves_that_strand_nothing():
    t = RadixTree()
    a, b = chain(t, [1, 2], [0, 1])
    t.set_host(a, 10)
    t.set_host(b, 11)
    t.set_device(b, -1)  # a: device + host, b: host only below it
    assert not t.candidate(a, HOST)  # b's host copy needs a's prefix kept somewhere
    assert t.pop(HOST) == b
    t.set_host(b, -1)
    t.remove(b)
    assert t.pop(HOST) == a  # now a leaf; it stays on device
    t.check()


def test_lfu_keeps_the_often_used_page_and_ages():
    t = RadixTree(make_policy("lfu"))
    hot, cold = (chain(t, [k], [k])[0] for k in (1, 2))
    for _ in range(3):
        t.match([1], limit=1)
    t.match([2], limit=1)  # cold is the most recent, but used once
    assert t.pop(DEVICE) == cold
    evict(t, cold)
    assert isinstance(t.policy, LFUAging) and t.policy.age >= 2  # the cache's clock moved on
    new = chain(t, [3], [3])[0]  # a fresh page starts at the current age, not from zero
    assert t.policy.level[new] > 1
    with pytest.raises(ConfigError, match="accepted: lru, lfu"):
        make_policy("mru")


def test_stale_heap_entries_are_compacted_and_order_survives():
    t = RadixTree()
    nodes = [chain(t, [k], [k])[0] for k in range(50)]
    for _ in range(200):  # every touch leaves a stale entry behind
        for k in range(1, 50):
            t.match([k], limit=1)
    assert len(t._heaps[DEVICE]) < 2 * 50 + 4096 + 50
    assert t.pop(DEVICE) == nodes[0]  # never touched again: least recent


def test_metadata_under_200_bytes_per_cached_page():
    """Tree + tiers + allocators of a metadata-only cache, measured with tracemalloc."""
    rng = np.random.default_rng(0)
    convs: list[list[int]] = []
    stream = []
    next_id = 1  # id 0: a system prompt every conversation starts with
    for _ in range(3000):  # conversations that grow turn by turn, Mooncake style
        grow = int(rng.integers(1, 12))
        if convs and rng.random() < 0.6:
            ids = convs[int(rng.integers(0, len(convs)))]
        else:
            ids = [0]
            convs.append(ids)
        ids += range(next_id, next_id + grow)
        next_id += grow
        stream.append(_Blocks(ids))  # the trace itself is input, built before measuring
    n = 20_000
    gc.collect()
    tracemalloc.start()
    try:
        # the radix budget: the insight's seen keys are a separate, bounded structure whose
        # cost per key tests/cache/test_insight.py measures
        cache = HiCache.metadata_only(512, n // 4, n, write_policy="write_through", insight=None)
        for r in stream:
            cache.finish(cache.begin(r))
        gc.collect()
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    cached = cache.tree.num_nodes
    assert cached > n // 2 and cache.tree.device_pages == n // 4
    assert used / cached < 200, f"{used / cached:.0f} bytes per cached page"


class _Blocks:
    """A minimal block request: ids whose parents are consistent (one root id, then new ones)."""

    block_tokens = 512
    output_len = 0

    def __init__(self, ids):
        self.hash_ids = np.asarray(ids, dtype=np.int64)
        self.input_len = 512 * len(ids)


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
       device_pages=st.integers(8, 11), host_pages=st.integers(1, 10),
       eviction=st.sampled_from(["lru", "lfu"]))
def test_random_streams_keep_invariants_and_bytes(ops, policy, device_pages, host_pages, eviction):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pools = make_pools(_SPEC, _STAGE, PAGE, device_pages, host_pages=host_pages)
        host = HostPools(pools)
        cache = HiCache(pools, host, TransferController(pools, host, TransferStats()),
                        write_policy=policy, eviction_policy=eviction)
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
        assert all(cache.tree.lock[s] == 0 for s in cache.tree.nodes())
        assert pools.allocator.num_used == cache.tree.device_pages  # nothing leaked
        s = cache.stats
        assert s.device_hit_tokens + s.host_hit_tokens + s.miss_tokens == s.looked_up_tokens
    finally:
        torch.set_num_threads(old)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 60)), max_size=400),
       big=st.booleans())
def test_key_table_behaves_like_a_dict(ops, big):
    """Inserts and deletes (backward shift, growth) against a dict; keys collide on purpose."""
    from stagecache.runtime.cache.keytable import KeyTable

    table, want = KeyTable(bits=3), {}
    for add, k in ops:
        key = (k << 58) | k if big else k  # big: keys that differ only in high bits
        if add and key not in want:
            table.put(key, len(want) + k)
            want[key] = len(want) + k
        elif not add and key in want:
            table.pop(key)
            del want[key]
        assert len(table) == len(want)
    for k in range(61):
        key = (k << 58) | k if big else k
        assert table.get(key) == want.get(key, -1)
    keys, nodes = table.items()
    assert dict(zip(keys.tolist(), nodes.tolist(), strict=True)) == want
    with pytest.raises(KeyError):
        table.pop(10**6)
