"""HiCache on real pools: LRU order, locks, host-full behaviour, write policies, reload bytes."""

from __future__ import annotations

import numpy as np
import pytest
from plans import pools as make_pools
from stagecache.runtime.cache.hicache import CacheOutOfPagesError, HandleError, HiCache
from stagecache.runtime.cache.kv_writer import KvWriter, page_hashes
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.families.deepseek_v4 import HOST_CACHED
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.traces.readers import Request
from stagecache.runtime.transfer.controller import TransferController
from stagecache.runtime.transfer.stats import TransferStats

PS = 128


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(device_pages=3, host_pages=16, policy="write_back", stage=2, layout="layer_first"):
    spec = load_spec("tiny-v4")
    sm = build_layout(spec, 4).stages[stage]  # stage 2 of 4 has every pool kind
    pools = make_pools(spec, sm, PS, device_pages, host_pages=host_pages or None)
    host = ctrl = None
    if host_pages:
        host = HostPools(pools, layout=layout)
        ctrl = TransferController(pools, host, TransferStats())
    return HiCache(pools, host, ctrl, write_policy=policy), KvWriter(pools)


def req(tokens, out=0, name="r"):
    arr = np.asarray(tokens, dtype=np.int32)
    return Request(name, 0, arr[:len(arr) - out], arr[len(arr) - out:])


def page(tag, n=1):
    """n pages of tokens unique to ``tag``."""
    return [tag * 10_000 + i for i in range(n * PS)]


def run(cache, writer, r, verify=True):
    """begin -> verify reused pages -> write new pages -> finish; returns the handle."""
    h = cache.begin(r)
    if verify:
        assert writer.verify(h.prefix_hashes, h.prefix_pages) == []
    writer.write(h.new_hashes, h.new_pages)
    cache.finish(h)
    cache.check()
    return h


def lookup(cache, tokens):
    """Where the whole-page prefix of ``tokens`` is cached: (device pages, host pages).

    Reads the tree without touching it, so the LRU order under test is unchanged.
    """
    tree = cache.tree
    dev = host = 0
    for key in keys(tokens):
        node = tree.node_of(key)
        if node < 0:
            break
        if tree.dev[node] >= 0:
            dev += 1
        else:
            host += 1
    return dev, host


def keys(tokens):
    full = len(tokens) // PS
    return page_hashes(np.asarray(tokens[:full * PS]), PS).tolist()


def nodes(cache, tokens):
    return [cache.tree.node_of(k) for k in keys(tokens)]


def transfers(cache):
    """(backup count, load count) recorded by the controller."""
    count = cache.controller.stats.live().transfer_count
    return count.d2h, count.h2d


def test_partial_last_page_is_not_cached():
    cache, w = make(device_pages=4)
    run(cache, w, req(page(1) + [5, 6, 7], out=2))
    assert cache.tree.device_pages == 1
    assert cache.dev_alloc.num_used == 1  # the partial page went back


def test_lru_eviction_order_device_to_host():
    cache, w = make(device_pages=3)
    a, b, c = page(1), page(2), page(3)
    for t in (a, b, c):
        run(cache, w, req(t, out=1))
    assert cache.dev_alloc.num_free == 0
    # touch A (device hit on its page), which needs one more page: B is the LRU leaf
    h = run(cache, w, req(a + [1, 2, 3, 4, 5]))
    assert h.device_hit_pages == 1
    assert lookup(cache, b) == (0, 1) and lookup(cache, c) == (1, 0)
    run(cache, w, req(page(4), out=1))  # the freed partial page is reused, nothing evicted
    run(cache, w, req(page(5), out=1))  # now the LRU device leaf is C (A was touched after it)
    assert lookup(cache, c) == (0, 1) and lookup(cache, a)[0] == 1
    assert cache.stats.device_evicted_pages == 2 and cache.stats.backup_pages == 2


def test_host_hit_reloads_exact_bytes_of_every_pool_and_layer():
    cache, w = make(device_pages=3)
    assert {p.pool for p in w.plans} == set(HOST_CACHED)
    prefix = page(1, 2)
    run(cache, w, req(prefix, out=1))
    run(cache, w, req(page(2, 3), out=1))  # evicts both prefix pages to host
    assert lookup(cache, prefix) == (0, 2)
    # scribble over every device page: a reload must bring the bytes back from host
    for bufs in cache.pools.buffers.values():
        for b in bufs:
            b.fill_(0xAB)
    h = cache.begin(req(prefix + [9, 9, 9]))
    assert (h.device_hit_pages, h.host_hit_pages) == (0, 2)
    assert w.verify(h.prefix_hashes, h.prefix_pages) == []
    cache.finish(h)
    assert cache.stats.host_hit_tokens == 2 * PS and cache.stats.load_pages == 2


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_copies_hold_the_written_bytes(layout):
    cache, w = make(device_pages=2, layout=layout)
    prefix = page(1, 2)
    run(cache, w, req(prefix, out=1))
    run(cache, w, req(page(2, 2), out=1))  # prefix -> host (write-back copy at eviction)
    tree = cache.tree
    assert [tree.dev[s] for s in nodes(cache, prefix)] == [-1, -1]
    host = [tree.host[s] for s in nodes(cache, prefix)]
    hashes = w.hashes(prefix)
    assert w.verify(hashes, host, target=cache.host_pools) == []
    cache.host_pools.get_raw_buffer("swa", cache.pools.stage_map.start)[host[1], 0] ^= 1
    bad = w.verify(hashes, host, target=cache.host_pools)
    assert [(m.where, m.pool, m.page_index) for m in bad] == [("host", "swa", 1)]


