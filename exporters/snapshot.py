"""Where the exporters and the dashboard get their numbers from.

A ``SnapshotSource`` answers two questions: what did startup validation say
(``startup()``: a ``StartupReport.to_dict()``, or None while stages are still
reporting) and what are each stage's live numbers now (``stages()``: one
``StageLive`` per stage).  Stage processes produce the live numbers; the
dashboard and the Prometheus collector only read them, so both always show the
same figures.  Sources: ``RunDirSource`` (a ``serve`` run directory),
``StaticSource`` (a preflight report, no live numbers) and the sglang
integration's source.  A source may also have ``run()``: the serving parent's
own record (phase, failure), which the dashboard's run badge prefers over
what the stages say (``RunDirSource.run()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from stagecache.runtime.live.numbers import StageLive
from stagecache.runtime.live.run_dir import RunDirSource


@runtime_checkable
class SnapshotSource(Protocol):
    def startup(self) -> dict[str, Any] | None:
        """The startup report (``StartupReport.to_dict()``), or None until every stage reported."""

    def stages(self) -> dict[int, StageLive]:
        """Live numbers per stage id (may be empty: a preflight view has none)."""


class StaticSource:
    """A fixed report and fixed (or no) live numbers: ``stagecache dashboard --from-check``."""

    def __init__(self, report: Mapping[str, Any] | None,
                 stages: Mapping[int, StageLive | Mapping[str, Any]] | None = None):
        self._report = dict(report) if report is not None else None
        # dicts (a saved snapshot, a test) are validated here, at the boundary
        self._stages = {k: v if isinstance(v, StageLive) else StageLive.model_validate(v)
                        for k, v in (stages or {}).items()}

    def startup(self) -> dict[str, Any] | None:
        return self._report

    def stages(self) -> dict[int, StageLive]:
        return dict(self._stages)

    def run(self) -> None:
        """No serving parent behind a static view (liveness comes from the stages alone)."""
        return None


__all__ = ["RunDirSource", "SnapshotSource", "StageLive", "StaticSource"]
