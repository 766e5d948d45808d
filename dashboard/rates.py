"""Windowed rates of the stages' counters, computed the way PromQL's ``rate()`` does.

Stages publish counters only (``StageLive``: tokens, bytes, seconds since the
stage started).  The dashboard samples them whenever it reads the source (each
poll, like a Prometheus scrape) into a bounded ``History``, and a chart point
is the increase over the last ``window`` seconds divided by the time between
the first and last sample in that window -- so a burst shows as a burst, and a
finished run drops to zero instead of freezing at its since-start mean.  A
counter that goes down (a restarted stage) counts from zero again, as in
Prometheus.  Unlike ``rate()`` there is no extrapolation to the window edges.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise

from pydantic import BaseModel, Field
from stagecache.runtime.cache.insight import MISS_REASONS
from stagecache.runtime.live.numbers import StageLive

#: Counter name -> how to read it from a ``StageLive``.  Add a counter here to chart its rate.
COUNTERS: dict[str, Callable[[StageLive], float]] = {
    "requests": lambda s: s.requests,
    "lookup_tokens": lambda s: s.cache_tokens.looked_up,
    "device_hit_tokens": lambda s: s.cache_tokens.device,
    "host_hit_tokens": lambda s: s.cache_tokens.host,
    "storage_hit_tokens": lambda s: s.cache_tokens.storage,
    "miss_tokens": lambda s: s.cache_tokens.miss,
    "d2h_bytes": lambda s: s.transfer_bytes.d2h,
    "h2d_bytes": lambda s: s.transfer_bytes.h2d,
    "d2h_seconds": lambda s: s.transfer_seconds.d2h,
    "h2d_seconds": lambda s: s.transfer_seconds.h2d,
    "busy_seconds": lambda s: s.stage_seconds,
    "bubble_seconds": lambda s: s.bubble_seconds,
    # transfers: queue wait vs DMA time (DMA seconds: *_seconds above)
    "d2h_transfers": lambda s: s.transfer_count.d2h,
    "h2d_transfers": lambda s: s.transfer_count.h2d,
    "d2h_queue_seconds": lambda s: s.transfer_split.queue_seconds.d2h,
    "h2d_queue_seconds": lambda s: s.transfer_split.queue_seconds.h2d,
    # why prompt tokens missed the device tier, by reason (cache insight)
    **{f"miss_{r}": (lambda s, r=r: s.insight.miss_tokens.get("device", {}).get(r, 0))
       for r in MISS_REASONS},
}
NAMES = tuple(COUNTERS)
#: Counters a ``StageRates`` shows as ``<name>_per_s``.
PER_SECOND = ("requests", "lookup_tokens", "device_hit_tokens", "host_hit_tokens", "storage_hit_tokens",
              "miss_tokens", "d2h_bytes", "h2d_bytes")

DEFAULT_WINDOW_S = 10.0
MAX_WINDOW_S = 300.0
MIN_SPACING_S = 0.2  # samples closer than this (several clients polling) are not kept


class StageRates(BaseModel):
    """One stage's rates over the window; ``None`` where the window holds no data to divide."""

    stage: int
    time: float = Field(description="unix time of the newest sample")
    window_s: float = Field(description="seconds between the first and last sample used")
    requests_per_s: float | None = None
    lookup_tokens_per_s: float | None = None
    device_hit_tokens_per_s: float | None = None
    host_hit_tokens_per_s: float | None = None
    storage_hit_tokens_per_s: float | None = Field(None, description="tokens/s found in L3")
    miss_tokens_per_s: float | None = None
    host_hit_rate: float | None = Field(None, description="host-hit / looked-up tokens in the window")
    hit_rate: float | None = Field(None, description="(device + host + L3 hits) / looked-up tokens")
    d2h_bytes_per_s: float | None = None
    h2d_bytes_per_s: float | None = None
    d2h_copy_bandwidth: float | None = Field(None, description="bytes / seconds spent copying")
    h2d_copy_bandwidth: float | None = None
    bubble_fraction: float | None = Field(None, description="bubble / (busy + bubble) seconds")
    # transfers: mean time of one transfer in the window, queue wait vs DMA
    d2h_queue_wait_s: float | None = Field(None, description="mean seconds from a transfer's call to its "
                                           "copy's start")
    d2h_dma_s: float | None = Field(None, description="mean seconds of a transfer's copy, start to finish")
    h2d_queue_wait_s: float | None = None
    h2d_dma_s: float | None = None
    miss_reasons: dict[str, float] | None = Field(
        None, description="tokens/s that missed the device tier, by miss reason (found on host: "
        "evicted_from_device)")


