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

import time
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
from stagecache.runtime.model.layer_map import POOLS
from stagecache.runtime.serve.liveness import Liveness, assess, run_of

from .snapshot import SnapshotSource, StageLive

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
    ("stagecache_stage_up", "gauge",
     "1 if the stage process is alive and its heartbeat is newer than the heartbeat timeout, else 0"),
    ("stagecache_stage_last_heartbeat_timestamp_seconds", "gauge",
     "Unix time of the stage's last heartbeat (0: never)"),
    ("stagecache_stage_failed", "gauge",
     "1 for the stage the run's failure names (its error: /readyz, the dashboard), else 0"),
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


def _histogram_buckets(live: StageLive, direction: str) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` buckets of one direction; +Inf only when no buckets were reported."""
    count = getattr(live.transfer_count, direction)
    hist = live.transfer_seconds_buckets
    counts = getattr(hist, direction)
    buckets: list[tuple[str, float]] = []
    if counts and len(counts) == len(hist.le) + 1:
        buckets = [(repr(float(b)), c) for b, c in zip(hist.le, counts[:-1], strict=True)]
        count = counts[-1]
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
        if live:
            self._liveness(fams, assess(run_of(self.source), report, live, time.time()))
        yield from fams.values()

    @staticmethod
    def _liveness(fams: dict[str, Metric], verdict: Liveness) -> None:
        """Up, last heartbeat and failed per stage: the same verdict as ``/readyz``."""
        for h in verdict.stages:
            st = str(h.stage)
            fams["stagecache_stage_up"].add_metric([st], 1.0 if h.up else 0.0)
            fams["stagecache_stage_last_heartbeat_timestamp_seconds"].add_metric(
                [st], h.heartbeat_at or 0.0)
            fams["stagecache_stage_failed"].add_metric(
                [st], 1.0 if verdict.failed_stage == h.stage else 0.0)

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
    def _live(fams: dict[str, Metric], st: str, d: StageLive) -> None:
        fams["stagecache_requests_total"].add_metric([st], d.requests)
        fams["stagecache_steps_total"].add_metric([st], d.steps)
        for tier in TIERS:
            fams["stagecache_cache_tokens_total"].add_metric([st, tier], getattr(d.cache_tokens, tier))
        fams["stagecache_host_hit_ratio"].add_metric([st], d.host_hit_ratio)
        for tier in ("device", "host"):
            fams["stagecache_evictions_total"].add_metric([st, tier], getattr(d.evictions, tier))
        for direction in DIRECTIONS:
            fams["stagecache_transfer_bytes_total"].add_metric(
                [st, direction], getattr(d.transfer_bytes, direction))
            fams["stagecache_transfer_seconds"].add_metric(
                [st, direction], buckets=_histogram_buckets(d, direction),
                sum_value=getattr(d.transfer_seconds, direction))
            fams["stagecache_transfer_bandwidth_bytes_per_second"].add_metric(
                [st, direction], getattr(d.bandwidth_bytes_per_second, direction))
        for pool, pages in sorted(d.pool_pages.items()):
            for state in ("used", "free"):
                fams["stagecache_pool_pages"].add_metric([st, pool, state], getattr(pages, state))
        for pool, tiers in sorted(d.pool_bytes.items()):
            for tier in ("device", "host"):
                fams["stagecache_pool_bytes"].add_metric([st, pool, tier], getattr(tiers, tier))
        fams["stagecache_stage_busy_seconds_total"].add_metric([st], d.stage_seconds)
        fams["stagecache_stage_bubble_seconds_total"].add_metric([st], d.bubble_seconds)
        fams["stagecache_stage_idle_seconds_total"].add_metric([st], d.idle_seconds)
        fams["stagecache_activation_bytes_total"].add_metric([st, "sent"], d.activation_bytes_sent)
        fams["stagecache_activation_bytes_total"].add_metric([st, "received"], d.activation_bytes_received)


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
