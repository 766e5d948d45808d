"""HiCache with an L3 tier: whole prefixes come back from L3 through host to device, byte exact;
writes to L3 follow the host tier's write policy; a bad object is a miss; a stage that follows its
head stage takes the same L3 pages and rewrites what it cannot read."""

from __future__ import annotations

import numpy as np
import pytest
from l3_support import corrupt_records
from memory_store import MemoryStore
from plans import run_plan
from stagecache.runtime.cache.hicache import HiCache
from stagecache.runtime.cache.kv_writer import KvWriter
from stagecache.runtime.cache.storage_tier import StorageTier
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.memory.pools import StagePools
from stagecache.runtime.storage.file import FileStore
from stagecache.runtime.storage.keys import key_space
from stagecache.runtime.storage.views import HostPageViews
from stagecache.runtime.traces.readers import WorkloadConfig, generate
from stagecache.runtime.transfer.controller import TransferController
from stagecache.runtime.transfer.stats import TransferStats

PLAN = run_plan("tiny-v4", pp=2, pages=40, page_size=128, hicache_ratio=1.0)
REQUESTS = generate(WorkloadConfig(seed=3, requests=30))


def _cache(store, stage=0, policy="write_through", layout="layer_first"):
    pools = StagePools(PLAN.stage(stage), "cpu")
    host = HostPools(pools, layout=layout)
    tier = StorageTier(store, key_space(PLAN, stage), HostPageViews(host))
    cache = HiCache(pools, host, TransferController(pools, host, TransferStats()), policy, storage=tier)
    return cache, KvWriter(pools), host


def _replay(cache, writer, follow=None, refill=None):
    bad = 0
    for i, req in enumerate(REQUESTS):
        h = cache.begin(req, follow[i] if follow else None, refill)
        lo, hi = h.device_hit_pages, h.matched_pages
        bad += len(writer.verify(h.hashes[lo:hi], h.prefix_pages[lo:hi]))
        writer.write(h.new_hashes, h.new_pages)
        cache.finish(h)
        if i % 10 == 9:
            cache.check()
    cache.check()
    return bad


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_fresh_cache_reads_whole_prefixes_back_from_l3_byte_exact(tmp_path, layout):
    store = FileStore(tmp_path / "l3")
    first, w1, _ = _cache(store, layout=layout)
    assert _replay(first, w1) == 0
    again, w2, _ = _cache(store, layout=layout)  # a new server: empty device and host tiers
    assert _replay(again, w2) == 0  # every page read from L3 verified byte for byte
    s = again.stats
    assert s.storage_hit_tokens > 0 and s.miss_tokens < first.stats.miss_tokens
    assert s.looked_up_tokens == s.device_hit_tokens + s.host_hit_tokens + s.storage_hit_tokens + s.miss_tokens
    assert again.storage.counters.prefetched_pages > 0 and store.stats.error_count == 0


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_writes_to_l3_follow_the_host_tiers_write_policy(policy):
    store = MemoryStore()
    cache, writer, _ = _cache(store, policy=policy)
    _replay(cache, writer)
    # every page the host tier got a copy of went to L3 at that moment, and nothing else did
    assert cache.storage.counters.backuped_pages == cache.stats.backup_pages > 0


def test_a_corrupt_object_is_a_miss_and_an_error_never_data(tmp_path):
    store = FileStore(tmp_path / "l3")
    first, w1, _ = _cache(store)
    _replay(first, w1)
    assert corrupt_records(tmp_path / "l3", ".c4.") > 0
    again, w2, _ = _cache(store)
    assert _replay(again, w2) == 0
    assert store.stats.errors["corrupt"] > 0
    assert again.stats.storage_hit_tokens < first.stats.looked_up_tokens


def test_a_following_stage_takes_its_heads_l3_pages_and_rewrites_what_it_cannot_read():
    store = MemoryStore()
    head, wh, _ = _cache(store, stage=0)
    _replay(head, wh)
    tail, wt, host = _cache(store, stage=1)
    _replay(tail, wt)
    # a new run: the head decides from L3; the tail's L3 objects are gone, it must follow anyway
    head2, wh2, _ = _cache(store, stage=0)
    decided = []
    for req in REQUESTS:
        h = head2.begin(req)
        decided.append((h.device_hit_pages + h.host_hit_pages, h.storage_pages))
        wh2.write(h.new_hashes, h.new_pages)
        head2.finish(h)
    tail2, wt2, host2 = _cache(store, stage=1)
    store.remove([k for k in list(store._objects) if key_space(PLAN, 1).owns(k)])
    refilled = []

    def refill(keys, pages):
        refilled.append(len(keys))
        wt2.write(np.asarray(keys, dtype=np.uint64), pages, target=host2)

    assert _replay(tail2, wt2, follow=decided, refill=refill) == 0  # rewritten bytes are right
    c = tail2.storage.counters
    assert sum(refilled) == c.fallback_pages > 0
    # every L3 page the head took, the tail took too: read back (what it wrote meanwhile) or rewritten
    assert c.prefetched_pages + c.fallback_pages == sum(n for _, n in decided)


def test_a_full_store_evicts_and_counts(tmp_path):
    store = FileStore(tmp_path / "l3", capacity_bytes=200_000, owner=key_space(PLAN, 0).prefix)
    cache, writer, _ = _cache(store)
    _replay(cache, writer)
    assert store.stats.evictions > 0 and store.stats.used_bytes <= 200_000
