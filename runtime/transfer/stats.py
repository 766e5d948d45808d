"""Thread-safe counters of device<->host page transfers, read by the exporters; the one GB/s function.

The controller records one ``TransferRecord`` per finished transfer; a stage's live numbers
take ``live()`` -- the typed ``TransferLive`` every reader (the exporter, the dashboard, the JSON
files) gets as it is -- and never touch the lock themselves.  Durations go into fixed buckets (cumulative, Prometheus-style) so a
histogram can be exported without keeping every sample.  Recording is a lock, a
few adds and a bisect, cheap next to any transfer.

``gbps`` is the only place bytes and seconds become a bandwidth: the controller,
the benchmarks and the exporters all import it, so every figure means the same.

Queue wait and DMA time per pool kind (the split): each transfer also reports
its queue wait (from the call until the copy starts) and the pool kinds it moved
with their bytes per page.  Per (direction, kind) the stats keep bytes, moves
(transfers that carried the kind) and two histograms on ``SPLIT_BUCKETS``:

* queue wait -- every kind a transfer moved observes the transfer's whole wait
  (the kinds wait together, so that *is* each kind's wait);
* DMA time -- the transfer's measured copy time split over its kinds in
  proportion to their bytes.  One launch moves every kind of a stage move, so a
  kind's own share cannot be timed apart; split by bytes, the shares sum to the
  measured time exactly and ``bytes / dma seconds`` is the launch's bandwidth
  for every kind and every sum of kinds.  A transfer that moves one kind
  (``pools=[kind]``) gives that kind its own measured time.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import asdict, dataclass
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


@dataclass(frozen=True)
class TransferRecord:
    """One finished transfer."""

    direction: str
    nbytes: int
    seconds: float
    pages: int
    layers: int
    path: str  # "cpu", "triton", "torch" (see controller)
    ended_at: float  # time.time() when recorded
    queue_seconds: float = 0.0  # from the call until the copy started

    @property
    def gbps(self) -> float:
        return gbps(self.nbytes, self.seconds)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gbps"] = round(self.gbps, 3)
        return d


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
        self.started_at = time.time()

    def record(self, direction: str, nbytes: int, seconds: float, pages: int,
               layers: int = 0, path: str = "", queue_seconds: float = 0.0,
               kinds: tuple[tuple[str, int], ...] = ()) -> TransferRecord:
        """One finished transfer; ``kinds`` = ``(pool kind, bytes per page)`` it moved (the split).

        Without ``kinds`` only the direction totals move (callers that know no kinds).
        """
        if direction not in self._dirs:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        rec = TransferRecord(direction, int(nbytes), float(seconds), int(pages), int(layers), path,
                             time.time(), float(queue_seconds))
        bucket = bisect.bisect_left(DURATION_BUCKETS, rec.seconds)
        with self._lock:
            d = self._dirs[direction]
            d.bytes += rec.nbytes
            d.seconds += rec.seconds
            d.count += 1
            d.pages += rec.pages
            d.buckets[bucket] += 1
            d.queue_seconds += rec.queue_seconds
            if kinds:
                kid = id(kinds)  # held in kind_sets until folded, so no other tuple can take the id
                if kid not in d.kind_sets:
                    d.kind_sets[kid] = kinds
                q, sec, pages, ids = d.pending
                q.append(rec.queue_seconds)
                sec.append(rec.seconds)
                pages.append(rec.pages)
                ids.append(kid)
                if len(ids) >= FOLD_EVERY:
                    _fold(d)
        return rec

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

