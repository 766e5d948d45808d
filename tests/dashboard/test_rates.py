"""Windowed rates of the stages' counters: PromQL rate() semantics, bounded history."""

from __future__ import annotations

import pytest
from live_helpers import blank_live
from stagecache.dashboard.rates import History, increase, rates_of
from stagecache.runtime.live.numbers import StageLive


def live(stage: int, lookups: int, host: int, device: int = 0, d2h: int = 0, d2h_s: float = 0.0,
         busy: float = 0.0, bubble: float = 0.0) -> StageLive:
    d = blank_live(stage)
    d.update(cache_tokens={"device": device, "host": host, "miss": lookups - host - device},
             transfer_bytes={"d2h": d2h, "h2d": 0}, transfer_seconds={"d2h": d2h_s, "h2d": 0.0},
             stage_seconds=busy, bubble_seconds=bubble)
    return StageLive.model_validate(d)


def test_increase_handles_counter_resets_like_prometheus():
    assert increase([]) == 0 and increase([5]) == 0
    assert increase([0, 10, 25]) == 25
    assert increase([0, 10, 3, 8]) == 10 + 3 + 5  # the drop to 3 is a restart from zero


def test_rates_need_two_samples():
    r = rates_of(0, [1.0], [(1.0,) * 11])
    assert r.window_s == 0 and r.host_hit_rate is None and r.lookup_tokens_per_s is None


def test_a_burst_shows_in_the_window_and_a_finished_run_drops_to_zero():
    h = History(min_spacing_s=0)
    # 10 s of traffic at 100 lookups/s with 30% host hits, then 20 s of nothing
    for t in range(0, 11):
        h.observe([live(0, 100 * t, 30 * t)], float(t))
    (r,) = h.rates(window_s=5)
    assert r.window_s == 5 and r.lookup_tokens_per_s == pytest.approx(100)
    assert r.host_hit_rate == pytest.approx(0.3)
    for t in range(11, 31):
        h.observe([live(0, 1000, 300)], float(t))
    (r,) = h.rates(window_s=5)
    assert r.lookup_tokens_per_s == 0 and r.host_hit_rate is None  # nothing looked up: no ratio
    # the since-start mean would still say 0.3; the window over the whole history says so too
    (r,) = h.rates(window_s=30)
    assert r.host_hit_rate == pytest.approx(0.3) and r.lookup_tokens_per_s == pytest.approx(1000 / 30)


def test_every_stage_gets_its_own_rates():
    h = History(min_spacing_s=0)
    for t in range(5):
        h.observe([live(s, 100 * t, (10 + 20 * s) * t) for s in range(3)], float(t))
    assert [r.host_hit_rate for r in h.rates(10)] == pytest.approx([0.1, 0.3, 0.5])


def test_copy_bandwidth_and_bubble_fraction_come_from_counter_increases():
    h = History(min_spacing_s=0)
    h.observe([live(0, 0, 0, d2h=0, d2h_s=0.0, busy=1.0, bubble=1.0)], 0.0)
    h.observe([live(0, 0, 0, d2h=4_000_000, d2h_s=0.002, busy=4.0, bubble=2.0)], 2.0)
    (r,) = h.rates(10)
    assert r.d2h_bytes_per_s == pytest.approx(2_000_000)  # bytes per wall second
    assert r.d2h_copy_bandwidth == pytest.approx(2e9)  # bytes per second spent copying
    assert r.h2d_copy_bandwidth is None
    assert r.bubble_fraction == pytest.approx(1 / 4)


def test_history_is_bounded_and_close_samples_are_merged():
    h = History(max_window_s=10, min_spacing_s=0.5)
    for i in range(100):
        h.observe([live(0, i, 0)], i * 0.25)  # every other sample is too close to keep
    times = [t for t, _ in h._samples[0]]
    assert all(b - a >= 0.5 for a, b in zip(times, times[1:], strict=False))
    assert times[-1] - times[0] <= 10.5 and len(times) <= 22


def test_series_gives_the_rate_at_every_kept_sample():
    h = History(min_spacing_s=0)
    for t in range(6):
        h.observe([live(0, 10 * t * t, 0)], float(t))  # accelerating traffic
    series = h.series(window_s=1)[0]
    assert [r.time for r in series] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [r.lookup_tokens_per_s for r in series] == pytest.approx([10, 30, 50, 70, 90])
