"""What any cache could reach on a trace: the infinite-cache ceiling and the offline Belady bound.

Both work on ``PageView`` s (``pages.py``), so they use exactly the cache's hit and keep rules
and page keys, whichever format the trace came in.  ``CeilingTracker`` is incremental, so
whoever drives a cache can show the ceiling so far next to the hit rate; Belady's MIN breaks
ties deeper page first, so it keeps prefixes whole (docs/hicache.md, "Bounds").
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence

from ..cache.pages import PageView


class CeilingTracker:
    """Hit tokens of an infinite cache, one request at a time (sequential order)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.requests = 0
        self.input_tokens = 0
        self.hit_tokens = 0

    def observe(self, view: PageView) -> int:
        """Account one request; returns its hit tokens."""
        keys = view.keys.tolist()
        seen = self.seen
        hit = 0
        limit = min(view.max_hit, len(keys))
        while hit < limit and keys[hit] in seen:
            hit += 1
        seen.update(keys[:view.cacheable])
        tokens = view.hit_tokens(hit)
        self.requests += 1
        self.input_tokens += view.input_len
        self.hit_tokens += tokens
        return tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


def _next_uses(views: Sequence[PageView]) -> list[list[int]]:
    """For each request and each page it keeps: the index of the next request that looks it up."""
    never = len(views)
    upcoming: dict[int, int] = {}
    out: list[list[int]] = [[]] * len(views)
    for i in range(len(views) - 1, -1, -1):
        v = views[i]
        keys = v.keys.tolist()
        out[i] = [upcoming.get(k, never) for k in keys[:v.cacheable]]
        for k in keys[:v.max_hit]:
            upcoming[k] = i
    return out


def belady_hit_tokens(views: Sequence[PageView], capacity: int) -> int:
    """Prompt tokens hit by Belady's MIN at ``capacity`` pages (see module docstring)."""
    if capacity <= 0:
        return 0
    return _belady(views, _next_uses(views), capacity)


def belady_curve(views: Sequence[PageView], capacities: Iterable[int],
                 progress: Callable[[str, int, int], None] | None = None) -> dict[int, int]:
    """Belady's hit tokens at each of ``capacities`` (the next uses are found once).

    A capacity that holds every page still to be looked up, at every moment, never evicts
    one MIN would need: it hits the ceiling, and is not simulated.
    """
    sizes = sorted({int(c) for c in capacities})
    nxt = _next_uses(views) if any(c > 0 for c in sizes) else []
    enough = _most_awaited(nxt, len(views)) if nxt else 0
    ceiling: int | None = None
    out: dict[int, int] = {}
    for i, c in enumerate(sizes):
        if c <= 0:
            out[c] = 0
        elif c >= enough:
            if ceiling is None:
                tracker = CeilingTracker()
                ceiling = sum(tracker.observe(v) for v in views)
            out[c] = ceiling
        else:
            out[c] = _belady(views, nxt, c)
        if progress is not None:
            progress("Belady", i + 1, len(sizes))
    return out


def _most_awaited(nxt: list[list[int]], never: int) -> int:
    """The most pages kept at once that a later lookup still uses (an upper bound: a page kept
    twice before its next lookup counts twice)."""
    steps = [0] * (never + 1)
    for i, uses in enumerate(nxt):
        for n in uses:
            if n < never:
                steps[i] += 1
                steps[n] -= 1
    most = live = 0
    for d in steps:
        live += d
        most = max(most, live)
    return most


def _belady(views: Sequence[PageView], nxt: list[list[int]], capacity: int) -> int:
    cached: dict[int, tuple[int, int]] = {}  # key -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key); stale entries skipped
    total = 0
    for i, v in enumerate(views):
        keys = v.keys.tolist()
        hit = 0
        limit = min(v.max_hit, len(keys))
        while hit < limit and keys[hit] in cached:
            hit += 1
        total += v.hit_tokens(hit)
        for depth, (k, when) in enumerate(zip(keys[:v.cacheable], nxt[i], strict=True)):
            cached[k] = (when, depth)
            heapq.heappush(heap, (-when, -depth, k))
        while len(cached) > capacity:
            when, depth, k = heapq.heappop(heap)
            if cached.get(k) == (-when, -depth):
                del cached[k]
        if len(heap) > 4 * capacity + 4096:
            heap = [(-w, -d, k) for k, (w, d) in cached.items()]
            heapq.heapify(heap)
    return total


def input_tokens(views: Iterable[PageView]) -> int:
    return sum(v.input_len for v in views)
