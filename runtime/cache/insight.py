"""Why a lookup missed, and how long cache entries live: one stage's cache insight.

Outcome counters say *what* happened; this says *why*, per tier: every token a tier misses gets
exactly one reason (``MISS_REASONS``, tabled in docs/hicache.md), so per tier the reasons sum to
that tier's misses.  Keys are prefix-closed, so a lookup's missed pages are a run of evicted
pages followed by never-seen ones, and the key table's tombstones (``keytable.py``) name the
first one's reason from the lookup's own failed probe.  Lifetimes, idle times and reuse gaps
are sampled (every ``sample_every``-th request, by tree node), logged on the hot path and folded
into histograms with numpy (``lifetimes.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from ..typed import Strict
from .keytable import GHOST
from .lifetimes import CLOCKS, INSIGHT_TIERS, InsightClock, Lifetimes


class SampledHistogram(Strict):
    """A sampled histogram: ``le`` upper bounds, cumulative ``counts`` (the last is +Inf), ``sum``."""

    le: list[float] = Field(default_factory=list)
    counts: list[int] = Field(default_factory=list)
    sum: float = 0.0


class TierLifetimes(Strict):
    """One tier's sampled histograms (``CacheInsightLive.clock`` units)."""

    lifetime: SampledHistogram = Field(default_factory=SampledHistogram,
                                       description="insert to eviction")
    idle: SampledHistogram = Field(default_factory=SampledHistogram,
                                   description="last use to eviction")
    reuse_gap: SampledHistogram = Field(default_factory=SampledHistogram,
                                        description="previous use to a hit in this tier")


class CacheInsightLive(Strict):
    """Why the stage's lookups missed, and how long its entries live (``cache/insight.py``)."""

    clock: str = Field("seconds", description="unit of the histograms: seconds or requests")
    sample_every: int = Field(1, description="lifetimes: every n-th lookup's entries are watched")
    miss_tokens: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="tier -> miss reason -> tokens; per tier the reasons "
        "sum to the tier's misses (device: not on device; host: found nowhere)")
    device: TierLifetimes = Field(default_factory=TierLifetimes)
    host: TierLifetimes = Field(default_factory=TierLifetimes)
    seen_keys: int = Field(0, description="keys of evicted pages remembered (miss reasons)")
    seen_bytes: int = Field(0, description="bytes those remembered keys take")
    skewed_pages: int = Field(0, description="pages lost on purpose (--fault radix-skew)")

MISS_REASONS = ("never_seen", "evicted_from_device", "evicted_from_host", "dropped",
                "writeback_pending", "partial_page_tail", "stage_disagreement")
NEVER, FROM_DEVICE, FROM_HOST, DROPPED, WRITEBACK, TAIL, DISAGREE = range(len(MISS_REASONS))
#: Entries watched at once per tier (a birth is not sampled while the tier's watch is full).
MAX_WATCHED = 4096


@dataclass(frozen=True)
class InsightConfig:
    """How a ``HiCache`` keeps its insight (``None`` instead of a config: no insight at all)."""

    clock: str = "requests"
    sample_every: int = 1  # 1: every lookup and every transfer call is sampled
    seen_keys: int = 1 << 18  # tombstones of evicted keys kept (the newest) by the key table
    defer: bool = False  # lookups return their miss record; the caller accounts it (serve)

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise ValueError(f"insight clock {self.clock!r}: accepted: {', '.join(CLOCKS)}")
        if self.sample_every < 1 or self.seen_keys < 1:
            raise ValueError("insight sample_every and seen_keys must be >= 1")


#: What a ``HiCache`` keeps unless told otherwise: every lookup sampled, clock in lookups.
DEFAULT_INSIGHT = InsightConfig()


