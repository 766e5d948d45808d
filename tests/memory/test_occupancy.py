"""Occupancy of every pool kind (state and indexer pools included), device and host, against the
real allocators and tensors; exported per pool and tier without double counting."""

from __future__ import annotations

from metric_samples import sample_value, series_by_name
from plans import pools as make_pools
from prometheus_client import generate_latest
from stagecache.exporters.metrics import make_registry
from stagecache.runtime.live.numbers import PageSpace, StageLive
from stagecache.runtime.live.source import StaticSource
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.memory.occupancy import stage_occupancy
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.families.deepseek_v4 import HOST_CACHED, KINDS, POOLS
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.serve.host_tier_live import occupancy_live

TINY = load_spec("tiny-v4")
S1 = build_layout(TINY, 4).stages[1]  # has C4 and C128 layers: every pool kind


def _tensor_bytes(bufs) -> int:
    return sum(t.numel() * t.element_size() for t in bufs if t is not None)


def test_every_kind_is_reported_and_matches_the_allocators_and_tensors():
    pools = make_pools(TINY, S1, 128, 16, request_slots=4, hicache_ratio=1.5)
    host = HostPools(pools)
    dev_pages, host_pages = pools.allocator.alloc(5), host.allocator.alloc(9)
    slots = pools.slot_allocator.alloc(3)
    rows = {(o.pool, o.tier): o for o in stage_occupancy(pools, host)}
    assert {p for p, t in rows if t == "device"} == set(POOLS)  # c4_state, indexer, c128_state too
    assert {p for p, t in rows if t == "host"} == set(HOST_CACHED)
    for (pool, tier), o in rows.items():
        bufs = (pools if tier == "device" else host).buffers[pool]
        n = sum(b is not None for b in bufs)
        assert o.capacity_bytes == _tensor_bytes(bufs)  # the pool's real tensors
        assert o.unit_bytes == n * pools.page_bytes(pool)
        if pool == "c128_state":
            assert (o.unit, o.used, o.capacity, o.peak) == ("slot", 3, 4, 3)
        elif tier == "device":
            assert (o.unit, o.used, o.capacity) == ("page", 5, 16)
        else:
            assert (o.unit, o.used, o.capacity) == ("page", 9, 24)
        assert o.used_bytes == o.used * n * pools.page_bytes(pool)
    pools.allocator.free(dev_pages[:2])
    pools.slot_allocator.free(slots)
    rows = {(o.pool, o.tier): o for o in stage_occupancy(pools, host)}
    assert rows["swa", "device"].used == 3 and rows["swa", "device"].peak == 5
    assert rows["c128_state", "device"].used == 0 and rows["c128_state", "device"].peak == 3
    host.allocator.free(host_pages)
    assert rows["indexer", "host"].used == 9  # the earlier reading; now:
    assert all(o.used == 0 for o in stage_occupancy(pools, host) if o.tier == "host")


def test_swa_budget_kinds_have_their_own_smaller_page_space():
    """sglang sizes SWA-budget kinds (swa, c4_state, c4_indexer_state) by a smaller token budget:
    their own space holds fewer pages, and only the pages inside it count as theirs."""
    pools = make_pools(TINY, S1, 128, 20, swa_ratio=0.5)
    pools.allocator.alloc(14)  # ids 0..13: 10 inside the SWA space, 14 inside the full one
    rows = {o.pool: o for o in stage_occupancy(pools) if o.tier == "device"}
    for pool, kind in KINDS.items():
        if kind.budget == "swa":
            assert (rows[pool].used, rows[pool].capacity) == (10, 10), pool
        elif kind.budget == "full":
            assert (rows[pool].used, rows[pool].capacity) == (14, 20), pool
        assert rows[pool].capacity_bytes == _tensor_bytes(pools.buffers[pool])


def _scrape(live: StageLive) -> dict:
    text = generate_latest(make_registry(StaticSource(None, {1: live}))).decode()
    return series_by_name(text)


def test_exported_per_pool_and_tier_bytes_sum_and_pages_do_not_double_count():
    pools = make_pools(TINY, S1, 128, 16, request_slots=4)
    host = HostPools(pools)
    pools.allocator.alloc(6)
    host.allocator.alloc(10)
    pools.slot_allocator.alloc(2)
    live = StageLive(stage=1, model_name="tiny-v4", pool_occupancy=occupancy_live(pools, host),
                     page_spaces={"device": PageSpace(tier="device", used=6, total=16, pools=list(POOLS)),
                                  "host": PageSpace(tier="host", used=10, total=32,
                                                    pools=list(HOST_CACHED))})
    smp = _scrape(live)

    assert sample_value(smp, "stagecache_pool_used_pages", pool="c4_state", tier="device") == 6
    assert sample_value(smp, "stagecache_pool_capacity_pages", pool="indexer", tier="host") == 32
    assert sample_value(smp, "stagecache_pool_used_slots", pool="c128_state", tier="device") == 2
    assert sample_value(smp, "stagecache_pool_capacity_slots", pool="c128_state", tier="device") == 4
    assert not [s for s in smp["stagecache_pool_used_pages"] if s.labels["pool"] == "c128_state"]
    assert sample_value(smp, "stagecache_pool_usage_ratio", pool="swa", tier="host") == 10 / 32
    assert sample_value(smp, "stagecache_pool_peak_usage_ratio", pool="c128_state", tier="device") == 0.5
    # bytes are each kind's own: they sum to the stage's used KV bytes, computed from the tensors
    used_dev = sum(s.value for s in smp["stagecache_pool_used_bytes"] if s.labels["tier"] == "device")
    want = sum(_tensor_bytes(pools.buffers[p]) // pools.units[p] * (2 if p == "c128_state" else 6)
               for p in POOLS)
    assert used_dev == want
    # pages: each pool repeats its space's count, so the space family is what sums
    per_pool = [s.value for s in smp["stagecache_pool_used_pages"] if s.labels["tier"] == "device"]
    assert set(per_pool) == {6.0} and len(per_pool) == 6
    assert sample_value(smp, "stagecache_page_space_used_pages", space="device", tier="device") == 6
