"""Sampled lifetimes (cache/lifetimes.py): the logged-then-folded histograms are exactly what
observing one value at a time gives, and a real cache's lifetimes and reuse gaps are the ones
its request stream implies."""

from __future__ import annotations

import bisect
import random

import numpy as np
import pytest
from stagecache.runtime.cache import lifetimes
from stagecache.runtime.cache.hicache import HiCache
from stagecache.runtime.cache.insight import InsightConfig
from stagecache.runtime.cache.lifetimes import BUCKETS, InsightClock, Lifetimes
from stagecache.runtime.traces.readers import Request


def _oracle_at(ticks: list[int], offset: int, stamp: int) -> int:
    return offset + max(0, bisect.bisect_right(ticks, stamp) - 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fold_equals_one_value_at_a_time(seed, monkeypatch):
    """Random marks, deaths and reuses, folded at random moments (and by the log filling up,
    and by the clock forgetting marks): every bucket and sum equals a bisect oracle."""
    monkeypatch.setattr(lifetimes, "FOLD_AT", 37)
    monkeypatch.setattr(lifetimes, "MAX_MARKS", 300)
    rng = random.Random(seed)
    clock = InsightClock("requests")
    life = Lifetimes(clock)
    edges = BUCKETS["requests"]
    want = {(t, h): [0] * (len(edges) + 1) for t in (0, 1) for h in lifetimes.HISTOGRAMS}
    sums = {k: 0.0 for k in want}
    all_ticks: list[int] = []  # every mark ever made (the oracle never forgets)
    tick = 0

    def observe(t: int, h: str, v: float) -> None:
        want[t, h][bisect.bisect_left(edges, v)] += 1
        sums[t, h] += v

    for _ in range(2000):
        tick += rng.randint(1, 3)
        clock.mark(tick)
        all_ticks.append(tick)
        now = clock.now()
        assert now == len(all_ticks) - 1
        if rng.random() < 0.3:  # a death: born some lookups ago, last used at an older tick
            t = rng.randint(0, 1)
            birth = rng.randint(max(0, int(now) - 400), int(now))
            stamp = rng.randint(max(1, tick - 250), tick)
            life.death(t, now, birth, stamp)
            observe(t, "lifetime", now - birth)
            observe(t, "idle", now - _oracle_at(all_ticks, 0, stamp))
        if rng.random() < 0.2:  # a sampled lookup's path: old stamps, the first few on device
            stamps = [rng.randint(max(1, tick - 250), tick) for _ in range(rng.randint(0, 9))]
            dev = rng.randint(0, len(stamps))
            life.reuse(stamps, dev)
            for i, s in enumerate(stamps):
                observe(0 if i < dev else 1, "reuse_gap", now - _oracle_at(all_ticks, 0, s))
        if rng.random() < 0.01:
            life.fold()
        life.trim_clock()  # keeps >= 150 marks: every stamp above is within them (<= 125 back)
    snap = life.snapshot()
    for (t, h), counts in want.items():
        got = snap[lifetimes.INSIGHT_TIERS[t]][h]
        assert got["counts"] == list(np.cumsum(counts)), (t, h)
        assert got["sum"] == pytest.approx(sums[t, h])
    assert clock.offset > 0  # the clock did forget marks on the way (trim folded first)
    assert sum(want[0, "reuse_gap"]) > 50 and sum(want[1, "idle"]) > 50


def _req(i: int, page: int) -> Request:
    """One full page of ``page`` tokens and one more prompt token (always computed)."""
    return Request("s", i, np.asarray([100 + page] * 16 + [7], np.int32), np.asarray([1], np.int32))


def test_a_cache_reports_the_lifetimes_its_requests_imply():
    """Requests clock, every lookup sampled, three device pages (a request takes two, keeps
    one): A, B, A (reused 2 lookups after its insertion), C (evicts B: born at lookup 1, last
    used then), D (evicts A: born at 0, last used at lookup 2).  A death inside a lookup's
    allocation reads the lookup before it."""
    cache = HiCache.metadata_only(16, 3, 0, insight=InsightConfig(clock="requests"))
    for i, page in enumerate("ABACD"):
        cache.finish(cache.begin(_req(i, ord(page))))
    h = cache.insight.histograms()["device"]
    assert h["reuse_gap"]["sum"] == 2 and h["reuse_gap"]["counts"][-1] == 1
    assert cache.stats.device_evicted_pages == 2
    assert h["lifetime"]["counts"][-1] == 2 and h["lifetime"]["sum"] == (2 - 1) + (3 - 0)
    assert h["idle"]["counts"][-1] == 2 and h["idle"]["sum"] == (2 - 1) + (3 - 2)
    assert h["lifetime"]["counts"][0] == 1  # B: 1 lookup (le=1); A: 3 (le=4)
    assert h["lifetime"]["counts"][1] == 1 and h["lifetime"]["counts"][2] == 2


def test_seconds_clock_reads_the_time_of_the_lookup_at_or_before_a_stamp():
    clock = InsightClock("seconds")
    life = Lifetimes(clock)
    for tick in (10, 20, 30):
        clock.mark(tick)
    marks = list(clock.times)
    before = clock.now()
    life.reuse([5, 10, 25, 30], 2)  # older than every mark: reads the oldest
    life.death(1, before, before - 0.5, 19)
    snap = life.snapshot()
    now = snap["device"]["reuse_gap"]["sum"] / 2 + marks[0]  # both device gaps: now - marks[0]
    assert snap["device"]["reuse_gap"]["counts"][-1] == 2 and snap["host"]["reuse_gap"]["counts"][-1] == 2
    assert snap["host"]["reuse_gap"]["sum"] == pytest.approx(2 * now - marks[1] - marks[2])
    assert snap["host"]["lifetime"]["sum"] == pytest.approx(0.5)
    assert snap["host"]["idle"]["sum"] == pytest.approx(before - marks[0])