def increase(values: Sequence[float]) -> float:
    """Total increase of a counter over consecutive samples; a drop is a reset to zero."""
    total = 0.0
    for prev, cur in pairwise(values):
        total += cur - prev if cur >= prev else cur
    return total


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def rates_of(stage: int, times: Sequence[float], rows: Sequence[Sequence[float]]) -> StageRates:
    """Rates from samples ``rows[i]`` (one value per ``NAMES``) taken at ``times[i]``."""
    if len(times) < 2 or times[-1] <= times[0]:
        return StageRates(stage=stage, time=times[-1] if times else 0.0, window_s=0.0)
    span = times[-1] - times[0]
    inc = {name: increase([r[i] for r in rows]) for i, name in enumerate(NAMES)}
    per_s = {name: v / span for name, v in inc.items()}
    return StageRates(
        stage=stage, time=times[-1], window_s=span,
        **{f"{name}_per_s": per_s[name] for name in PER_SECOND},
        host_hit_rate=_ratio(inc["host_hit_tokens"], inc["lookup_tokens"]),
        hit_rate=_ratio(inc["host_hit_tokens"] + inc["device_hit_tokens"] + inc["storage_hit_tokens"],
                        inc["lookup_tokens"]),
        d2h_copy_bandwidth=_ratio(inc["d2h_bytes"], inc["d2h_seconds"]),
        h2d_copy_bandwidth=_ratio(inc["h2d_bytes"], inc["h2d_seconds"]),
        bubble_fraction=_ratio(inc["bubble_seconds"], inc["busy_seconds"] + inc["bubble_seconds"]),
        **{f"{d}_{part}": _ratio(inc[f"{d}_{counter}"], inc[f"{d}_transfers"])
           for d in ("d2h", "h2d") for part, counter in (("queue_wait_s", "queue_seconds"), ("dma_s", "seconds"))},
        miss_reasons={r: per_s[f"miss_{r}"] for r in MISS_REASONS},
    )


class History:
    """Counter samples per stage for the last ``MAX_WINDOW_S`` seconds (thread-safe, bounded)."""

    def __init__(self, max_window_s: float = MAX_WINDOW_S, min_spacing_s: float = MIN_SPACING_S):
        self.max_window_s = max_window_s
        self.min_spacing_s = min_spacing_s
        self._lock = threading.Lock()
        self._samples: dict[int, deque[tuple[float, tuple[float, ...]]]] = {}

    def observe(self, stages: Iterable[StageLive], now: float) -> None:
        """Record every stage's counters as read at ``now`` (the scrape time)."""
        with self._lock:
            for s in stages:
                q = self._samples.setdefault(s.stage, deque())
                if q and now - q[-1][0] < self.min_spacing_s:
                    continue
                q.append((now, tuple(float(f(s)) for f in COUNTERS.values())))
                while len(q) > 2 and now - q[0][0] > self.max_window_s:
                    q.popleft()

    def _window(self, stage: int, window_s: float, end: float | None = None
                ) -> tuple[list[float], list[tuple[float, ...]]]:
        q = list(self._samples.get(stage, ()))
        times = [t for t, _ in q]
        hi = len(q) if end is None else bisect.bisect_right(times, end)
        t_end = times[hi - 1] if hi else 0.0
        lo = bisect.bisect_left(times, t_end - window_s, 0, hi)
        return times[lo:hi], [row for _, row in q[lo:hi]]

    def rates(self, window_s: float = DEFAULT_WINDOW_S) -> list[StageRates]:
        """Every stage's rates over the last ``window_s`` seconds of samples."""
        with self._lock:
            return [rates_of(k, *self._window(k, window_s)) for k in sorted(self._samples)]

    def series(self, window_s: float = DEFAULT_WINDOW_S, max_points: int = 300) -> dict[int, list[StageRates]]:
        """Rates at every kept sample time (the charts' history on page load), newest last."""
        with self._lock:
            out: dict[int, list[StageRates]] = {}
            for k, q in sorted(self._samples.items()):
                ends = [t for t, _ in q][-max_points:]
                out[k] = [rates_of(k, *self._window(k, window_s, end)) for end in ends[1:]]
            return out
