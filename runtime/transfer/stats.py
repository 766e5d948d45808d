"""Thread-safe counters of device<->host page transfers, read by the exporters; the one GB/s function.

The controller records one ``TransferRecord`` per finished transfer; exporters
(Prometheus, OTLP, the dashboard) call ``snapshot()`` and never touch the lock
themselves.  Durations go into fixed buckets (cumulative, Prometheus-style) so a
histogram can be exported without keeping every sample.  Recording is a lock, a
few adds and a bisect, cheap next to any transfer.

``gbps`` is the only place bytes and seconds become a bandwidth: the controller,
the benchmarks and the exporters all import it, so every figure means the same.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

DIRECTIONS = ("d2h", "h2d")

#: Upper bounds (seconds) of the duration histogram buckets; +Inf is implicit.
DURATION_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)


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

    @property
    def gbps(self) -> float:
        return gbps(self.nbytes, self.seconds)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gbps"] = round(self.gbps, 3)
        return d


class _Direction:
    __slots__ = ("bytes", "seconds", "count", "pages", "buckets")

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0
        self.count = 0
        self.pages = 0
        self.buckets = [0] * (len(DURATION_BUCKETS) + 1)  # last = +Inf


class TransferStats:
    """Counters by direction (``d2h`` = backup, ``h2d`` = load)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs = {d: _Direction() for d in DIRECTIONS}
        self.started_at = time.time()

    def record(self, direction: str, nbytes: int, seconds: float, pages: int,
               layers: int = 0, path: str = "") -> TransferRecord:
        if direction not in self._dirs:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        rec = TransferRecord(direction, int(nbytes), float(seconds), int(pages), int(layers), path,
                             time.time())
        slot = bisect.bisect_left(DURATION_BUCKETS, rec.seconds)
        with self._lock:
            d = self._dirs[direction]
            d.bytes += rec.nbytes
            d.seconds += rec.seconds
            d.count += 1
            d.pages += rec.pages
            d.buckets[slot] += 1
        return rec

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict view: per direction totals, mean GB/s, cumulative duration buckets."""
        with self._lock:
            out: dict[str, Any] = {"buckets_s": list(DURATION_BUCKETS), "started_at": self.started_at}
            for name, d in self._dirs.items():
                cumulative, running = [], 0
                for c in d.buckets:
                    running += c
                    cumulative.append(running)
                out[name] = {
                    "bytes": d.bytes,
                    "seconds": d.seconds,
                    "count": d.count,
                    "pages": d.pages,
                    "gbps": gbps(d.bytes, d.seconds),
                    "bucket_counts": cumulative,  # cumulative, last entry = +Inf = count
                }
            return out
