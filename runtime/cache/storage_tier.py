"""A stage's L3 tier as ``HiCache`` uses it: page keys <-> host pages through one store.

An L3 page is one object per host-cached pool kind (``storage/keys.py`` names them); a page
counts as stored only when every kind's object is, and as read only when every kind's object was
read whole and checked.  ``HiCache`` calls three things:

* ``exists(keys)`` -- how many leading pages the store holds (a host miss's lookup);
* ``fetch(keys, host_pages)`` -- read them into host pages (zero-copy into the host pools); the
  leading run that arrived whole counts, the rest is a miss;
* ``backup(keys, host_pages)`` -- write host pages out (when the host tier got its copy: the
  host tier's write policy decides when that is).

It keeps the per-direction figures sglang's storage metrics have -- tokens prefetched and backed
up, each batch's bandwidth -- next to the store's own counters (bytes, seconds, errors).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..storage.base import L3Store, Outcome
from ..storage.keys import KeySpace
from ..storage.views import HostPageViews

#: Upper bounds (GB/s) of the per-batch bandwidth histograms (sglang's storage metrics observe
#: one bandwidth per batch too).
BANDWIDTH_BUCKETS_GBPS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


@dataclass
class BandwidthHistogram:
    """Cumulative-at-export histogram of per-batch GB/s (``counts``: per bucket, +Inf last)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BANDWIDTH_BUCKETS_GBPS) + 1))
    sum: float = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        gbps = nbytes / seconds / 1e9
        self.counts[bisect.bisect_left(BANDWIDTH_BUCKETS_GBPS, gbps)] += 1
        self.sum += gbps

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out


@dataclass
class TierCounters:
    """Pages through the tier (sglang: ``prefetched`` / ``backuped`` tokens are these times the page)."""

    prefetched_pages: int = 0  # pages read into the host tier
    backuped_pages: int = 0  # pages written out
    backup_failed_pages: int = 0  # pages a write refused (full store, failure, down)
    fallback_pages: int = 0  # pages the head stage took from L3 that this stage had to rewrite
    prefetch_bandwidth: BandwidthHistogram = field(default_factory=BandwidthHistogram)
    backup_bandwidth: BandwidthHistogram = field(default_factory=BandwidthHistogram)


class StorageTier:
    """One stage's L3 tier (see the module docstring)."""

    def __init__(self, store: L3Store, space: KeySpace, views: HostPageViews):
        self.store, self.space, self.views = store, space, views
        self.kinds = views.kinds
        self.page_bytes = views.token_page_bytes
        self.counters = TierCounters()
        store.register(views.tensors())

    @property
    def backend(self) -> str:
        return self.store.backend

    def up(self) -> bool:
        return self.store.health()[0]

    def exists(self, keys: Sequence[int]) -> int:
        n = len(keys)
        for kind in self.kinds:
            if not n:
                break
            n = self.store.batch_exists(self.space.keys(kind, keys[:n]))
        return n

    def fetch(self, keys: Sequence[int], host_pages: Sequence[int]) -> int:
        """Read pages into ``host_pages``; how many leading pages arrived whole for every kind."""
        n = len(keys)
        t0 = time.perf_counter()
        for kind in self.kinds:
            if not n:
                break
            out = self.store.batch_get_into(self.space.keys(kind, keys[:n]),
                                            self.views.views(kind, host_pages[:n]))
            n = next((i for i, o in enumerate(out) if o is not Outcome.OK), n)
        if n:
            self.counters.prefetched_pages += n
            self.counters.prefetch_bandwidth.observe(n * self.page_bytes, time.perf_counter() - t0)
        return n

    def backup(self, keys: Sequence[int], host_pages: Sequence[int]) -> int:
        """Write host pages out; how many were stored for every kind."""
        if not keys:
            return 0
        t0 = time.perf_counter()
        ok = [True] * len(keys)
        for kind in self.kinds:
            out = self.store.batch_set_from(self.space.keys(kind, keys), self.views.views(kind, host_pages))
            ok = [a and o is Outcome.OK for a, o in zip(ok, out, strict=True)]
        done = sum(ok)
        self.counters.backuped_pages += done
        self.counters.backup_failed_pages += len(keys) - done
        if done:
            self.counters.backup_bandwidth.observe(done * self.page_bytes, time.perf_counter() - t0)
        return done

    def to_dict(self) -> dict[str, Any]:
        c = self.counters
        up, reason = self.store.health()
        return {"backend": self.backend, "up": up, "down_reason": reason,
                "prefetched_pages": c.prefetched_pages, "backuped_pages": c.backuped_pages,
                "backup_failed_pages": c.backup_failed_pages, "fallback_pages": c.fallback_pages,
                "store": self.store.stats.to_dict()}
