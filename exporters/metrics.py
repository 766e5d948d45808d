"""Prometheus exposition of every stage's startup validation and live cache numbers.

A *custom collector*: nothing is stored here.  On each scrape ``collect()``
asks the ``SnapshotSource`` once for the startup report and the live stage
dicts and turns them into metric families, so ``/metrics`` can never disagree
with the dashboard or the JSON snapshot (they read the same source), and a
multi-process ``serve`` needs no prometheus multiprocess mode: the stage
processes publish plain numbers and the one parent process exposes them.

Every family carries a ``stage`` label; pool-level families add ``pool``.
Counters end in ``_total``, times are seconds, sizes bytes (Prometheus
conventions).  ``METRIC_NAMES`` lists the names exactly as they appear in the
exposition (counters with ``_total``, the histogram by its base name).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from stagecache.runtime.model.pool_kinds import POOLS

from .snapshot import SnapshotSource

DIRECTIONS = ("d2h", "h2d")
TIERS = ("device", "host", "miss")

#: (name as exposed, type, help).  Order = exposition order.
FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("stagecache_startup_ok", "gauge",
     "1 if every stage's pools and layer map validated at startup, 0 if not (absent while starting)"),
    ("stagecache_cross_stage_errors", "gauge",
     "Cross-stage validation errors at startup (partition gaps/overlaps)"),
    ("stagecache_stage_local_layers", "gauge", "Layers this PP stage owns"),
    ("stagecache_stage_buffers", "gauge", "Buffers the stage's pool really holds (None slots included)"),
    ("stagecache_stage_expected_buffers", "gauge",
     "Buffers the stage's pool must hold: its local layers of that pool's kind"),
    ("stagecache_stage_mapping_ok", "gauge", "1 if the stage validated at startup, else 0"),
    ("stagecache_stage_mapping_errors", "gauge", "Validation errors of the stage at startup"),
    ("stagecache_requests_total", "counter", "Requests the stage has finished"),
    ("stagecache_steps_total", "counter", "Micro-batches the stage has finished"),
    ("stagecache_cache_tokens_total", "counter",
     "Prompt tokens by where the prefix cache found them: device, host (HiCache) or miss (computed)"),
    ("stagecache_host_hit_ratio", "gauge", "Host-hit tokens / looked-up tokens on this stage"),
    ("stagecache_evictions_total", "counter", "Cache evictions by tier (device: to host or dropped; host: dropped)"),
    ("stagecache_transfer_bytes_total", "counter",
     "Bytes copied between device and host pools (d2h = backup, h2d = load)"),
    ("stagecache_transfer_seconds", "histogram", "Duration of one device<->host page transfer"),
    ("stagecache_transfer_bandwidth_bytes_per_second", "gauge",
     "Mean device<->host copy bandwidth: transfer bytes / transfer seconds"),
    ("stagecache_pool_pages", "gauge", "Token pages of the stage's page space by state (used/free)"),
    ("stagecache_pool_bytes", "gauge", "Bytes a pool kind occupies on the stage, by tier (device/host)"),
    ("stagecache_stage_busy_seconds_total", "counter",
     "Seconds the stage spent on its own work (cache, KV writes, transfers, layer compute)"),
    ("stagecache_stage_bubble_seconds_total", "counter",
     "Seconds the stage waited on a peer (activation, credit, send drain): the pipeline bubble"),
    ("stagecache_stage_idle_seconds_total", "counter",
     "Seconds the stage waited for requests to arrive (paced traffic), not counted as bubble"),
    ("stagecache_activation_bytes_total", "counter",
     "Activation bytes (with headers) the stage sent to / received from its pipeline neighbours"),
)

METRIC_NAMES: tuple[str, ...] = tuple(name for name, _kind, _help in FAMILIES)


def _num(value: Any, default: float = 0.0) -> float:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return default


def _sub(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = d.get(key)
    return value if isinstance(value, Mapping) else {}


def _histogram_buckets(live: Mapping[str, Any], direction: str) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` buckets of one direction; +Inf only when no buckets were reported.

    Stages report ``transfer_seconds_buckets = {"le": [...], "d2h": [...], "h2d": [...]}``
    (cumulative counts, the last entry being +Inf), straight from ``TransferStats``.
    """
    count = _num(_sub(live, "transfer_count").get(direction))
    hist = _sub(live, "transfer_seconds_buckets")
    bounds = hist.get("le")
    counts = hist.get(direction)
    buckets: list[tuple[str, float]] = []
    if isinstance(bounds, list) and isinstance(counts, list) and len(counts) == len(bounds) + 1:
        buckets = [(repr(float(b)), _num(c)) for b, c in zip(bounds, counts[:-1], strict=True)]
        count = _num(counts[-1])
    buckets.append(("+Inf", count))
    return buckets


