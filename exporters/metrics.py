"""Prometheus exposition of every stage's startup validation and live numbers.

A prometheus-client *custom collector*: nothing is stored here.  Each scrape asks the
``SnapshotSource`` once and turns its answers into the families of ``families.py``, so ``/metrics``
never disagrees with the dashboard or the JSON snapshot, and a multi-process ``serve`` needs no
prometheus multiprocess mode: the stages publish plain numbers, the one parent exposes them.
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
    InfoMetricFamily,
    Metric,
    StateSetMetricFamily,
)
from prometheus_client.registry import Collector
from stagecache.runtime.live.liveness import Liveness, liveness_of
from stagecache.runtime.live.numbers import StageLive
from stagecache.runtime.live.source import SnapshotSource
from stagecache.runtime.validation.report import StartupReport

from .families import STAGE_LABELS, Family, all_families, label_names

_KINDS = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily,
          "histogram": HistogramMetricFamily, "info": InfoMetricFamily,
          "stateset": StateSetMetricFamily}


def exposed_name(fam: Family) -> str:
    """The name prometheus-client takes (it appends ``_total`` / ``_info`` itself)."""
    for suffix, kind in (("_total", "counter"), ("_info", "info")):
        if fam.kind == kind and fam.name.endswith(suffix):
            return fam.name[: -len(suffix)]
    return fam.name


def new_family(scope: str, fam: Family) -> Metric:
    labels = list(label_names(scope, fam))
    if fam.kind == "stateset":
        labels.pop()  # prometheus-client adds the state label itself
    if fam.kind == "info":
        scope_labels = STAGE_LABELS if scope in ("startup", "live", "liveness") else ()
        labels = list(scope_labels)
    return _KINDS[fam.kind](exposed_name(fam), fam.help, labels=labels)


def add_sample(metric: Metric, scope: str, fam: Family, prefix: tuple[str, ...],
               values: tuple[Any, ...], value: Any) -> None:
    """One series: ``prefix`` (the stage labels) + the family's own label values."""
    labels = [*prefix, *(str(v) for v in values)]
    if fam.kind == "info":
        metric.add_metric(list(prefix), dict(zip(fam.labels, (str(v) for v in values), strict=True)))
    elif fam.kind == "histogram":
        buckets, total = value
        metric.add_metric(labels, buckets=buckets, sum_value=total)
    else:
        metric.add_metric(labels, value)


def _version() -> str:
    from stagecache import runtime

    return str(getattr(runtime, "__version__", "0"))


class StageCollector(Collector):
    """Collector over a ``SnapshotSource``: one read of the source per scrape."""

    def __init__(self, source: SnapshotSource):
        self.source = source

    def describe(self) -> Iterator[Metric]:
        for scope, fam in all_families():
            yield new_family(scope, fam)

    def collect(self) -> Iterator[Metric]:
        report = self.source.startup()
        live = self.source.stages()
        model = report.model if report is not None else ""
        # the same verdict as /readyz, computed once per scrape
        verdict = liveness_of(self.source, time.time()) if live else None
        metrics = {fam.name: new_family(scope, fam) for scope, fam in all_families()}
        for scope, fam in all_families():
            inputs = self._parent() if scope == "parent" else self._deployment() if scope == "deployment" \
                else self._transfers(live) if scope == "transfers" else self._inputs(scope, report, live, model, verdict)
            for prefix, item in inputs:
                for values, value in fam.samples(item):
                    add_sample(metrics[fam.name], scope, fam, prefix, values, value)
        metrics["stagecache_build_info"].add_metric([], {"version": _version()})
        # the PP ranks' agreement exists only where the source compares ranks (the sglang endpoint);
        # incomplete transfers where it does or stages report live numbers (serve)
        absent = {f.name for scope, f in all_families() if scope == "deployment"} if not self._deployment() else set()
        if not self._transfers(live):
            absent |= {f.name for scope, f in all_families() if scope == "transfers"}
        yield from (m for name, m in metrics.items() if name not in absent)

    def _parent(self) -> list[tuple[tuple[str, ...], Any]]:
        """The serving parent's counters, when the source has a parent (``RunDirSource``)."""
        failures = self.source.write_failures
        return [((), failures)] if failures is not None else []

    def _deployment(self) -> list[tuple[tuple[str, ...], Any]]:
        """The PP ranks' agreement, where the source compares them (the sglang endpoint)."""
        divergence = getattr(self.source, "divergence", None)
        d = divergence() if callable(divergence) else None
        return [((), d)] if d is not None else []

    def _transfers(self, live: Mapping[int, StageLive]) -> list[tuple[tuple[str, ...], Any]]:
        """Incomplete HiCache transfers by pool kind: the sglang endpoint's compare of its ranks, or
        the sum of every stage's own check (``serve``)."""
        deployment = self._deployment()
        if deployment:
            return [((), deployment[0][1].incomplete)]
        if not live:
            return []  # a preflight view: no transfers at all
        counts: dict[str, int] = {}
        for s in live.values():  # every kind checked starts at 0 (a counter rate() can read)
            counts.update({kind: counts.get(kind, 0) for kind in s.transfer_check.kinds})
            for kind, n in s.transfer_check.incomplete.items():
                counts[kind] = counts.get(kind, 0) + n
        return [((), counts)]

    @staticmethod
    def _inputs(scope: str, report: StartupReport | None, live: Mapping[int, StageLive],
                model: str, verdict: Liveness | None) -> list[tuple[tuple[str, ...], Any]]:
        """``(stage label values, input)`` for each series group of a scope."""
        if scope == "run":
            return [((), report)] if report is not None else []
        if scope == "startup":
            return [((model, str(s.stage), "0"), s) for s in (report.stages if report else ())]
        if scope == "live":
            return [((s.model_name or model, str(k), str(s.tp_rank)), s)
                    for k, s in sorted(live.items())]
        if scope == "liveness" and verdict is not None:
            return [((_model_of(live.get(h.stage), model), str(h.stage), "0"), (h, verdict))
                    for h in verdict.stages]
        return []


def _model_of(stage: StageLive | None, model: str) -> str:
    return (stage.model_name if stage is not None else "") or model


def make_registry(source: SnapshotSource) -> CollectorRegistry:
    """A fresh registry holding only the stagecache collector over ``source``."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StageCollector(source))
    return registry


def process_registry() -> CollectorRegistry:
    """The prometheus-client default collectors of the serving process, in a registry of their
    own: ``process_*`` (CPU seconds, resident memory, open fds, start time) and ``python_*``
    (interpreter version, garbage collector), the families every Prometheus user expects.

    Kept apart from ``make_registry`` because they change on every scrape, while the stagecache
    families are rendered again only when the run directory changes (``dashboard.app``)."""
    from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


#: Names as they appear in the exposition (counters with ``_total``, histograms by base name).
METRIC_NAMES: tuple[str, ...] = tuple(fam.name for _scope, fam in all_families())
