"""Miss reasons (cache/insight.py): every missed token gets exactly one reason, per tier.

A hypothesis property replays random request streams (shared prefixes, partial
pages, answers, aborts) through metadata-only and real-pool caches under every
write and eviction policy, with and without a host tier, immediate and
deferred accounting, and checks that per tier the reasons sum exactly to the
misses.  Scenario tests then produce each reason on purpose, and the seen-keys
structure is measured.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plans import pools as make_pools
from stagecache.runtime.cache.handle import CacheOutOfPagesError
from stagecache.runtime.cache.hicache import HiCache
from stagecache.runtime.cache.insight import InsightConfig
from stagecache.runtime.cache.keytable import EMPTY, GHOST, KeyTable, ghost_reason
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.traces.readers import Request
from stagecache.runtime.transfer.controller import TransferController
from stagecache.runtime.transfer.stats import TransferStats

PAGE = 128
_SPEC = load_spec("tiny-v4")
_STAGE = build_layout(_SPEC, 4).stages[2]  # every pool kind


def _cache(payload: bool, device_pages: int, host_pages: int, policy: str, eviction: str,
           insight: InsightConfig | None = None) -> HiCache:
    insight = insight or InsightConfig()
    if not payload:
        return HiCache.metadata_only(PAGE, device_pages, host_pages, write_policy=policy,
                                     eviction_policy=eviction, insight=insight)
    pools = make_pools(_SPEC, _STAGE, PAGE, device_pages, host_pages=host_pages or None)
    host = ctrl = None
    if host_pages:
        host = HostPools(pools)
        ctrl = TransferController(pools, host, TransferStats())
    return HiCache(pools, host, ctrl, write_policy=policy, eviction_policy=eviction, insight=insight)


def _request(spec, i: int) -> Request:
    pages, tail, out = spec
    prompt = [v for p in pages for v in [100 + p] * PAGE] + [7] * tail
    return Request("h", i, np.asarray(prompt, np.int32), np.asarray([1000 + i] * out, np.int32))


def sums_exact(cache: HiCache) -> dict[str, dict[str, int]]:
    """Assert the per-tier sums; return the reasons."""
    s, m = cache.stats, cache.insight.miss_tokens()
    assert sum(m["host"].values()) == s.miss_tokens, (m, s)
    assert sum(m["device"].values()) == s.miss_tokens + s.host_hit_tokens, (m, s)
    assert m["device"]["evicted_from_device"] == s.host_hit_tokens
    assert m["host"]["evicted_from_device"] == 0
    assert all(v >= 0 for t in m.values() for v in t.values())
    return m


# -- the property --------------------------------------------------------------------------------
_req = st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=4),  # full prompt pages
                 st.integers(0, PAGE - 1),  # tokens of a partial prompt page (0: none)
                 st.integers(0, PAGE + 3))  # answer tokens
_ops = st.lists(st.tuples(st.sampled_from(["begin", "begin", "finish", "finish", "abort"]), _req,
                          st.integers(0, 5)), min_size=5, max_size=50)


def _replay(cache: HiCache, ops, agree: bool) -> HiCache:
    """Run ``ops``; deferred records are accounted at finish (with an agreed prefix if ``agree``)."""
    running = []

    def done(h, extra: int = 0) -> None:
        if cache.insight.defer and h.misses is not None:
            agreed = h.misses.matched + extra if agree and extra <= h.view.max_hit else None
            cache.insight.account(h.misses, agreed)

    for i, (op, spec, extra) in enumerate(ops):
        if op == "begin" or not running:
            try:
                running.append(cache.begin(_request(spec, i)))
            except CacheOutOfPagesError:
                assert running
        else:
            h = running.pop(0)
            (cache.finish if op == "finish" else cache.abort)(h)
            done(h, extra)
    for h in running:
        cache.finish(h)
        done(h)
    cache.check()
    return cache


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops, payload=st.sampled_from([False, False, True]),
       policy=st.sampled_from(["write_back", "write_through", "write_through_selective"]),
       device_pages=st.integers(8, 11), host_pages=st.sampled_from([0, 1, 2, 4, 10]),
       eviction=st.sampled_from(["lru", "lfu"]), seen=st.sampled_from([4, 1 << 16]))
def test_reasons_sum_exactly_to_each_tiers_misses(ops, payload, policy, device_pages, host_pages,
                                                  eviction, seen):
    """Immediate accounting (never_seen and the tail from the hit counters) and deferred
    accounting (every reason counted per lookup) agree reason by reason, and both sum exactly;
    with an agreed prefix, pages move to stage_disagreement and the sums still hold."""
    torch.set_num_threads(1)
    runs = {}
    for name, defer, agree in (("immediate", False, False), ("deferred", True, False),
                               ("agreed", True, True)):
        cfg = InsightConfig(defer=defer, seen_keys=seen, sample_every=2)
        cache = _replay(_cache(payload, device_pages, host_pages, policy, eviction, cfg), ops, agree)
        runs[name] = sums_exact(cache)
    assert runs["immediate"] == runs["deferred"]
    assert runs["deferred"]["host"]["stage_disagreement"] == 0
    moved = runs["agreed"]["host"]["stage_disagreement"]
    assert sum(runs["deferred"]["host"][r] for r in ("never_seen", "evicted_from_host", "dropped",
                                                    "writeback_pending")) >= moved


# -- each reason on purpose ---------------------------------------------------------------------
def _tokens(tag: int, pages: float) -> list[int]:
    return [tag * 10_000 + i for i in range(int(pages * PAGE))]


def _run(cache: HiCache, tokens: list[int], out: int = 0) -> None:
    arr = np.asarray(tokens, dtype=np.int32)
    cache.finish(cache.begin(Request("s", 0, arr[:len(arr) - out], arr[len(arr) - out:])))


def test_a_first_lookup_is_never_seen_plus_its_partial_page_tail():
    cache = _cache(False, 8, 8, "write_through", "lru")
    _run(cache, _tokens(1, 2.5))  # 2 whole pages may hit, the half page never can
    m = sums_exact(cache)["host"]
    assert m["never_seen"] == 2 * PAGE and m["partial_page_tail"] == PAGE // 2
    _run(cache, _tokens(1, 3))  # 3 whole pages: the last prompt token is always computed
    m = sums_exact(cache)["host"]
    assert m["partial_page_tail"] == PAGE // 2 + PAGE and m["never_seen"] == 2 * PAGE


def test_pages_found_on_host_are_evicted_from_device_and_host_evictions_are_counted():
    cache = _cache(False, 4, 4, "write_through", "lru")
    for tag in (1, 2, 1):  # the second lookup of 1 finds some of it on host
        _run(cache, _tokens(tag, 3) + [1])
    m = sums_exact(cache)
    assert m["device"]["evicted_from_device"] == cache.stats.host_hit_tokens > 0
    for tag in (3, 4, 1):  # 4 host pages for 12 ever cached: 1 left both tiers
        _run(cache, _tokens(tag, 3) + [1])
    m = sums_exact(cache)
    assert m["host"]["evicted_from_host"] > 0 and m["host"]["dropped"] == 0
    assert m["host"]["never_seen"] == 12 * PAGE and m["host"]["partial_page_tail"] == 6


def test_without_a_host_tier_evicted_pages_were_dropped():
    cache = _cache(False, 4, 0, "write_back", "lru")
    for tag in (1, 2, 1):
        _run(cache, _tokens(tag, 3) + [1])
    m = sums_exact(cache)["host"]
    assert m["dropped"] > 0 and m["evicted_from_host"] == 0


def _req(tokens: list[int]) -> Request:
    return Request("s", 0, np.asarray(tokens, np.int32), np.zeros(0, np.int32))


def test_a_drop_despite_a_host_tier_is_dropped():
    cache = _cache(False, 4, 1, "write_through", "lru")
    x, y, z = (_tokens(t, 1) + [1] for t in (1, 2, 3))
    _run(cache, x)  # x on device and on the one host page
    running = cache.begin(_req(x))  # x locked: its host copy cannot make room
    _run(cache, y)  # y's write-through finds no host page: device only
    _run(cache, z)  # evicts y: no host copy, no host room: dropped
    cache.finish(running)
    _run(cache, y)
    m = sums_exact(cache)["host"]
    assert cache.stats.dropped_pages == 1 and m["dropped"] == PAGE


def test_a_host_copy_evicted_before_its_write_back_is_writeback_pending():
    cache = _cache(False, 4, 1, "write_back", "lru")
    a, b = _tokens(1, 3) + [1], _tokens(2, 3) + [1]
    _run(cache, a)
    _run(cache, b)  # evicts a3, a2, a1 into one host page: a3's and a2's copies were still pending
    _run(cache, a)  # a1 from host, a2 and a3 nowhere
    m = sums_exact(cache)
    assert m["host"]["writeback_pending"] == 2 * PAGE
    assert m["device"]["evicted_from_device"] == PAGE


def test_deferred_records_book_pages_below_the_agreed_prefix_as_stage_disagreement():
    cache = _cache(False, 8, 8, "write_through", "lru", InsightConfig(defer=True))
    h = cache.begin(Request("s", 0, np.asarray(_tokens(1, 3) + [1], np.int32), np.zeros(0, np.int32)))
    cache.finish(h)
    cache.insight.account(h.misses, agreed=2)  # the other stages had 2 of these pages
    m = sums_exact(cache)["host"]
    assert m["stage_disagreement"] == 2 * PAGE and m["never_seen"] == PAGE
    assert m["partial_page_tail"] == 1


def test_the_last_mooncake_block_counts_only_its_tokens():
    from stagecache.runtime.traces.mooncake_trace import BlockRequest

    cache = HiCache.metadata_only(512, 8, 8, write_policy="write_through")
    cache.finish(cache.begin(BlockRequest(np.asarray([1, 2, 3]), 1100, 10, 512)))
    m = sums_exact(cache)["host"]
    assert m["never_seen"] == 1100 and m["partial_page_tail"] == 0


# -- the memory of evicted keys: tombstones in the key table ----------------------------------------
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "bury", "pop"]), st.integers(0, 40),
                              st.integers(0, 7)), max_size=300),
       keep=st.sampled_from([0, 3, 1000]), big=st.booleans())
def test_tombstones_answer_how_a_key_left_or_forget_it_never_lie(ops, keep, big):
    table, live, buried = KeyTable(bits=3, max_ghosts=keep), {}, {}
    for op, k, why in ops:
        key = (k << 58) | k if big else k  # keys that collide in the low bits
        if op == "put" and key not in live:
            table.put(key, k + 100)
            live[key] = k + 100
            buried.pop(key, None)
        elif key in live and op != "put":
            if op == "bury" and keep:
                table.bury(key, why)
                buried[key] = why
            else:
                table.pop(key)
            del live[key]
        assert len(table) == len(live) and table.ghosts <= max(keep, 1) + len(buried)
        assert all(table.get(key) == node for key, node in live.items())
    for k in range(41):
        key = (k << 58) | k if big else k
        got = table.get(key)
        if key in live:
            assert got == live[key]
        elif got != EMPTY:  # remembered: then with the right reason
            assert got <= GHOST and ghost_reason(got) == buried[key]
    if keep >= 1000:  # nothing forgotten
        assert {k for k in buried if table.get(k) <= GHOST} == set(buried)
    keys, nodes = table.items()
    assert dict(zip(keys.tolist(), nodes.tolist(), strict=True)) == live


def test_popping_a_key_shifts_back_over_tombstones_too():
    """A run [a][tombstone b][c], all homed at a's node: removing a must keep c reachable."""
    table = KeyTable(bits=3, max_ghosts=8)
    home = {}
    for k in range(1, 10_000):
        home.setdefault(((k * 0x9E3779B97F4A7C15) & (2**64 - 1)) >> 61, []).append(k)
    a, b, c = next(ks for ks in home.values() if len(ks) >= 3)[:3]
    for i, k in enumerate((a, b, c)):
        table.put(k, i)
    table.bury(b, 4)
    table.pop(a)
    assert table.get(c) == 2 and ghost_reason(table.get(b)) == 4 and table.get(a) == EMPTY


def test_tombstones_are_bounded_and_cost_at_most_34_bytes_each():
    table = KeyTable(max_ghosts=50_000)
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**63, 300_000, dtype=np.int64).tolist()
    for i, k in enumerate(keys):
        table.put(k, i % 1000)
        if i >= 1000:  # a cache of 1,000 pages: every insert evicts one
            table.bury(keys[i - 1000], 2)
    assert table.ghosts <= 50_000 + 0.7 * len(table._vals) and table.forgotten > 0
    assert table.nbytes() / (table.size + table.ghosts) <= 34.3
    assert ghost_reason(table.get(keys[-1001])) == 2  # the newest are remembered
    assert table.get(keys[0]) == EMPTY  # the oldest are forgotten


@pytest.mark.parametrize("bad", [dict(clock="ticks"), dict(sample_every=0), dict(seen_keys=0)])
def test_insight_config_refuses_bad_values(bad):
    with pytest.raises(ValueError):
        InsightConfig(**bad)
