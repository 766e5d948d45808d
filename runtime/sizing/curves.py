"""Hit tokens at every cache capacity from one pass over a trace: LRU stack distances.

Why: the replay (``bench hicache``) answers "what does *this* size hit?"; sizing a deployment
asks it for every size.  LRU has the inclusion property, so a page a lookup asks for hits at
``C`` pages exactly when its *stack distance* is below ``C``: one pass gives every capacity.
The pass works on the cache's own ``PageView`` s and orders a request's uses as the replay
ranks them, so the pages any capacity holds are prefix-closed; all distances are counted at once
over a merge-sort tree (O(N log^2 N) comparisons in O(log N) numpy steps).  docs/advise.md,
"Method", derives it and says which replay the curve equals exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cache.pages import PageView, page_view
from ..errors import ConfigError

log = logging.getLogger(__name__)

#: ``progress(phase, done, total)``: a long pass reports its steps (the CLI draws a bar).
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, eq=False)
class HitCurve:
    """Prompt tokens one cache tier of ``C`` pages hits on a trace, for every ``C`` at once."""

    hit_tokens: np.ndarray  # int64; [C] = hit tokens with C pages; the last entry is the ceiling
    input_tokens: int  # prompt tokens looked up (what a hit rate is a share of)

    @property
    def ceiling_tokens(self) -> int:
        """Hit tokens of an infinite cache (every page ever kept stays)."""
        return int(self.hit_tokens[-1])

    @property
    def full_pages(self) -> int:
        """The smallest capacity that hits the ceiling."""
        return len(self.hit_tokens) - 1

    def at(self, pages: int) -> int:
        """Hit tokens with ``pages`` pages (any capacity >= 0)."""
        return int(self.hit_tokens[min(max(int(pages), 0), self.full_pages)])

    def rate(self, pages: int) -> float:
        """Hit tokens with ``pages`` pages as a share of the prompt tokens."""
        return self.at(pages) / self.input_tokens if self.input_tokens else 0.0

    def pages_for(self, share: float) -> int:
        """The fewest pages that hit at least ``share`` of the ceiling (0 < share <= 1)."""
        want = share * self.ceiling_tokens
        return int(np.searchsorted(self.hit_tokens, want - 1e-9 * max(want, 1.0), side="left"))

    def knee(self) -> int:
        """Where a page stops buying more than an average page: the capacity furthest above the
        chord from (0, 0) to (full_pages, ceiling), both axes scaled to 1 (Kneedle's rule)."""
        if self.ceiling_tokens == 0 or self.full_pages == 0:
            return 0
        x = np.arange(len(self.hit_tokens), dtype=np.float64) / self.full_pages
        y = self.hit_tokens / self.ceiling_tokens
        return int(np.argmax(y - x))


def sample_capacities(top: int, points: int, extra: Sequence[int] = ()) -> np.ndarray:
    """About ``points`` capacities in ``[0, top]``, half spread evenly, half geometrically (a
    curve's shape shows on either axis), with ``extra`` added; sorted and unique (plots, JSON)."""
    half = max(points // 2, 2)
    picks = np.concatenate([np.linspace(0, top, half), np.geomspace(1, max(top, 1), half),
                            np.asarray(extra, dtype=np.float64), [0, top]])
    return np.unique(np.clip(np.rint(picks), 0, top).astype(np.int64))


@dataclass(frozen=True, eq=False)
class TraceCurves:
    """Both tiers' curves of one trace (``docs/advise.md`` says which replay each one equals).

    * ``total`` -- one LRU tier of ``C`` pages that every finished request fills: the host
      tier of a write-through HiCache whose host holds at least its device's pages, i.e. the
      device + host hits at ``C`` host pages;
    * ``device`` -- the device tier of ``C`` pages alone: the same stack, but while a request
      runs it also holds the pages it will not keep (a token request's partial last page), so
      the next lookup finds that many pages fewer.
    """

    page_size: int
    requests: int
    lookup_pages: int  # pages lookups may match, summed
    distinct_pages: int  # pages ever kept
    total: HitCurve
    device: HitCurve
    #: requests that keep again, past their lookable prefix, a page kept before (identical
    #: prompt + answer sent twice): the replay may find such a page still on device and free
    #: the request's copy, holding one page fewer for a while; ``device`` is exact when 0
    repeated_requests: int

    @property
    def input_tokens(self) -> int:
        return self.total.input_tokens


# -- the pass -------------------------------------------------------------------------------------
def _layout(views: Sequence[PageView]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Kept keys of every request, concatenated; per request its offset, kept and lookup pages."""
    keep = np.fromiter((v.cacheable for v in views), dtype=np.int64, count=len(views))
    limit = np.fromiter((min(v.max_hit, v.cacheable) for v in views), dtype=np.int64, count=len(views))
    offsets = np.zeros(len(views) + 1, dtype=np.int64)
    np.cumsum(keep, out=offsets[1:])
    parts = [v.keys[:v.cacheable] for v in views if v.cacheable]
    keys = np.concatenate(parts).view(np.uint64) if parts else np.empty(0, np.uint64)
    return keys, offsets, keep, limit


def _check_chained(ids: np.ndarray, offsets: np.ndarray, keep: np.ndarray,
                   keys: np.ndarray, name: Callable[[int], str]) -> None:
    """Every key follows the same key (or the start) wherever it is used: keys name prefixes.

    The tree refuses such a trace mid-replay (``RadixError``); here it is bad input, named.
    """
    parent = np.empty_like(ids)
    parent[1:] = ids[:-1]
    parent[offsets[:-1][keep > 0]] = -1
    order = np.argsort(ids, kind="stable")
    same = ids[order][1:] == ids[order][:-1]
    bad = np.flatnonzero(same & (parent[order][1:] != parent[order][:-1]))
    if not len(bad):
        return
    pos = int(order[bad[0] + 1])
    first = int(order[bad[0]])
    req = int(np.searchsorted(offsets, pos, side="right") - 1)
    earlier = int(np.searchsorted(offsets, first, side="right") - 1)
    raise ConfigError(
        f"{name(req)}: page {pos - offsets[req]} (key {int(keys[pos])}) follows another page than "
        f"it did in {name(earlier)}; accepted: keys that name a whole prefix (equal key => equal "
        "prefix)")


def _uses(ids: np.ndarray, offsets: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Use time of every kept page (a request's chain deepest first) and each use's previous use
    of the same key (-1: none), indexed by use time."""
    n = len(ids)
    req = np.repeat(np.arange(len(keep)), keep)
    pos = np.arange(n, dtype=np.int64)
    time = 2 * offsets[:-1][req] + keep[req] - 1 - pos  # deepest page first
    key_at = np.empty(n, dtype=np.int64)
    key_at[time] = ids
    order = np.argsort(key_at, kind="stable")  # by key, then by use time
    prev = np.full(n, -1, dtype=np.int64)
    same = key_at[order][1:] == key_at[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    return time, prev


def _count_first_uses(prev: np.ndarray, upto: np.ndarray, bound: np.ndarray,
                      progress: Progress | None = None) -> np.ndarray:
    """For each query ``q``: ``#{e < upto[q] : prev[e] <= bound[q]}`` (merge-sort tree levels)."""
    n = len(prev)
    value = prev + 1  # >= 0
    shift = max(int(n + 2).bit_length(), 1)
    count = np.zeros(len(upto), dtype=np.int64)
    levels = max(int(n).bit_length(), 1)
    # level k: blocks of 2**k uses, each sorted by value; combined key = block << shift | value
    sorted_k = np.sort((np.arange(n, dtype=np.int64) << shift) | value)
    want = bound + 2  # value <= bound + 1  <=>  value < bound + 2
    for k in range(levels):
        if k:  # the next level's blocks are pairs of this level's: merge the sorted runs
            sorted_k = np.sort(((sorted_k >> shift) >> 1 << shift) | (sorted_k & ((1 << shift) - 1)),
                               kind="stable")
        has = np.flatnonzero((upto >> k) & 1)
        if len(has):
            block = (upto[has] >> k) - 1
            count[has] += np.searchsorted(sorted_k, (block << shift) | want[has]) - (block << k)
        if progress is not None:
            progress("stack distances", k + 1, levels)
    return count


@dataclass(frozen=True, eq=False)
class Distances:
    """Per looked-up page of every request (request order, page order): its stack distance
    (-1: never kept before, a miss at any size), its request and its index in the request."""

    dist: np.ndarray
    request: np.ndarray
    page: np.ndarray
    distinct_pages: int
    repeated_requests: int  # see ``TraceCurves.repeated_requests``


def stack_distances(views: Sequence[PageView], progress: Progress | None = None,
                    name: Callable[[int], str] | None = None) -> Distances:
    """The stack distance of every page a lookup may match (docs/advise.md, "Method"), in one pass.

    ``name(i)``: how a message names request ``i`` (default ``request i``).
    """
    keys, offsets, keep, limit = _layout(views)
    _, ids = np.unique(keys, return_inverse=True)
    ids = ids.astype(np.int64).reshape(-1)
    _check_chained(ids, offsets, keep, keys, name or (lambda i: f"request {i}"))
    time, prev = _uses(ids, offsets, keep)
    req = np.repeat(np.arange(len(views)), limit)
    page = np.arange(len(req), dtype=np.int64) - np.repeat(np.cumsum(limit) - limit, limit)
    last = prev[time[offsets[:-1][req] + page]]
    seen = last >= 0
    dist = np.full(len(req), -1, dtype=np.int64)
    start = offsets[:-1][req[seen]]
    dist[seen] = _count_first_uses(prev, start, last[seen], progress) - (last[seen] + 1)
    # pages past the lookable prefix that were kept before: the replay may hold them twice
    index = np.arange(len(ids), dtype=np.int64) - np.repeat(offsets[:-1], keep)
    owner = np.repeat(np.arange(len(views)), keep)
    again = (index >= limit[owner]) & (prev[time] >= 0)
    return Distances(dist, req, page, int(ids.max()) + 1 if len(ids) else 0,
                     len(np.unique(owner[again])))


def _curve(dist: np.ndarray, weight: np.ndarray, input_tokens: int) -> HitCurve:
    """Hit tokens at every capacity: a page of distance ``d`` hits from ``d + 1`` pages on."""
    hit = dist >= 0
    hist = np.bincount(dist[hit], weights=weight[hit].astype(np.float64))
    curve = np.zeros(len(hist) + 1, dtype=np.int64)
    np.cumsum(np.rint(hist).astype(np.int64), out=curve[1:])
    return HitCurve(curve, input_tokens)


def page_views(requests: Iterable[Any], page_size: int, progress: Progress | None = None,
               total: int = 0) -> list[PageView]:
    """``page_view`` of every request (hashing a token request's pages is the slow part of a
    long token trace, so it reports progress every 1024 requests)."""
    out = []
    for i, r in enumerate(requests):
        out.append(page_view(r, page_size))
        if progress is not None and (i + 1) % 1024 == 0:
            progress("page keys", i + 1, total)
    if progress is not None:
        progress("page keys", len(out), len(out))
    return out


def _check_reusable(views: Sequence[PageView]) -> None:
    """A trace whose prompts all fit in one page can never reuse one: nothing to size."""
    if not views:
        raise ConfigError("the trace has no requests: nothing to size a cache by")
    longest = max(v.input_len for v in views)
    page = views[0].page_size
    if longest < page or not any(min(v.max_hit, v.cacheable) for v in views):
        raise ConfigError(
            f"the trace is shorter than one page: no prompt spans more than one page of {page} "
            f"tokens (the longest has {longest}), so no page is ever reused; use a smaller page "
            "(--page-size; for a Mooncake trace, --block-tokens)")


def trace_curves(views: Sequence[PageView], progress: Progress | None = None,
                 name: Callable[[int], str] | None = None) -> TraceCurves:
    """Both tiers' hit-token curves of ``views`` at every capacity, from one pass."""
    _check_reusable(views)
    page_size = views[0].page_size
    d = stack_distances(views, progress, name)
    inputs = np.fromiter((v.input_len for v in views), dtype=np.int64, count=len(views))
    lo = np.minimum(d.page * page_size, inputs[d.request])
    weight = np.minimum((d.page + 1) * page_size, inputs[d.request]) - lo  # hit_tokens(i+1) - (i)
    unkept = np.fromiter((v.pages - v.cacheable for v in views), dtype=np.int64, count=len(views))
    held = np.concatenate([[0], unkept[:-1]])[d.request]  # what the previous request held unkept
    device = np.where(d.dist >= 0, d.dist + held, -1)
    total_input = int(inputs.sum())
    log.debug("curves: %d requests, %d lookups, %d distinct pages", len(views), len(d.dist),
              d.distinct_pages)
    return TraceCurves(page_size, len(views), len(d.dist), d.distinct_pages,
                       _curve(d.dist, weight, total_input), _curve(device, weight, total_input),
                       d.repeated_requests)