def test_a_running_request_loads_its_host_hits_and_locks_them():
    cache, w = make(device_pages=3)
    prefix = page(1, 2)
    run(cache, w, req(prefix, out=1))
    run(cache, w, req(page(2, 3), out=1))  # prefix -> host
    h = cache.begin(req(prefix + [5]))
    assert (h.device_hit_pages, h.host_hit_pages, len(h.prefix_pages)) == (0, 2, 2)
    assert w.verify(w.hashes(prefix), h.prefix_pages) == []
    with pytest.raises(CacheOutOfPagesError):  # the locked prefix cannot make room
        cache.begin(req(page(3, 3), out=1))
    cache.abort(h)  # unlocks it
    run(cache, w, req(page(3, 3), out=1))
    again = cache.begin(req(page(3, 3)))
    assert again.matched_pages == again.device_hit_pages == 2  # all a request may reuse: its last page computes
    cache.abort(again)
    cache.check()


def test_verify_names_pool_layer_and_page_of_a_corrupted_host_copy():
    cache, w = make(device_pages=2)
    prefix = page(1)
    run(cache, w, req(prefix, out=1))
    run(cache, w, req(page(2), out=1))
    run(cache, w, req(page(3), out=1))  # prefix page -> host
    host_page = cache.tree.host[nodes(cache, prefix)[0]]
    gid = cache.pools.stage_map.pool_layers("c128")[0].global_id
    cache.host_pools.get_raw_buffer("c128", gid)[host_page, 3] ^= 0xFF
    h = cache.begin(req(prefix + [1, 2]))
    bad = w.verify(h.prefix_hashes, h.prefix_pages)
    cache.finish(h)
    assert [(m.pool, m.global_layer, m.page_index, m.wrong_bytes) for m in bad] == [
        ("c128", gid, 0, 1)]
    assert "stage 2" in str(bad[0]) and "c128" in str(bad[0])


def test_locked_pages_are_never_evicted_and_out_of_pages_is_clear():
    cache, w = make(device_pages=4)
    held = cache.begin(req(page(1, 2), out=1))  # running: 2 pages of its own
    w.write(held.new_hashes, held.new_pages)
    run(cache, w, req(page(2), out=1))
    with pytest.raises(CacheOutOfPagesError) as exc:
        cache.begin(req(page(3, 3), out=1))  # 3 pages: page(2) can go, held's 2 cannot
    msg = str(exc.value)
    assert "stage 2 device: out of pages: asked for 3, 2 of 4 free" in msg
    assert "2 pages being computed by running requests" in msg
    cache.check()  # a refused begin left nothing behind
    cache.finish(held)
    # the prefix of `held` is now cached; a running reader locks it through heavy pressure
    reader = cache.begin(req(page(1, 2) + [7]))
    assert reader.device_hit_pages == 2
    for tag in range(10, 16):
        with pytest.raises(CacheOutOfPagesError):
            cache.begin(req(page(tag, 2), out=1))  # only 1 page is free or evictable
        run(cache, w, req(page(tag), out=1))  # evicts the previous tag, never the reader's
    assert w.verify(reader.prefix_hashes, reader.prefix_pages) == []
    assert lookup(cache, page(1, 2))[0] == 2
    cache.finish(reader)
    cache.check()
    assert all(cache.tree.lock[s] == 0 for s in cache.tree.nodes())
    assert cache.stats.out_of_pages_errors == 7


def test_host_full_evicts_host_lru_page_by_page():
    cache, w = make(device_pages=3, host_pages=2)
    for tag in range(1, 7):
        run(cache, w, req(page(tag), out=1))
    # device holds 4, 5, 6; host room for two of 1, 2, 3: the oldest (1) went out
    assert lookup(cache, page(1)) == (0, 0)
    assert lookup(cache, page(2)) == (0, 1) and lookup(cache, page(3)) == (0, 1)
    assert cache.stats.host_evicted_pages == 1 and cache.stats.dropped_pages == 0
    run(cache, w, req(page(7, 3), out=1))  # evicts 4, 5, 6 to host, pushing 2, 3, 4 out
    assert [lookup(cache, page(t)) for t in (2, 3, 4, 5, 6)] == [(0, 0)] * 3 + [(0, 1)] * 2
    # a prefix longer than the host tier goes page by page, deepest first: the host keeps
    # the two leading pages (a usable prefix), never a tail without its head
    run(cache, w, req(page(8, 3), out=1))
    assert lookup(cache, page(7, 3)) == (0, 2) and lookup(cache, page(5)) == (0, 0)
    assert cache.stats.dropped_pages == 0


