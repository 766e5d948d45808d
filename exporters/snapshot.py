"""Where the exporters and the dashboard get their numbers from.

A ``SnapshotSource`` answers two questions: what did startup validation say
(``startup()``: a ``StartupReport.to_dict()``, or None while stages are still
reporting) and what are each stage's live numbers now (``stages()``).  Stage
processes produce the live numbers; the dashboard and the Prometheus collector
only read them, so both always show the same figures.

Live stage dict (one per stage; every key present, zeros before traffic)::

    {"stage": int, "time": float (unix s), "steps": int, "requests": int,
     "cache_tokens": {"device": int, "host": int, "miss": int},
     "host_hit_ratio": float,                       # host-hit / looked-up tokens
     "evictions": {"device": int, "host": int},
     "transfer_bytes": {"d2h": int, "h2d": int},
     "transfer_seconds": {"d2h": float, "h2d": float},
     "transfer_count": {"d2h": int, "h2d": int},
     "bandwidth_bytes_per_second": {"d2h": float, "h2d": float},
     "pool_pages": {pool: {"used": int, "free": int}},
     "pool_bytes": {pool: {"device": int, "host": int}},
     "stage_seconds": float, "bubble_seconds": float}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class SnapshotSource(Protocol):
    def startup(self) -> dict[str, Any] | None:
        """The startup report (``StartupReport.to_dict()``), or None until every stage reported."""

    def stages(self) -> dict[int, dict[str, Any]]:
        """Live numbers per stage id (may be empty: a preflight view has none)."""


class StaticSource:
    """A fixed report and no live numbers: ``stagecache dashboard --from-check``."""

    def __init__(self, report: Mapping[str, Any] | None, stages: Mapping[int, dict[str, Any]] | None = None):
        self._report = dict(report) if report is not None else None
        self._stages = dict(stages or {})

    def startup(self) -> dict[str, Any] | None:
        return self._report

    def stages(self) -> dict[int, dict[str, Any]]:
        return dict(self._stages)


def empty_stage_numbers(stage: int, pools: tuple[str, ...] = ()) -> dict[str, Any]:
    """The live dict of a stage that has served nothing yet."""
    return {
        "stage": stage, "time": 0.0, "steps": 0, "requests": 0,
        "cache_tokens": {"device": 0, "host": 0, "miss": 0},
        "host_hit_ratio": 0.0,
        "evictions": {"device": 0, "host": 0},
        "transfer_bytes": {"d2h": 0, "h2d": 0},
        "transfer_seconds": {"d2h": 0.0, "h2d": 0.0},
        "transfer_count": {"d2h": 0, "h2d": 0},
        "bandwidth_bytes_per_second": {"d2h": 0.0, "h2d": 0.0},
        "pool_pages": {p: {"used": 0, "free": 0} for p in pools},
        "pool_bytes": {p: {"device": 0, "host": 0} for p in pools},
        "stage_seconds": 0.0, "bubble_seconds": 0.0,
    }
