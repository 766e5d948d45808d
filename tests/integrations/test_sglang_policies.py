"""``advise --policies``'s tree model == sglang 0.5.23's real radix tree, eviction by eviction.

Runs in ``.venv-sglang``.  Each trace is driven through sglang's real ``UnifiedRadixCache``
(full-KV tree, sglang's own ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` on CPU,
both of sglang's tree cores: the Rust one it uses by default and the Python one) the way sglang's
scheduler drives it with one request in flight: ``match_prefix`` on the prompt (the last prompt
token is never matched), lock the matched node, allocate the request's tokens past the prefix,
``evict`` the allocator's shortfall, ``insert`` what the request keeps (as
``checkpoint_into_tree`` does, then its prompt re-insert at priority + 1), unlock, free the rest.
The model (``sizing/policies.py``) replays the same views; every request's matched pages and every
eviction call (pages asked, the evicted pages in order, node by node) must be equal -- with
sglang's strategy objects and with stagecache's own versions.
"""

from __future__ import annotations

import array

import numpy as np
import pytest

pytest.importorskip("sglang", reason="sglang not installed (runs in .venv-sglang)")

import torch  # noqa: E402
from fast25 import fast25_views  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from stagecache.runtime.cache.pages import page_view  # noqa: E402
from stagecache.runtime.integrations.sglang_eviction import sglang_factory  # noqa: E402
from stagecache.runtime.sizing import policies as P  # noqa: E402
from stagecache.runtime.traces.block_workload import BlockWorkloadConfig, generate_blocks  # noqa: E402
from stagecache.runtime.traces.workload import WorkloadConfig, generate  # noqa: E402

SPECS = [P.PolicySpec("lru"), P.PolicySpec("lfu"), P.PolicySpec("slru"),
         P.PolicySpec("slru", {"protected_threshold": 4}), P.PolicySpec("priority"),
         P.PolicySpec("tlru", {"threshold": 8, "next_prompt_estimate": 2}),
         P.PolicySpec("tlru", P.TLRU_DEFAULT)]
IDS = [s.label.replace(" ", "") for s in SPECS]


def _recording(base: type) -> type:
    class Recording(base):  # sglang's allocator; remembers what an eviction frees
        recording: list | None = None

        def free_segment(self, free_index, *, start_pos):
            if self.recording is not None:
                self.recording.append(free_index.tolist())
            return super().free_segment(free_index, start_pos=start_pos)

    return Recording