class MissRecord:
    """One lookup's misses, kept until the stages' agreed prefix is known (``defer``)."""

    __slots__ = ("input_len", "page_size", "matched", "limit", "runs")

    def __init__(self, input_len: int, page_size: int, matched: int, limit: int,
                 runs: list[tuple[int, int]]):
        self.input_len, self.page_size = input_len, page_size
        self.matched, self.limit, self.runs = matched, limit, runs  # runs: (end page, reason)

    def tokens(self, pages: int) -> int:
        return min(pages * self.page_size, self.input_len)

    def reasons(self, agreed: int | None = None) -> Iterable[tuple[int, int]]:
        """``(reason, tokens)`` of the host-tier misses; pages below ``agreed`` that this
        stage missed are ``stage_disagreement``."""
        tok = self.tokens
        yield TAIL, self.input_len - tok(self.limit)
        start = self.matched
        if agreed is not None and agreed > start:
            cut = min(agreed, self.limit)
            yield DISAGREE, tok(cut) - tok(start)
            start = cut
        for end, reason in self.runs:
            if end > start:
                yield reason, tok(end) - tok(start)
                start = end


class CacheInsight:
    """One stage's miss-reason counters, seen keys and sampled lifetimes (``HiCache.insight``).

    ``HiCache`` calls it from its own paths; everything here is per lookup or per
    sampled entry -- never a pass over pages, and never a call per evicted page
    (an evicted page costs ``HiCache`` one dict membership test).
    """

    def __init__(self, cfg: InsightConfig | None = None, stats: Any = None, table: Any = None):
        cfg = cfg or InsightConfig()
        self.cfg = cfg
        self.stats = stats  # the cache's CacheStats: hits and misses per lookup
        self.table = table  # the tree's KeyTable (tombstones of evicted keys)
        #: host tier, tokens found nowhere by reason: counted explicitly for evicted pages (and,
        #: deferred, for everything); otherwise never_seen and the tail are what remains
        self.counts = [0] * len(MISS_REASONS)
        self.hittable = 0  # immediate lookups: prompt tokens a lookup may match, summed
        self.clock = InsightClock(cfg.clock)
        self._mark = self.clock.mark
        self.lifetimes = Lifetimes(self.clock)
        #: per tier, watched node -> its birth; ``HiCache`` tests membership where an entry leaves
        self.watch: tuple[dict[int, float], dict[int, float]] = ({}, {})
        self.every = cfg.sample_every
        self.defer = cfg.defer
        self.lookups = 0
        self.sampled = True  # is the next lookup sampled (reuse gaps, births of what it caches)

    # -- per lookup --------------------------------------------------------------------------------
    def lookup(self, keys: list[int], match: Any, limit: int, top: int, input_len: int, tick: int,
               before: list[int] | None) -> MissRecord | None:
        """Account one lookup: ``match`` (``radix.Match``) found some of its ``limit``
        matchable pages; ``top``: the prompt tokens those ``limit`` pages cover; ``tick``: the
        tree's clock at the match; ``before``: the matched path's old stamps when this lookup
        was sampled.  Deferred: returns its ``MissRecord``.

        Immediate accounting only classifies missed pages that were cached before (rare):
        ``never_seen`` and ``partial_page_tail`` follow from the cache's own hit and miss
        counters (``miss_tokens``), so a lookup costs a few operations.
        """
        self._mark(tick)
        n = self.lookups = self.lookups + 1
        self.sampled = not n % self.every
        if not n & 255:
            self.lifetimes.trim_clock()
        if before is not None:
            self.lifetimes.reuse(before, match.device)
        if self.defer:
            matched = len(match.path)
            runs = _runs(keys, matched, limit, match.miss, self.table) if matched < limit else []
            return MissRecord(input_len, self.stats.page_size, matched, limit, runs)
        self.hittable += top
        if match.miss <= GHOST:  # its first missed page was cached before
            self._count_evicted(keys, len(match.path), limit, match.miss, top)
        return None

    def _count_evicted(self, keys: list[int], matched: int, limit: int, miss: int, top: int) -> None:
        """Immediate accounting: the tokens of the missed pages that were cached before."""
        ps, counts = self.stats.page_size, self.counts
        start = matched * ps
        for end, reason in self.table.buried_runs(keys, matched, limit, miss)[0]:
            stop = min(end * ps, top)
            counts[reason] += stop - start
            start = stop

    def account(self, record: MissRecord, agreed: int | None = None) -> None:
        """Count a deferred lookup, now that the stages' agreed prefix (pages) is known."""
        counts = self.counts
        for reason, tokens in record.reasons(agreed):
            counts[reason] += tokens

    # -- births and deaths (sampled entries) -------------------------------------------------------
    def born(self, tier: int, nodes: Iterable[int]) -> None:
        """The entries ``nodes`` entered ``tier`` on a sampled path: watch them."""
        watch, now = self.watch[tier], self.clock.now()
        for node in nodes:
            if len(watch) >= MAX_WATCHED:
                return
            watch[node] = now

    def died(self, tier: int, node: int, stamp: Any) -> None:
        """Watched ``node`` left ``tier`` (``HiCache`` checks ``node in watch[tier]`` first)."""
        _death(self, tier, node, stamp)

    def left_device(self, node: int, written_back: bool, stamp: Any) -> None:
        """Watched ``node`` left the device; a write-back copy made for it is a host birth."""
        now = _death(self, 0, node, stamp)
        if written_back and len(self.watch[1]) < MAX_WATCHED:
            self.watch[1][node] = now

    # -- reports -------------------------------------------------------------------------------------
    def miss_tokens(self) -> dict[str, dict[str, int]]:
        """Per tier, reason -> tokens (device: not on device; host: found nowhere)."""
        counts, s = list(self.counts), self.stats
        if not self.defer:  # what immediate lookups did not classify explicitly
            within = self.hittable - s.device_hit_tokens - s.host_hit_tokens - s.storage_hit_tokens
            counts[NEVER] = within - counts[FROM_HOST] - counts[DROPPED] - counts[WRITEBACK]
            counts[TAIL] = s.miss_tokens - within
        host = dict(zip(MISS_REASONS, counts, strict=True))
        # a page found in L3 left a device too (only device pages are ever written out)
        return {"device": dict(host, evicted_from_device=s.host_hit_tokens + s.storage_hit_tokens),
                "host": host}

    def histograms(self) -> dict[str, dict[str, dict[str, Any]]]:
        return self.lifetimes.snapshot()

    def seen(self) -> dict[str, int]:
        """The evicted keys remembered: tombstones in the key table, and what they cost there
        (12 bytes per table node; the table is kept 35-70 % full of live keys and tombstones)."""
        t = self.table
        used = t.size + t.ghosts
        return {"seen_keys": t.ghosts, "seen_keys_capacity": self.cfg.seen_keys,
                "seen_bytes": round(t.nbytes() * t.ghosts / used) if used else 0,
                "forgotten_keys": t.forgotten}

    def live(self, skewed_pages: int = 0) -> CacheInsightLive:
        """The insight as the stage's live numbers show it (``StageLive.insight``)."""
        seen = self.seen()
        tiers = {tier: TierLifetimes(**{name: SampledHistogram(**h) for name, h in hists.items()})
                 for tier, hists in self.histograms().items()}
        return CacheInsightLive(clock=self.cfg.clock, sample_every=self.every,
                                miss_tokens=self.miss_tokens(), seen_keys=seen["seen_keys"],
                                seen_bytes=seen["seen_bytes"], skewed_pages=skewed_pages, **tiers)

    def to_dict(self) -> dict[str, Any]:
        """Everything, for the bench JSON."""
        return {"clock": self.cfg.clock, "sample_every": self.every, "lookups": self.lookups,
                "miss_tokens": self.miss_tokens(), "histograms": self.histograms(),
                **self.seen(),
                "watched": {t: len(w) for t, w in zip(INSIGHT_TIERS, self.watch, strict=True)}}


def _death(ins: CacheInsight, tier: int, node: int, stamp: Any) -> float:
    """Observe the lifetime and idle time of watched ``node`` leaving ``tier``; returns now.

    A function, not a method: ``left_device`` calls it, and a subclass that times the entry
    points (the bench's) must not count a death twice."""
    now = ins.clock.now()
    ins.lifetimes.death(tier, now, ins.watch[tier].pop(node), stamp[node])
    return now


def _runs(keys: list[int], start: int, limit: int, first: int, table: Any) -> list[tuple[int, int]]:
    """Reasons of missed pages ``start..limit``: runs of evicted pages (one reason each, from
    their tombstones), then the never-seen rest (keys are prefix-closed: nothing after a
    never-seen page was cached).  ``first``: the key table's answer for ``keys[start]``."""
    if first > GHOST:
        return [(limit, NEVER)]
    runs, j = table.buried_runs(keys, start, limit, first)
    if j < limit:
        runs.append((limit, NEVER))
    return runs
