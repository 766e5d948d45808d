"""Metadata-only replay against payload replay, and ``stagecache bench hicache`` on both formats.

The metadata mode must make exactly the payload mode's decisions: the same
trace slice goes through a real-pools HiCache (every reused page verified byte
for byte) and a tensor-free one, and every counter must match.
"""

from __future__ import annotations

import json

import pytest
from mooncake_sample import write_sample
from plans import pools as make_pools
from stagecache.runtime.bench.hicache import replay
from stagecache.runtime.cache.hicache import HiCache
from stagecache.runtime.cache.kv_writer import KvWriter
from stagecache.runtime.cli.main import main
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.serve.stage_cache import build_trace
from stagecache.runtime.traces.readers import WorkloadConfig, generate, load_requests
from stagecache.runtime.transfer.controller import TransferController
from stagecache.runtime.transfer.stats import TransferStats

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def sample(tmp_path):
    path = tmp_path / "mc.jsonl"
    write_sample(path, 300, seed=2, conversations=40)
    return path


def _both(requests, page, device_pages, host_pages, policy, eviction, concurrency=3):
    spec = load_spec("tiny-v4")
    stage = build_layout(spec, 4).stages[2]  # every pool kind
    pools = make_pools(spec, stage, page, device_pages, host_pages=host_pages)
    host = HostPools(pools)
    payload = HiCache(pools, host, TransferController(pools, host, TransferStats()),
                      write_policy=policy, eviction_policy=eviction)
    res = replay(requests, payload, KvWriter(pools), verify=True, concurrency=concurrency,
                 check_every=25)
    meta = HiCache.metadata_only(page, device_pages, host_pages, stage=2, write_policy=policy,
                                 eviction_policy=eviction)
    replay(requests, meta, concurrency=concurrency, check_every=25)
    return payload, meta, res


def _counters(cache):
    d = cache.stats.to_dict()
    return {k: v for k, v in d.items() if not k.startswith(("transfer", "bandwidth"))}


@pytest.mark.parametrize("policy, eviction", [("write_back", "lru"), ("write_through", "lfu"),
                                              ("write_through_selective", "lru")])
def test_metadata_and_payload_decide_the_same_on_a_mooncake_slice(sample, policy, eviction):
    reqs = load_requests(sample, limit=150).requests
    payload, meta, res = _both(reqs, 512, 40, 60, policy, eviction)
    assert res.mismatch_count == 0 and res.pages_verified > 100
    assert _counters(payload) == _counters(meta)
    s = meta.stats
    assert s.host_hit_tokens > 0 and s.device_evicted_pages > 0 and s.load_pages > 0
    # bytes moved = pages moved x the memory layer's bytes per page, in both directions
    moved = payload.controller.stats.live().transfer_bytes
    per_page = payload.pools.token_page_bytes()
    assert moved.d2h == s.backup_pages * per_page
    assert moved.h2d == s.load_pages * per_page


def test_metadata_and_payload_decide_the_same_on_a_token_trace():
    reqs = generate(WorkloadConfig(seed=5, requests=150, system_prompt_len=(128, 384),
                                   user_len=(16, 128), assistant_len=(16, 128), think_time_s=5.0,
                                   session_gap_s=0.5))
    payload, meta, res = _both(reqs, 128, 30, 45, "write_through", "lru")
    assert res.mismatch_count == 0 and res.pages_verified > 100
    assert _counters(payload) == _counters(meta) and meta.stats.load_pages > 0


def _bench(capsys, *argv):
    rc = main(["bench", "hicache", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_bench_metadata_only_on_a_mooncake_trace(capsys, sample):
    rc, out, err = _bench(capsys, "--trace", sample, "--metadata-only", "--device-pages", 32,
                          "--requests", 200, "--json")
    assert rc == 0, err
    res = json.loads(out)
    rate = res["token_hit_rate"]
    assert set(rate) == {"device", "host", "total", "ceiling", "belady"}
    assert rate["total"] == pytest.approx(rate["device"] + rate["host"], abs=2e-4)
    assert 0 < rate["host"] and rate["total"] <= rate["ceiling"] and rate["belady"] <= rate["ceiling"]
    assert res["page_size"] == 512 and res["trace_format"] == "mooncake" and res["metadata_only"]
    assert res["trace"]["requests"] == 200 and res["trace"]["lines_read"] == 200
    tr = res["transfer"]
    per_stage = [r["token_page_bytes"] for r in res["per_stage"]["hicache"]]
    assert tr["bytes"]["d2h"] == tr["pages_per_stage"]["d2h"] * sum(per_stage) > 0
    assert tr["bandwidth_gbps"]["d2h"] > 0
    assert tr["implied_seconds"]["h2d"] == pytest.approx(
        tr["bytes"]["h2d"] / (tr["bandwidth_gbps"]["h2d"] * 1e9), rel=0.01)
    rc, out, _ = _bench(capsys, "--trace", sample, "--metadata-only", "--device-pages", 32,
                        "--requests", 200)
    assert rc == 0 and "belady" in out and "ceiling" in out and "GB/s" in out


def test_bench_payload_mode_verifies_a_mooncake_slice(capsys, sample):
    rc, out, err = _bench(capsys, "--trace", sample, "--requests", 60, "--pp-size", 2,
                          "--device-pages", 40, "--hicache-ratio", 2, "--verify", "--json")
    assert rc == 0, err
    res = json.loads(out)
    hi = res["summary"]["hicache"]
    assert hi["mismatches"] == 0 and hi["pages_verified"] > 0 and hi["stages_agree"]


@pytest.mark.parametrize("extra, message", [
    (["--page-size", "256"], "in Mooncake format one block is one page"),
    (["--metadata-only", "--verify"], "--verify checks page bytes"),
    (["--block-tokens", "256"], ":1: field 'hash_ids' has"),
    (["--device-pages", "4", "--metadata-only"], "--device-pages 4 cannot hold"),
])
def test_bench_refuses_bad_input_in_one_line(capsys, sample, extra, message):
    rc, _, err = _bench(capsys, "--trace", sample, *extra)
    assert rc == 2 and message in err and "Traceback" not in err and err.count("\n") == 1


def test_serve_reads_either_format(sample, tmp_path):
    reqs = build_trace(str(sample), 10, 0)
    assert len(reqs) == 10 and all(r.hash_ids is not None for r in reqs)
    tokens = tmp_path / "t.jsonl"
    tokens.write_text('{"session": "a", "turn": 0, "input_len": 300, "output_len": 4}\n')
    assert build_trace(str(tokens), 0, 0)[0].input_len == 300
    # a block request at another page size runs through its synthesised tokens
    cache = HiCache.metadata_only(256, 64)
    h = cache.begin(reqs[0])
    assert len(h.tokens) == reqs[0].input_len + reqs[0].output_len
    cache.finish(h)