class StageCollector(Collector):
    """Collector over a ``SnapshotSource``: one read of the source per scrape."""

    def __init__(self, source: SnapshotSource):
        self.source = source

    def describe(self) -> Iterator[Metric]:
        for name, kind, help_ in FAMILIES:
            yield _family(name, kind, help_, [])

    def collect(self) -> Iterator[Metric]:
        report = self.source.startup()
        live = self.source.stages()
        fams = {name: _family(name, kind, help_, _labels(name)) for name, kind, help_ in FAMILIES}
        if report is not None:
            self._startup(fams, report)
        for stage in sorted(live):
            self._live(fams, str(stage), live[stage])
        yield from fams.values()

    @staticmethod
    def _startup(fams: dict[str, Metric], report: Mapping[str, Any]) -> None:
        cross = report.get("errors") or []
        fams["stagecache_startup_ok"].add_metric([], 1.0 if report.get("ok") else 0.0)
        fams["stagecache_cross_stage_errors"].add_metric([], float(len(cross)))
        for s in report.get("stages") or []:
            st = str(s.get("stage"))
            fams["stagecache_stage_local_layers"].add_metric([st], _num(s.get("local_layers")))
            buffers, expected = _sub(s, "buffers"), _sub(s, "expected_buffers")
            for pool in POOLS:
                fams["stagecache_stage_buffers"].add_metric([st, pool], _num(buffers.get(pool)))
                fams["stagecache_stage_expected_buffers"].add_metric([st, pool], _num(expected.get(pool)))
            errors = s.get("errors") or []
            fams["stagecache_stage_mapping_ok"].add_metric([st], 1.0 if s.get("ok") and not errors else 0.0)
            fams["stagecache_stage_mapping_errors"].add_metric([st], float(len(errors)))

    @staticmethod
    def _live(fams: dict[str, Metric], st: str, d: Mapping[str, Any]) -> None:
        fams["stagecache_requests_total"].add_metric([st], _num(d.get("requests")))
        fams["stagecache_steps_total"].add_metric([st], _num(d.get("steps")))
        tokens = _sub(d, "cache_tokens")
        for tier in TIERS:
            fams["stagecache_cache_tokens_total"].add_metric([st, tier], _num(tokens.get(tier)))
        fams["stagecache_host_hit_ratio"].add_metric([st], _num(d.get("host_hit_ratio")))
        ev = _sub(d, "evictions")
        for tier in ("device", "host"):
            fams["stagecache_evictions_total"].add_metric([st, tier], _num(ev.get(tier)))
        nbytes, secs, bw = _sub(d, "transfer_bytes"), _sub(d, "transfer_seconds"), _sub(
            d, "bandwidth_bytes_per_second")
        for direction in DIRECTIONS:
            fams["stagecache_transfer_bytes_total"].add_metric([st, direction], _num(nbytes.get(direction)))
            fams["stagecache_transfer_seconds"].add_metric(
                [st, direction], buckets=_histogram_buckets(d, direction),
                sum_value=_num(secs.get(direction)))
            fams["stagecache_transfer_bandwidth_bytes_per_second"].add_metric(
                [st, direction], _num(bw.get(direction)))
        for pool, pages in sorted(_sub(d, "pool_pages").items()):
            if isinstance(pages, Mapping):
                for state in ("used", "free"):
                    fams["stagecache_pool_pages"].add_metric([st, pool, state], _num(pages.get(state)))
        for pool, tiers in sorted(_sub(d, "pool_bytes").items()):
            if isinstance(tiers, Mapping):
                for tier in ("device", "host"):
                    fams["stagecache_pool_bytes"].add_metric([st, pool, tier], _num(tiers.get(tier)))
        fams["stagecache_stage_busy_seconds_total"].add_metric([st], _num(d.get("stage_seconds")))
        fams["stagecache_stage_bubble_seconds_total"].add_metric([st], _num(d.get("bubble_seconds")))
        fams["stagecache_stage_idle_seconds_total"].add_metric([st], _num(d.get("idle_seconds")))
        for direction in ("sent", "received"):
            fams["stagecache_activation_bytes_total"].add_metric(
                [st, direction], _num(d.get(f"activation_bytes_{direction}")))


_LABELS: dict[str, list[str]] = {
    "stagecache_startup_ok": [],
    "stagecache_cross_stage_errors": [],
    "stagecache_stage_buffers": ["stage", "pool"],
    "stagecache_stage_expected_buffers": ["stage", "pool"],
    "stagecache_cache_tokens_total": ["stage", "tier"],
    "stagecache_evictions_total": ["stage", "tier"],
    "stagecache_transfer_bytes_total": ["stage", "direction"],
    "stagecache_transfer_seconds": ["stage", "direction"],
    "stagecache_transfer_bandwidth_bytes_per_second": ["stage", "direction"],
    "stagecache_pool_pages": ["stage", "pool", "state"],
    "stagecache_pool_bytes": ["stage", "pool", "tier"],
    "stagecache_activation_bytes_total": ["stage", "direction"],
}


def _labels(name: str) -> list[str]:
    return _LABELS.get(name, ["stage"])


def _family(name: str, kind: str, help_: str, labels: list[str]) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, help_, labels=labels)
    if kind == "histogram":
        return HistogramMetricFamily(name, help_, labels=labels)
    return GaugeMetricFamily(name, help_, labels=labels)


def make_registry(source: SnapshotSource) -> CollectorRegistry:
    """A fresh registry holding only the stagecache collector over ``source``."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StageCollector(source))
    return registry


__all__ = ["FAMILIES", "METRIC_NAMES", "StageCollector", "make_registry"]
