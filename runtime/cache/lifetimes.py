"""Sampled lifetimes, idle times and reuse gaps: the insight's clock and histograms.

Why a log and a fold: an observation happens where the cache is busiest (an
entry leaving a tier inside an allocation, a lookup's matched path), so the hot
path only appends a tuple -- the clock reading and the tree stamps it needs.
``Lifetimes.fold`` turns the log into histogram counts with numpy: at most
``FOLD_AT`` observations later (inside the call that filled the log), before the
clock forgets marks, and before anything reads the histograms.  Counts are the
same as observing one value at a time: ``searchsorted(side="left")`` is
``bisect_left``, the bucket rule of Prometheus' ``le``.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

INSIGHT_TIERS = ("device", "host")
CLOCKS = ("seconds", "requests")
#: Histogram upper bounds per clock (Prometheus ``le``); +Inf is implied.
BUCKETS: dict[str, tuple[float, ...]] = {
    "seconds": (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                600.0, 1800.0, 3600.0),
    "requests": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                 65536),
}
HISTOGRAMS = ("lifetime", "idle", "reuse_gap")
#: Clock marks kept (one per lookup); older ticks read as the oldest mark kept.
MAX_MARKS = 1 << 20
#: Observations logged before they are folded into the histograms.
FOLD_AT = 4096


class Histogram:
    """Fixed buckets (non-cumulative counts; ``cumulative`` gives Prometheus' view)."""

    __slots__ = ("edges", "_edges", "counts", "sum")

    def __init__(self, edges: Sequence[float]):
        self.edges = tuple(edges)
        self._edges = np.asarray(edges, dtype=np.float64)
        self.counts = np.zeros(len(self.edges) + 1, dtype=np.int64)
        self.sum = 0.0

    def add(self, values: np.ndarray) -> None:
        if values.size:
            idx = np.searchsorted(self._edges, values, side="left")
            self.counts += np.bincount(idx, minlength=len(self.counts))
            self.sum += float(values.sum())

    def cumulative(self) -> list[int]:
        return np.cumsum(self.counts).tolist()


class InsightClock:
    """Maps the tree's logical ticks to the insight clock, one mark per lookup.

    ``requests``: the index of the lookup (a replay's trace time); ``seconds``:
    ``time.monotonic`` when it happened."""

    def __init__(self, kind: str):
        self.kind = kind
        self.ticks = array("q")
        self.times: array | None = array("d") if kind == "seconds" else None
        self.offset = 0  # lookups forgotten from the front (requests clock)
        if self.times is None:  # the requests clock keeps only the tick (``at`` is its index)
            self.mark = self.ticks.append

    def mark(self, tick: int) -> None:
        """A lookup at ``tick`` (the seconds clock: and when it happened)."""
        self.ticks.append(tick)
        self.times.append(time.monotonic())  # type: ignore[union-attr]

    def trim(self) -> None:
        """Forget the older half of the marks once there are more than ``MAX_MARKS``."""
        if len(self.ticks) <= MAX_MARKS:
            return
        half = len(self.ticks) // 2
        del self.ticks[:half]
        if self.times is not None:
            del self.times[:half]
        self.offset += half

    def now(self) -> float:
        """Seconds now, or the index of the latest lookup (a death during a lookup's own
        allocation reads the lookup before it: the requests clock resolves one lookup)."""
        if self.times is not None:
            return time.monotonic()
        return self.offset + len(self.ticks) - 1

    def at(self, stamps: np.ndarray) -> np.ndarray:
        """Clock value of the last lookup at or before each tick (the oldest mark if older)."""
        if not self.ticks:
            return np.full(len(stamps), self.now(), dtype=np.float64)
        ticks = np.frombuffer(self.ticks, dtype=np.int64)  # a view: released on return
        i = np.maximum(np.searchsorted(ticks, stamps, side="right") - 1, 0)
        del ticks
        if self.times is not None:
            times = np.frombuffer(self.times, dtype=np.float64)
            out = times[i]  # a copy
            del times
            return out
        return (i + self.offset).astype(np.float64)


class Lifetimes:
    """Per tier: lifetime, idle time before eviction and reuse gap, logged then folded."""

    def __init__(self, clock: InsightClock):
        self.clock = clock
        edges = BUCKETS[clock.kind]
        self.hist = {(t, h): Histogram(edges) for t in range(len(INSIGHT_TIERS)) for h in HISTOGRAMS}
        self.deaths: list[tuple[int, float, float, int]] = []  # (tier, now, birth, last-use stamp)
        self.reuses: list[tuple[float, list[int], int]] = []  # (now, old stamps, device pages)
        self.logged = 0  # reuse gaps logged (pages)

    def death(self, tier: int, now: float, birth: float, stamp: int) -> None:
        deaths = self.deaths
        deaths.append((tier, now, birth, stamp))
        if len(deaths) >= FOLD_AT:
            self.fold()

    def reuse(self, stamps: list[int], device_pages: int) -> None:
        """A sampled lookup hit a path whose old stamps are ``stamps`` (the first
        ``device_pages`` on device, the rest on host)."""
        self.reuses.append((self.clock.now(), stamps, device_pages))
        self.logged += len(stamps)
        if self.logged >= FOLD_AT:
            self.fold()

    def fold(self) -> None:
        """Everything logged into the histograms (one numpy pass per kind)."""
        hist, at = self.hist, self.clock.at
        if self.deaths:
            d = np.array(self.deaths, dtype=np.float64)
            self.deaths.clear()
            life, idle = d[:, 1] - d[:, 2], d[:, 1] - at(d[:, 3].astype(np.int64))
            for t in range(len(INSIGHT_TIERS)):
                m = d[:, 0] == t
                hist[t, "lifetime"].add(life[m])
                hist[t, "idle"].add(idle[m])
        if self.reuses:
            lens = np.array([len(s) for _, s, _ in self.reuses], dtype=np.int64)
            stamps = np.fromiter((x for _, s, _ in self.reuses for x in s), dtype=np.int64,
                                 count=int(lens.sum()))
            now = np.repeat(np.array([r[0] for r in self.reuses], dtype=np.float64), lens)
            dev = np.repeat(np.array([r[2] for r in self.reuses], dtype=np.int64), lens)
            pos = np.arange(len(stamps)) - np.repeat(np.cumsum(lens) - lens, lens)
            self.reuses.clear()
            self.logged = 0
            gap, on_host = now - at(stamps), pos >= dev
            hist[0, "reuse_gap"].add(gap[~on_host])
            hist[1, "reuse_gap"].add(gap[on_host])

    def trim_clock(self) -> None:
        """Let the clock forget old marks, folding first (what is logged needs them)."""
        if len(self.clock.ticks) > MAX_MARKS:
            self.fold()
            self.clock.trim()

    def snapshot(self) -> dict[str, dict[str, dict[str, Any]]]:
        self.fold()
        return {tier: {name: {"le": list(h.edges), "counts": h.cumulative(), "sum": h.sum}
                       for name in HISTOGRAMS for h in (self.hist[t, name],)}
                for t, tier in enumerate(INSIGHT_TIERS)}
