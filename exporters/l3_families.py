"""The L3 tier's Prometheus families: sglang's storage metric names, prefixed, with ``pp_rank``.

sglang 0.5.23 exposes ``prefetched_tokens_total``, ``backuped_tokens_total``,
``storage_prefetch_hit_tokens_total``, ``prefetch_bandwidth`` and ``backup_bandwidth`` (labels
``storage_backend``, ``pp_rank``); stagecache's series have the same names after ``stagecache_``
and the same two labels (``pp_rank`` among ``STAGE_LABELS``), so a dashboard built for one reads
the other.  Beside them: bytes and seconds per direction, errors by kind, the backend's health.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stagecache.runtime.live.numbers import StageLive

from .family import Family, Samples, cumulative_buckets

L3_DIRECTIONS = ("prefetch", "backup")
L3_ERRORS = ("corrupt", "failed", "no_space")

L3_LABELS: dict[str, str] = {
    "storage_backend": "L3 backend: `file` or `mooncake` (sglang's label)",
    "l3_direction": "L3 direction: `prefetch` (L3 to host) or `backup` (host to L3)",
    "error": "L3 error: `corrupt` (checksum or size; a miss, never data), `failed` (I/O or transfer), "
             "`no_space` (a full store refused a write)",
}
L3_LABEL_VALUES: dict[str, tuple[str, ...]] = {"l3_direction": L3_DIRECTIONS, "error": L3_ERRORS}


def _on(fn: Any) -> Any:
    """Samples only for a stage that has an L3 tier (``backend`` other than none)."""
    def samples(s: StageLive) -> Samples:
        return [] if s.l3.backend == "none" else fn(s)
    return samples


def _backend(name: str, kind: str, help: str, value: Callable[[StageLive], Any]) -> Family:
    """A family of one series per stage with an L3 tier, labelled by its backend."""
    return Family(name, kind, help, ("storage_backend",), _on(lambda s: [((s.l3.backend,), value(s))]))


def _per_direction(name: str, help: str, field: str) -> Family:
    """A counter per backend and direction, from ``StageLive.l3.<field>.<direction>``."""
    return Family(name, "counter", help, ("storage_backend", "l3_direction"), _on(
        lambda s: [((s.l3.backend, d), getattr(getattr(s.l3, field), d)) for d in L3_DIRECTIONS]))


def _bandwidth(which: str) -> Callable[[StageLive], Any]:
    def histogram(s: StageLive) -> Any:
        h = getattr(s.l3, which)
        return cumulative_buckets(h.le, h.counts, h.counts[-1] if h.counts else 0), h.sum
    return histogram


L3_FAMILIES: tuple[Family, ...] = (
    _backend("stagecache_prefetched_tokens_total", "counter",
             "Tokens read from L3 into the host tier (whole pages, every pool kind, checked)",
             lambda s: s.l3.prefetched_tokens),
    _backend("stagecache_backuped_tokens_total", "counter",
             "Tokens written from the host tier to L3 (when the host tier got its copy)",
             lambda s: s.l3.backuped_tokens),
    _backend("stagecache_storage_prefetch_hit_tokens_total", "counter",
             "Looked-up prompt tokens found in L3 (also stagecache_prefix_hit_tokens_total{tier=storage})",
             lambda s: s.cache_tokens.storage),
    _backend("stagecache_prefetch_bandwidth", "histogram",
             "GB/s of each L3 prefetch batch (sglang's prefetch_bandwidth)", _bandwidth("prefetch_bandwidth")),
    _backend("stagecache_backup_bandwidth", "histogram",
             "GB/s of each L3 backup batch (sglang's backup_bandwidth)", _bandwidth("backup_bandwidth")),
    _per_direction("stagecache_l3_bytes_total", "Bytes moved between the host tier and L3", "bytes"),
    _per_direction("stagecache_l3_seconds_total",
                   "Seconds of L3 batch calls (rate(bytes_total) / rate(seconds_total) is the bandwidth)",
                   "seconds"),
    Family("stagecache_l3_errors_total", "counter",
           "L3 objects that failed: corrupt (a miss, never data), failed, no_space",
           ("storage_backend", "error"),
           _on(lambda s: [((s.l3.backend, e), s.l3.errors.get(e, 0)) for e in L3_ERRORS])),
    _backend("stagecache_l3_skipped_objects_total", "counter",
             "L3 objects not tried while the backend was down", lambda s: s.l3.skipped),
    _backend("stagecache_l3_fallback_pages_total", "counter",
             "Pages the head stage took from L3 that this stage could not read and rewrote",
             lambda s: s.l3.fallback_pages),
    _backend("stagecache_l3_evicted_objects_total", "counter",
             "L3 objects the store dropped to make room (file: LRU under --l3-size-gb)",
             lambda s: s.l3.evictions),
    _backend("stagecache_l3_up", "gauge",
             "1 while the L3 backend answers, 0 while it is down (the stage serves from device and host)",
             lambda s: 1 if s.l3.up else 0),
    _backend("stagecache_l3_used_bytes", "gauge", "Bytes of the stage's objects in L3 (file backend)",
             lambda s: s.l3.used_bytes),
    _backend("stagecache_l3_capacity_bytes", "gauge",
             "The stage's L3 bound in bytes (file: its share of --l3-size-gb; mooncake: its segment)",
             lambda s: s.l3.capacity_bytes),
)
