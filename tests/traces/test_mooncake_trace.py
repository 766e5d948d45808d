"""Mooncake's block-hash format: reading it strictly, replaying it, and the offline bounds.

The sample is self-written (``mooncake_sample.py``), never the public trace.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest
from mooncake_sample import sample_lines, write_sample
from stagecache.runtime.cache.hicache import HiCache
from stagecache.runtime.cache.pages import page_view
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.sizing.bounds import CeilingTracker, belady_hit_tokens
from stagecache.runtime.traces.mooncake_trace import BlockRequest
from stagecache.runtime.traces.readers import TraceError, load_requests, parse_trace


@pytest.fixture
def sample(tmp_path):
    path = tmp_path / "mc.jsonl"
    write_sample(path, 400, seed=1)
    return path


def test_detected_streamed_and_limited(sample, tmp_path):
    trace = load_requests(sample)
    assert trace.format == "mooncake" and len(trace.requests) == 400 and trace.lines_read == 400
    r = trace.requests[5]
    assert isinstance(r, BlockRequest) and r.block_tokens == 512 and r.line == 6
    assert len(r.hash_ids) == -(-r.input_len // 512)
    # --requests N stops reading at N: a broken line after it is never read
    broken = tmp_path / "broken.jsonl"
    broken.write_text(sample.read_text().splitlines()[0] + "\n" + "{oops\n" * 3)
    head = load_requests(broken, limit=1)
    assert len(head.requests) == 1 and head.lines_read == 1
    with pytest.raises(TraceError, match=f"{broken}:2: invalid JSON"):
        load_requests(broken)


def test_forced_format_and_undetectable_first_line(sample, tmp_path):
    with pytest.raises(TraceError, match=f"{sample}:1: unknown field.*'hash_ids'"):
        load_requests(sample, fmt="tokens")
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ConfigError, match="cannot tell the format.*--trace-format"):
        load_requests(odd)
    with pytest.raises(ConfigError, match="accepted: auto, tokens, mooncake"):
        load_requests(odd, fmt="csv")


GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}


@pytest.mark.parametrize("change, message", [
    ({"input_length": 1_000_000_000}, "field 'input_length' = 1000000000: accepted: an integer in "
                                      "[1, 2097152]"),
    ({"input_length": -5}, "field 'input_length' = -5: accepted: an integer in [1, "),
    ({"output_length": 2.5}, "field 'output_length' = 2.5: accepted: an integer in [0, "),
    ({"hash_ids": [1, "x"]}, "field 'hash_ids[1]' = 'x': accepted: an integer in [0, 2**63)"),
    ({"hash_ids": [1, True]}, "field 'hash_ids[1]' = True: accepted"),
    ({"hash_ids": [-1, 2]}, "field 'hash_ids[0]' = -1: accepted"),
    ({"hash_ids": [1, 2**64]}, "field 'hash_ids[1]' = 18446744073709551616: accepted"),
    ({"hash_ids": 7}, "field 'hash_ids' = int: accepted: a list of integers"),
    ({"hash_ids": [1, 2, 3]}, "field 'hash_ids' has 3 ids for input_length 1000: accepted: exactly "
                              "ceil(1000 / 512) = 2"),
    ({"hash_ids": list(range(10**6))}, "has 1000000 ids for input_length 1000"),
    ({"hash_ids": [9, 2]}, "hash_ids[1] = 2 follows id 9 here but followed id 1 earlier"),
    ({"hash_ids": [2, 1]}, "hash_ids[0] = 2 follows the start of the prompt here but followed id 1"),
    ({"timestamp": -1}, "field 'timestamp' = -1: accepted: milliseconds"),
    ({"session": "a"}, "unknown field(s) 'session': accepted: timestamp, input_length"),
    ({"hash_ids": None}, "field 'hash_ids' = NoneType"),
])
def test_a_bad_line_is_one_clear_error(tmp_path, change, message):
    path = tmp_path / "bad.jsonl"
    bad = {**GOOD, **change}
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceError) as exc:
        load_requests(path)
    text = str(exc.value)
    assert f"{path}:2: " in text and message in text and "\n" not in text
    skipped = load_requests(path, skip_bad=True)
    assert len(skipped.requests) == 1 and skipped.bad_lines == 1


def test_missing_field_and_oversized_line():
    lines = [json.dumps(GOOD), json.dumps({"input_length": 5, "output_length": 1})]
    with pytest.raises(TraceError, match="<trace>:2: missing required field 'hash_ids'"):
        parse_trace(lines)
    long_line = json.dumps({**GOOD, "hash_ids": [1, 2], "timestamp": 0.5}) + " " * 500
    with pytest.raises(TraceError, match="<trace>:2: line longer than 300 bytes"):
        parse_trace([json.dumps(GOOD), long_line], max_line_bytes=300)


def test_an_oversized_line_in_a_file_is_skipped_unread(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + "x" * 5000 + "\n" + json.dumps({**GOOD, "timestamp": 9}))
    with open(path, "rb") as f:
        trace = parse_trace(f, str(path), skip_bad=True, max_line_bytes=1000)
    assert [r.line for r in trace.requests] == [1, 3] and "line longer than 1000" in str(trace.errors[0])


def test_page_views_of_a_block_request():
    r = BlockRequest(np.array([4, 5, 6]), 1100, 20, 512)
    v = page_view(r, 512)
    assert v.keys.tolist() == [4, 5, 6] and v.max_hit == v.cacheable == 3
    assert v.hit_tokens(3) == 1100 and v.hit_tokens(2) == 1024  # the partial block is capped
    # at another page size the request is replayed through its synthesised tokens
    t = page_view(r, 256)
    assert len(t.tokens) == 1120 and t.max_hit == 1099 // 256 and t.cacheable == 1120 // 256
    other = BlockRequest(np.array([4, 5, 7]), 1100, 20, 512)  # same first two blocks
    assert np.array_equal(other.tokens()[:1024], r.tokens()[:1024])
    assert not np.array_equal(other.tokens()[1024:1100], r.tokens()[1024:1100])


def plain_simulator(lines, device_blocks, ratio=4, block=512, leaf_first=False):
    """The issue's reference: inclusive LRU tiers, host = ratio x device, every block written to
    both and refreshed in both on access; a hit is the longest cached prefix x block, capped.

    ``leaf_first``: a request's blocks are refreshed deepest first, so within one request the
    prefix counts as the more recent -- the order a radix tree evicts in (leaves first).
    Returns (total, device) hit rates.
    """
    dev, host = OrderedDict(), OrderedDict()
    hit = hit_dev = total = 0
    for line in lines:
        ids, n = line["hash_ids"], line["input_length"]
        k = d = 0
        while k < len(ids) and ids[k] in host:
            k += 1
        while d < len(ids) and ids[d] in dev:
            d += 1
        hit += min(k * block, n)
        hit_dev += min(d * block, n)
        total += n
        for b in reversed(ids) if leaf_first else ids:
            for tier, cap in ((dev, device_blocks), (host, ratio * device_blocks)):
                tier[b] = None
                tier.move_to_end(b)
                if len(tier) > cap:
                    tier.popitem(last=False)
    return hit / total, hit_dev / total


@pytest.mark.parametrize("device_pages", [32, 96])
def test_lru_write_through_agrees_with_the_plain_simulator(device_pages):
    lines = sample_lines(1500, seed=3, conversations=120)
    views = [page_view(r, 512) for r in parse_trace(map(json.dumps, lines)).requests]
    cache = HiCache.metadata_only(512, device_pages, 4 * device_pages, write_policy="write_through")
    for v in views:
        cache.finish(cache.begin(v))
    s = cache.stats
    want, _ = plain_simulator(lines, device_pages)
    assert 0.05 < want < 0.6
    assert s.hit_ratio == pytest.approx(want, abs=0.005)
    # the one rule that differs is the eviction order inside a request: with it, exactly equal
    assert (s.hit_ratio, s.device_hit_ratio) == plain_simulator(lines, device_pages, leaf_first=True)
    cache.check()


def test_bounds_order_and_incremental_ceiling():
    lines = sample_lines(800, seed=4)
    views = [page_view(r, 512) for r in parse_trace(map(json.dumps, lines)).requests]
    total = sum(v.input_len for v in views)
    ceiling = CeilingTracker()
    rates = [ceiling.observe(v) for v in views]
    assert sum(rates) == ceiling.hit_tokens and ceiling.input_tokens == total
    cap = 128
    cache = HiCache.metadata_only(512, cap // 4, cap, write_policy="write_through")
    for v in views:
        cache.finish(cache.begin(v))
    lru = cache.stats.hit_ratio
    belady = belady_hit_tokens(views, cap) / total
    assert lru < belady <= ceiling.hit_rate
    assert belady_hit_tokens(views, 10**9) == ceiling.hit_tokens  # no eviction: the ceiling
    assert belady_hit_tokens(views, 0) == 0
