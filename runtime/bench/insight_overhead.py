"""What the cache insight (miss reasons, sampled lifetimes) costs a HiCache replay.

Two measurements, both in every ``stagecache bench hicache`` run (docs/hicache.md describes them
and their fields):

* **its own calls, in the reported replay**: a ``TimedInsight`` times each of its calls on
  ``perf_counter``; timing a call costs about twice what a lookup does, so the timer's own share
  (a timed no-op, ``timer_floor``) is taken off each call;
* **the whole cost, paired** (``measure``): the insight touches metadata only, so metadata-only
  replays of the same trace with and without it, in pairs of alternating order on the thread's
  CPU clock, differ by what it costs -- a cross-check, noisier on a shared machine.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from ..cache.insight import CacheInsight

#: Lifetimes in a replay: the entries of every 64th lookup are watched (miss reasons are exact).
DEFAULT_INSIGHT_SAMPLE = 64
#: Pairs of metadata-only replays (with, without) of the overhead measurement.
DEFAULT_OVERHEAD_REPEATS = 31
#: Wall seconds the paired check may take (it stops adding pairs after that, three at least).
PAIRED_BUDGET_S = 5.0
#: What the insight may cost the default bench's replay.
OVERHEAD_BUDGET_PERCENT = 1.0


def insight_config(args: Any, on: bool | None = None) -> Any:
    """The replay's insight: lookups as the clock (trace time), or None (``--no-insight``)."""
    from ..cache.insight import InsightConfig

    if not (on if on is not None else not getattr(args, "no_insight", False)):
        return None
    return InsightConfig(clock="requests",
                         sample_every=getattr(args, "insight_sample", DEFAULT_INSIGHT_SAMPLE),
                         seen_keys=getattr(args, "seen_keys", 1 << 18))


#: The insight's entry points ``HiCache`` calls.
TIMED_CALLS = ("lookup", "account", "born", "died", "left_device")


def _timed(base: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = base(self, *args)
        self.own_seconds += time.perf_counter() - t0
        self.timed_calls += 1
        return out
    call.__name__ = base.__name__
    return call


class TimedInsight(CacheInsight):
    """``CacheInsight`` that times its own calls (``own_seconds``, ``timed_calls``)."""

    own_seconds = 0.0
    timed_calls = 0

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "own_seconds": round(self.own_seconds, 6),
                "timed_calls": self.timed_calls}


for _name in TIMED_CALLS:
    setattr(TimedInsight, _name, _timed(getattr(CacheInsight, _name)))


class _Probe:
    """An entry point that does nothing, timed as ``TimedInsight`` times the insight's."""

    own_seconds = 0.0
    timed_calls = 0

    def lookup(self, *args: Any) -> None:
        return None


_Probe.lookup = _timed(_Probe.lookup)  # type: ignore[method-assign]


def timer_floor(calls: int = 4000, batches: int = 7) -> float:
    """Seconds the timing adds to one timed call by itself: what a timed no-op measures
    (``perf_counter`` twice, the wrapper's call into the entry point), median of ``batches``.

    Without it a lookup that costs 0.3 us reads as 1 us: on a replay of 10,000 lookups the
    timer alone would be most of the reported overhead."""
    per: list[float] = []
    args = (0,) * 7  # as many arguments as ``lookup`` takes
    for _ in range(batches):
        probe = _Probe()
        for _ in range(calls):
            probe.lookup(*args)
        per.append(probe.own_seconds / calls)
    return statistics.median(per)


def timed(cache: Any) -> Any:
    """``cache`` with its insight (if any) replaced by a fresh ``TimedInsight``, before a replay."""
    ins = cache.insight
    if ins is not None:
        cache.insight = TimedInsight(ins.cfg, ins.stats, ins.table)
    return cache


def direct(row: dict[str, Any], floor_s: float) -> dict[str, Any]:
    """The insight's own time in a reported replay (``row``: its ``_stats_row``): the timed
    calls' sum less what the timing itself adds to each (``floor_s``, ``timer_floor``)."""
    timed_s, calls, replay = (row["insight"]["own_seconds"], row["insight"]["timed_calls"],
                              row["replay"]["seconds"])
    own = max(0.0, timed_s - calls * floor_s)
    without = replay - own
    return {"insight_seconds": round(own, 6), "timed_seconds": timed_s, "calls": calls,
            "timer_floor_us": round(floor_s * 1e6, 4), "replay_seconds": replay,
            "ratio_on_vs_off": round(replay / without, 5) if without > 0 else None,
            "overhead_percent": round(100 * own / without, 3) if without > 0 else None}


def measure(run: Callable[[bool], float], repeats: int, replay_seconds: float,
            budget_s: float = PAIRED_BUDGET_S) -> dict[str, Any]:
    """``run(on)``: one metadata-only replay's CPU seconds; ``replay_seconds``: the reported
    run's replay (with the insight), which the overhead is a share of.

    At most ``repeats`` pairs, and no new pair once ``budget_s`` wall seconds are spent (after
    the first three): a whole public trace takes seconds per replay, and the check must not
    turn a 10-second bench into minutes.  ``repeats`` in the result is the pairs run.
    """
    on_s: list[float] = []
    off_s: list[float] = []
    t0 = time.perf_counter()
    for i in range(repeats):
        if i >= 3 and time.perf_counter() - t0 > budget_s:
            break
        order = ((False, off_s), (True, on_s))
        for on, out in order if i % 2 else order[::-1]:  # ABBA: neither always runs second
            gc.collect()
            out.append(run(on))
    diffs = [a - b for a, b in zip(on_s, off_s, strict=True)]
    cost = statistics.median(diffs)
    spread = statistics.median(abs(d - cost) for d in diffs)
    without = replay_seconds - cost
    return {
        "method": "median of paired metadata-only replays (with - without insight), thread CPU "
                  "seconds, as a share of the reported replay without that cost",
        "repeats": len(on_s),
        "metadata_on_seconds": round(statistics.median(on_s), 4),
        "metadata_off_seconds": round(statistics.median(off_s), 4),
        "insight_seconds": round(cost, 6),
        "replay_seconds": round(replay_seconds, 6),
        "ratio_on_vs_off": round(replay_seconds / without, 4) if without > 0 else None,
        "overhead_percent": round(100 * cost / without, 3) if without > 0 else None,
        # how far a pair's difference typically lies from the median (median absolute deviation):
        # above the budget, the pairs cannot tell the insight from the machine's noise
        "spread_percent": round(100 * spread / without, 3) if without > 0 else None,
        "conclusive": without > 0 and 100 * spread / without < OVERHEAD_BUDGET_PERCENT,
    }
