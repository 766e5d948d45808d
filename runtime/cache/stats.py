"""Per-stage prefix-cache counters: hits by tier, misses, evictions, and pages moved.

Every looked-up prompt token lands in exactly one bucket (device, host or storage hit, or miss),
so the buckets always sum to the looked-up tokens; evictions and moves count *pages* (the unit
that moves), in both modes, so a metadata-only replay prices them with the memory layer's bytes
per page.  Transfer bytes and seconds are the controller's ``TransferStats``, not repeated here
(docs/hicache.md, "Accounting").
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pydantic import Field

from ..transfer.stats import TransferLive
from ..typed import Strict


class TierTokens(Strict):
    """Prompt tokens by where the prefix cache found them."""

    device: int = 0
    host: int = 0
    storage: int = 0  # found in L3 (read back whole, through the host tier)
    miss: int = 0

    @property
    def looked_up(self) -> int:
        return self.device + self.host + self.storage + self.miss


class TierPages(Strict):
    """A per-tier page count (evictions: device = left the device tier, host = left the host)."""

    device: int = 0
    host: int = 0


class CachePages(Strict):
    """Pages the stage's HiCache moved or lost, by reason."""

    backup: int = 0
    load: int = 0
    dropped: int = 0
    backup_skipped: int = 0


class CacheLive(Strict):
    """A stage's prefix-cache numbers, as its ``StageLive`` holds them."""

    cache_tokens: TierTokens = Field(default_factory=TierTokens)
    host_hit_ratio: float = Field(0.0, description="derived, since start: host-hit / looked-up "
                                  "tokens (exporters and charts use rates of the counters)")
    evictions: TierPages = Field(default_factory=TierPages)
    cache_pages: CachePages = Field(default_factory=CachePages)


@dataclass
class CacheStats:
    """Mutable counters of one stage's HiCache (one writer: the stage's scheduler)."""

    stage: int = 0
    page_size: int = 0
    requests: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0  # found in L3 and read back whole (prefetched through host)
    miss_tokens: int = 0
    computed_tokens: int = 0  # tokens the forward pass had to write (misses + outputs)
    device_evicted_pages: int = 0  # device -> host (or dropped, see below)
    dropped_pages: int = 0  # device pages evicted with no room on host (lost)
    host_evicted_pages: int = 0  # host -> out
    backup_pages: int = 0
    backup_skipped_pages: int = 0  # write-through backups refused for lack of host pages
    load_pages: int = 0
    out_of_pages_errors: int = 0
    transfer: Any = field(default=None, repr=False, compare=False)  # TransferStats or None

    # -- recording -------------------------------------------------------------------------
    def record_lookup(self, device_tokens: int, host_tokens: int, miss_tokens: int,
                      storage_tokens: int = 0) -> None:
        self.requests += 1
        self.device_hit_tokens += device_tokens
        self.host_hit_tokens += host_tokens
        self.storage_hit_tokens += storage_tokens
        self.miss_tokens += miss_tokens

    # -- derived ---------------------------------------------------------------------------
    @property
    def looked_up_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens + self.miss_tokens

    def _ratio(self, n: int) -> float:
        total = self.looked_up_tokens
        return n / total if total else 0.0

    @property
    def host_hit_ratio(self) -> float:
        return self._ratio(self.host_hit_tokens)

    @property
    def device_hit_ratio(self) -> float:
        return self._ratio(self.device_hit_tokens)

    @property
    def hit_ratio(self) -> float:
        return self._ratio(self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens)

    @property
    def storage_hit_ratio(self) -> float:
        return self._ratio(self.storage_hit_tokens)

    def live(self) -> CacheLive:
        """The counters as the cache part of the stage's ``StageLive``."""
        return CacheLive(
            cache_tokens=TierTokens(device=self.device_hit_tokens, host=self.host_hit_tokens,
                                    storage=self.storage_hit_tokens, miss=self.miss_tokens),
            host_hit_ratio=self.host_hit_ratio,
            evictions=TierPages(device=self.device_evicted_pages, host=self.host_evicted_pages),
            cache_pages=CachePages(backup=self.backup_pages, load=self.load_pages,
                                   dropped=self.dropped_pages, backup_skipped=self.backup_skipped_pages),
        )

    def to_dict(self) -> dict[str, Any]:
        """Everything, for the benchmark's JSON (counters, ratios, transfers)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "transfer"}
        d.update(looked_up_tokens=self.looked_up_tokens, hit_ratio=self.hit_ratio,
                 device_hit_ratio=self.device_hit_ratio, host_hit_ratio=self.host_hit_ratio,
                 storage_hit_ratio=self.storage_hit_ratio,
                 moved_pages={"d2h": self.backup_pages, "h2d": self.load_pages})
        transfer = self.transfer.live() if self.transfer is not None else TransferLive()
        d.update(transfer.model_dump(include={"transfer_bytes", "transfer_seconds", "transfer_count",
                                              "bandwidth_bytes_per_second"}))
        return d
