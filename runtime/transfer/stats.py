"""Thread-safe counters of device<->host page transfers, read by the exporters; the one GB/s function.

A stage's live numbers take ``live()`` (the typed ``TransferLive`` every reader gets as it is)
and never touch the lock.  Durations go into fixed cumulative buckets, so a histogram is
exported without keeping every sample.  ``gbps`` is the only place bytes and seconds become a
bandwidth, so every figure means the same.  The per-kind queue/DMA split (docs/metrics.md,
"Transfers: queue wait vs DMA time") splits each transfer's DMA time over its kinds by bytes:
one launch moves every kind, so a kind's own share cannot be timed apart; split by bytes, the
shares sum to the measured time and ``bytes / dma seconds`` is the launch's bandwidth.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

import numpy as np
from pydantic import Field

from ..typed import Strict

#: Transfer directions: ``d2h`` backs pages up to host, ``h2d`` loads them back.
DIRECTIONS = ("d2h", "h2d")

#: Upper bounds (seconds) of the duration histogram buckets; +Inf is implicit.
DURATION_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
#: Upper bounds (seconds) of the per-kind queue-wait and DMA histograms: from 10 us (a queue
#: wait with nothing ahead is the call's own host work, a few us) to 2.5 s; +Inf is implicit.
SPLIT_BUCKETS: tuple[float, ...] = (0.00001, 0.000025, 0.00005, *DURATION_BUCKETS)
#: Pending transfers that trigger a fold into the per-kind split between snapshots.
FOLD_EVERY = 4096


class Directions(Strict):
    """One figure per transfer direction: d2h = backup to host, h2d = load from host."""

    d2h: float = 0.0
    h2d: float = 0.0


class DirectionCounts(Strict):
    d2h: int = 0
    h2d: int = 0


class DurationBuckets(Strict):
    """Cumulative transfer-duration histogram: ``le`` upper bounds (s), counts per direction.

    Each count list has ``len(le) + 1`` entries, the last being +Inf (= the total count).
    """

    le: list[float] = Field(default_factory=list)
    d2h: list[int] = Field(default_factory=list)
    h2d: list[int] = Field(default_factory=list)


class TransferKind(Strict):
    """One (direction, pool kind) of a stage's transfers (the split: see the module docstring).

    ``queue_seconds``: each transfer that moved the kind adds its whole wait (call to copy
    start); ``dma_seconds``: the kind's byte share of each transfer's measured copy time, so
    ``bytes / dma_seconds`` is the bandwidth.  Histograms are cumulative over
    ``TransferSplit.le``, ``len(le) + 1`` entries, the last being +Inf (= ``moves``).
    """

    bytes: int = 0
    moves: int = Field(0, description="transfers that moved this kind")
    queue_seconds: float = 0.0
    dma_seconds: float = 0.0
    queue_buckets: list[int] = Field(default_factory=list)
    dma_buckets: list[int] = Field(default_factory=list)


class TransferSplit(Strict):
    """Queue wait vs DMA time: per-transfer queue seconds by direction, and per pool kind."""

    le: list[float] = Field(default_factory=list, description="histogram upper bounds (s)")
    queue_seconds: Directions = Field(
        default_factory=Directions, description="seconds transfers waited from the call to the "
        "copy's start, each transfer once (DMA seconds: StageLive.transfer_seconds)")
    d2h: dict[str, TransferKind] = Field(default_factory=dict)
    h2d: dict[str, TransferKind] = Field(default_factory=dict)


class TransferLive(Strict):
    """A stage's transfer numbers, as its ``StageLive`` holds them."""

    transfer_bytes: DirectionCounts = Field(default_factory=DirectionCounts)
    transfer_seconds: Directions = Field(default_factory=Directions)
    transfer_count: DirectionCounts = Field(default_factory=DirectionCounts)
    bandwidth_bytes_per_second: Directions = Field(
        default_factory=Directions, description="derived, since start: transfer bytes / seconds "
        "(exporters and charts use rates of the counters)")
    transfer_seconds_buckets: DurationBuckets = Field(default_factory=DurationBuckets)
    transfer_split: TransferSplit = Field(
        default_factory=TransferSplit, description="queue wait vs DMA time, per direction and pool kind "
        "(empty where the source reports no split)")


def gbps(nbytes: float, seconds: float | None) -> float:
    """Bandwidth in GB/s (10^9 bytes per second); 0.0 when no time was measured."""
    return nbytes / seconds / 1e9 if seconds else 0.0


class _Kind:
    """One (direction, pool kind) of the queue/DMA split."""

    __slots__ = ("bytes", "moves", "queue_seconds", "dma_seconds", "queue_buckets", "dma_buckets")

    def __init__(self) -> None:
        self.bytes = 0
        self.moves = 0
        self.queue_seconds = 0.0
        self.dma_seconds = 0.0
        self.queue_buckets = np.zeros(len(SPLIT_BUCKETS) + 1, dtype=np.int64)  # last = +Inf
        self.dma_buckets = np.zeros(len(SPLIT_BUCKETS) + 1, dtype=np.int64)