def test_device_leaf_is_dropped_when_every_host_page_is_locked():
    cache, w = make(device_pages=2, host_pages=1)
    for tag in (1, 2, 3):  # 1 is evicted to host, filling it
        run(cache, w, req(page(tag), out=1))
    assert lookup(cache, page(1)) == (0, 1)
    # the reader locks page 1 (on host, loaded now): making room evicts 2 and 3, whose
    # backups find the host full of a locked page: they are dropped, not half-copied
    h = run(cache, w, req(page(1) + [5]))
    assert h.host_hit_pages == 1 and cache.stats.dropped_pages == 2  # 2, then 3 for the new page
    assert lookup(cache, page(2)) == lookup(cache, page(3)) == (0, 0)
    assert lookup(cache, page(1)) == (1, 0)


def test_write_through_backs_up_at_insert_write_back_on_eviction():
    wt, w1 = make(device_pages=3, policy="write_through")
    wb, w2 = make(device_pages=3, policy="write_back")
    for cache, w in ((wt, w1), (wb, w2)):
        run(cache, w, req(page(1, 2), out=1))
    assert wt.stats.backup_pages == 2 and transfers(wt) == (1, 0)
    assert wb.stats.backup_pages == 0 and transfers(wb) == (0, 0)
    for cache, w in ((wt, w1), (wb, w2)):
        run(cache, w, req(page(2, 2), out=1))  # needs one more page: the first prefix's leaf
        assert lookup(cache, page(1, 2)) == (1, 1)
    assert wt.stats.backup_pages == 4 and transfers(wt) == (2, 0)  # no copy at eviction
    assert wb.stats.backup_pages == 1 and transfers(wb) == (1, 0)  # copied when evicted


def test_write_through_selective_backs_up_hot_nodes():
    cache, w = make(device_pages=4, policy="write_through_selective")
    prefix = page(1)
    run(cache, w, req(prefix, out=1))
    assert cache.stats.backup_pages == 0
    run(cache, w, req(prefix + [1, 2]))  # first hit
    assert cache.stats.backup_pages == 0
    run(cache, w, req(prefix + [3, 4]))  # second hit: threshold 2 reached
    assert cache.stats.backup_pages == 1


def test_device_only_cache_drops_lru_and_counts():
    cache, w = make(device_pages=2, host_pages=0)
    for tag in range(1, 4):
        run(cache, w, req(page(tag), out=1))
    assert lookup(cache, page(1)) == (0, 0) and lookup(cache, page(3)) == (1, 0)
    assert cache.stats.dropped_pages == 1 and cache.stats.backup_pages == 0


def test_concurrent_duplicate_prefix_is_freed_once():
    cache, w = make(device_pages=6)
    r = req(page(1, 2), out=1)
    h1, h2 = cache.begin(r), cache.begin(r)
    for h in (h1, h2):
        w.write(h.new_hashes, h.new_pages)
    cache.finish(h1)
    cache.finish(h2)
    cache.check()
    assert cache.tree.device_pages == 2 and cache.dev_alloc.num_used == 2


def test_handle_misuse_and_bad_policy():
    cache, w = make()
    h = run(cache, w, req(page(1), out=1))
    with pytest.raises(HandleError):
        cache.finish(h)
    with pytest.raises(ConfigError, match="write_bak"):
        make(policy="write_bak")


def test_stats_give_the_stage_live_numbers():
    from stagecache.runtime.live.numbers import StageLive

    cache, w = make(device_pages=2)
    for tag in range(1, 4):
        run(cache, w, req(page(tag), out=1))
    run(cache, w, req(page(1) + [1]))
    # what a serving stage's live numbers are made from: the typed parts, as they are
    live = StageLive(stage=2, **dict(cache.stats.live()), **dict(cache.controller.stats.live()))
    assert live.cache_tokens.host == PS and live.evictions.device == 3  # 1, 2, 3
    assert live.host_hit_ratio == pytest.approx(PS / cache.stats.looked_up_tokens)
    assert live.transfer_bytes.h2d == cache.pools.token_page_bytes()


def test_plain_tokens_request_is_all_prompt():
    from types import SimpleNamespace

    cache, w = make(device_pages=4)
    run(cache, w, SimpleNamespace(tokens=np.asarray(page(1, 2), np.int64)))
    h = run(cache, w, SimpleNamespace(tokens=np.asarray(page(1, 2) + [3], np.int64)))
    assert (h.device_hit_pages, h.input_len) == (2, 2 * PS + 1)