def sglang_run(views, spec: P.PolicySpec, capacity: int, tpp: int, backend: str,
               reinsert: bool = True) -> tuple[list[int], list[tuple[int, int, list[list[int]]]]]:
    """Matched pages per request and eviction calls (request, pages asked, evicted pages' keys)
    from sglang's real tree."""
    size = capacity * tpp
    if tpp == 1:
        alloc = _recording(TokenToKVPoolAllocator)(size, torch.float16, "cpu", None, False)
    else:
        alloc = _recording(PagedTokenToKVPoolAllocator)(size, tpp, torch.float16, "cpu", None, False)
    cache = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=tpp,
        eviction_policy=spec.name, eviction_policy_config=dict(spec.config) or None,
        tree_components=(ComponentType.FULL,), tree_core_backend=backend))
    page_of: dict[int, int] = {}  # kv index -> page key
    matched_pages, calls = [], []
    for i, v in enumerate(views):
        keys = v.keys.tolist()
        tokens = (v.tokens.tolist() if v.tokens is not None else
                  [int(k) for k in v.keys.astype(np.int64)])  # a block is one token
        prompt = tokens[:v.input_len] if v.tokens is not None else tokens
        lookup = prompt[:v.max_hit * tpp]
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(array.array("q", lookup))))
        hit = m.device_prefix_len
        matched_pages.append(hit // tpp)
        node = m.last_device_node
        lock = cache.lock(node)
        prefix = cache.path_device_indices(node)
        need = len(tokens) - hit
        short = -(-need // tpp) * tpp - alloc.available_size()  # whole pages
        if short > 0:
            alloc.recording = []
            cache.evict(EvictParams(num_tokens=short))
            calls.append((i, short // tpp,
                          [[page_of[x] for x in seg[::tpp]] for seg in alloc.recording]))
            alloc.recording = None
        if tpp == 1:
            new = alloc.alloc(need)
        else:
            last = prefix[-1:] if len(prefix) else torch.empty(0, dtype=torch.int64)
            new = alloc.alloc_extend(
                prefix_lens=torch.tensor([hit]), prefix_lens_cpu=torch.tensor([hit]),
                seq_lens=torch.tensor([len(tokens)]), seq_lens_cpu=torch.tensor([len(tokens)]),
                last_loc=last if len(last) else torch.tensor([-1]), extend_num_tokens=need)
        assert new is not None, (i, need, alloc.available_size())
        values = torch.cat([prefix.to(torch.int64), new.to(torch.int64)])
        for pos in range(hit, len(tokens), tpp):
            page_of[int(values[pos])] = keys[pos // tpp]
        kept = v.cacheable * tpp
        key = RadixKey(array.array("q", tokens[:kept]))
        cache.insert(InsertParams(key=key, value=values[:kept].clone(), prev_prefix_len=hit,
                                  inserted_len=0, priority=0))
        prompt_len = P.prompt_pages(v) * tpp
        if reinsert and 0 < prompt_len < kept:
            cache.insert(InsertParams(key=RadixKey(array.array("q", tokens[:prompt_len])),
                                      value=values[:prompt_len].clone(), prev_prefix_len=prompt_len,
                                      inserted_len=prompt_len, priority=1))
        cache.unlock(lock)
        if len(tokens) > kept:
            alloc.free(values[kept:])
    return matched_pages, calls


def model_run(views, spec, capacity, tpp, strategy, reinsert=True):
    r = P.run_policy(views, strategy, capacity, "device", tpp, spec.name == "tlru",
                     prompt_reinsert=reinsert, record=True)
    return r.hit_pages, [(c.request, c.asked, c.evicted) for c in r.evictions]


def compare(views, spec, capacity, tpp, backend="rust", reinsert=True, min_calls=5):
    want_hits, want_calls = sglang_run(views, spec, capacity, tpp, backend, reinsert)
    assert len(want_calls) >= min_calls, "the size must make the tree evict"
    theirs = sglang_factory()(spec)
    for strategy in (theirs, P.own_strategy(spec)):
        hits, calls = model_run(views, spec, capacity, tpp, strategy, reinsert)
        assert hits == want_hits
        assert len(calls) == len(want_calls)
        for got, want in zip(calls, want_calls, strict=True):
            assert got[:2] == want[:2], (got[:2], want[:2])
            if backend == "python":  # one free per node: node boundaries too
                assert got[2] == want[2], (got, want)
            else:
                assert sum(got[2], []) == sum(want[2], []), (got, want)
    return len(want_calls)


def _block_views(requests=400, seed=3):
    reqs = generate_blocks(BlockWorkloadConfig(seed=seed, requests=requests, block_tokens=16))
    return [page_view(r, 16) for r in reqs]


def _token_views(page, requests=160, seed=5):
    reqs = generate(WorkloadConfig(seed=seed, requests=requests))
    return [page_view(r, page) for r in reqs]


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("backend", ["rust", "python"])
def test_block_trace_every_eviction(spec, backend):
    views = _block_views()
    longest = max(v.pages for v in views)
    for cap in (longest + 5, 3 * longest):
        compare(views, spec, cap, 1, backend)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("tpp,reinsert", [(1, True), (4, True), (4, False)])
def test_token_trace_every_eviction(spec, tpp, reinsert):
    views = _token_views(tpp)
    longest = max(v.pages for v in views)
    compare(views, spec, 2 * longest, tpp, "rust", reinsert)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_fast25_every_eviction(spec, tmp_path):
    views = fast25_views(tmp_path)
    longest = max(v.pages for v in views)
    calls = compare(views, spec, max(2 * longest, 4096), 1, "rust", min_calls=1000)
    assert calls > 1000


def test_the_comparison_can_fail():
    """A model that leaves out one of sglang's rules (the prompt re-insert at priority + 1, or the
    split that re-stamps a segment) is caught: the comparison is not vacuous."""
    views = _token_views(4)
    spec = P.PolicySpec("priority")
    cap = 2 * max(v.pages for v in views)
    want = sglang_run(views, spec, cap, 4, "rust", reinsert=True)
    assert model_run(views, spec, cap, 4, P.own_strategy(spec), reinsert=False) != want
    assert model_run(views, spec, cap, 4, P.own_strategy(spec), reinsert=True) == want
    lfu = P.PolicySpec("lfu")
    assert model_run(views, lfu, cap, 4, P.LRU()) != sglang_run(views, lfu, cap, 4, "rust")


def test_advise_uses_sglangs_strategies_and_agrees_with_stagecaches(tmp_path, capsys):
    """`advise --policies` with sglang installed ranks by sglang's classes (``auto``), and its whole
    ``policies`` report equals the one ranked by stagecache's versions."""
    import json

    from stagecache.runtime.cli.main import main
    from stagecache.runtime.traces.readers import write_trace

    trace = tmp_path / "blocks.jsonl"
    write_trace(trace, generate_blocks(BlockWorkloadConfig(seed=3, requests=300, block_tokens=512)))
    reports = {}
    for order in ("auto", "stagecache"):
        assert main(["advise", "--trace", str(trace), "--policies", "--policy-order", order,
                     "--no-belady", "--json"]) == 0
        reports[order] = json.loads(capsys.readouterr().out)["policies"]
    assert reports["auto"]["source"].startswith("sglang 0.5.2")
    assert reports["stagecache"]["source"] == "stagecache"
    for key in ("tiers", "stages", "policies", "unreduced_pools"):
        assert reports["auto"][key] == reports["stagecache"][key], key