class _Direction:
    __slots__ = ("bytes", "seconds", "count", "pages", "buckets", "queue_seconds", "kinds", "kind_sets",
                 "pending")

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0
        self.count = 0
        self.pages = 0
        self.buckets = [0] * (len(DURATION_BUCKETS) + 1)  # last = +Inf
        self.queue_seconds = 0.0  # each transfer's wait once (per kind: see _Kind)
        self.kinds: dict[str, _Kind] = {}
        #: id -> the kinds tuple pending transfers moved (a plan's tuple is one object, reused)
        self.kind_sets: dict[int, tuple[tuple[str, int], ...]] = {}
        #: queue s, DMA s, pages and kinds id of transfers not yet folded into ``kinds`` (``_fold``)
        self.pending: tuple[list[float], list[float], list[int], list[int]] = ([], [], [], [])


def _cumulative(counts: Any) -> list[int]:
    return [int(c) for c in np.cumsum(counts)]


def _fold(d: _Direction) -> None:
    """Fold the pending transfers into the per-kind split, a whole batch per kind set at once.

    Four list appends are all a transfer pays for the split; grouping and the bucket
    search run here over arrays (once per ``snapshot`` or ``FOLD_EVERY`` transfers),
    so the per-transfer cost stays flat however many kinds a stage has.
    """
    if not d.pending[0]:
        return
    queue, seconds, pages, ids = (np.asarray(x) for x in d.pending)
    d.pending = ([], [], [], [])
    bounds = np.asarray(SPLIT_BUCKETS)
    size = len(SPLIT_BUCKETS) + 1
    for kid in np.unique(ids).tolist():
        kinds = d.kind_sets[kid]
        sel = ids == kid
        q, sec, n = queue[sel], seconds[sel], int(sel.sum())
        queue_counts = np.bincount(np.searchsorted(bounds, q, side="left"), minlength=size)
        moved_pages, queue_sum = int(pages[sel].sum()), float(q.sum())
        per_page = sum(b for _, b in kinds)
        for kind, b in kinds:
            k = d.kinds.get(kind)
            if k is None:
                k = d.kinds[kind] = _Kind()
            shares = sec * (b / per_page) if per_page else np.zeros_like(sec)
            k.bytes += b * moved_pages
            k.moves += n
            k.queue_seconds += queue_sum
            k.queue_buckets += queue_counts
            k.dma_seconds += float(shares.sum())
            k.dma_buckets += np.bincount(np.searchsorted(bounds, shares, side="left"), minlength=size)
    d.kind_sets.clear()


class TransferStats:
    """Counters by direction (``d2h`` = backup, ``h2d`` = load)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs = {d: _Direction() for d in DIRECTIONS}

    def record(self, direction: str, nbytes: int, seconds: float, pages: int, queue_seconds: float = 0.0,
               kinds: tuple[tuple[str, int], ...] = ()) -> None:
        """One finished transfer; ``kinds`` = ``(pool kind, bytes per page)`` it moved (the split).

        Without ``kinds`` only the direction totals move (callers that know no kinds).
        """
        if direction not in self._dirs:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        seconds, queue_seconds = float(seconds), float(queue_seconds)
        bucket = bisect.bisect_left(DURATION_BUCKETS, seconds)
        with self._lock:
            d = self._dirs[direction]
            d.bytes += int(nbytes)
            d.seconds += seconds
            d.count += 1
            d.pages += int(pages)
            d.buckets[bucket] += 1
            d.queue_seconds += queue_seconds
            if kinds:
                kid = id(kinds)  # held in kind_sets until folded, so no other tuple can take the id
                if kid not in d.kind_sets:
                    d.kind_sets[kid] = kinds
                q, sec, moved, ids = d.pending
                q.append(queue_seconds)
                sec.append(seconds)
                moved.append(int(pages))
                ids.append(kid)
                if len(ids) >= FOLD_EVERY:
                    _fold(d)

    def live(self) -> TransferLive:
        """The totals, mean bandwidth, duration histogram and queue/DMA split, as typed numbers."""
        with self._lock:
            for d in self._dirs.values():
                _fold(d)
            dirs = self._dirs

            def per(fn: Any) -> dict[str, Any]:
                return {name: fn(d) for name, d in dirs.items()}

            return TransferLive(
                transfer_bytes=DirectionCounts(**per(lambda d: d.bytes)),
                transfer_seconds=Directions(**per(lambda d: d.seconds)),
                transfer_count=DirectionCounts(**per(lambda d: d.count)),
                bandwidth_bytes_per_second=Directions(**per(lambda d: gbps(d.bytes, d.seconds) * 1e9)),
                transfer_seconds_buckets=DurationBuckets(
                    le=list(DURATION_BUCKETS), **per(lambda d: _cumulative(d.buckets))),
                transfer_split=TransferSplit(
                    le=list(SPLIT_BUCKETS), queue_seconds=Directions(**per(lambda d: d.queue_seconds)),
                    **per(lambda d: {kind: TransferKind(
                        bytes=k.bytes, moves=k.moves, queue_seconds=k.queue_seconds,
                        dma_seconds=k.dma_seconds, queue_buckets=_cumulative(k.queue_buckets),
                        dma_buckets=_cumulative(k.dma_buckets)) for kind, k in sorted(d.kinds.items())})),
            )

    def pages(self, direction: str) -> int:
        """Pages moved in ``direction`` so far."""
        with self._lock:
            return self._dirs[direction].pages

