"""Reading a ``SnapshotSource`` for the web app: validated, with the run state and the rates.

Every route asks a ``Reader`` instead of the source, so validation happens in
one place (a malformed report or stage is a 502 naming the field, never a
broken chart), and every read of the stages also feeds the rate ``History``
the charts plot -- the way each Prometheus scrape adds a sample.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from stagecache.exporters.snapshot import SnapshotSource
from stagecache.runtime.live.liveness import liveness_of, run_of

from .caching import PerReport
from .models import MetricsSummary, RunState, StageLive, StartupReportModel
from .rates import DEFAULT_WINDOW_S, History
from .view import ReportShapeError, parse_report, run_state


class NotReady(Exception):
    """The source has no startup report yet (stages still starting)."""


class SourceShapeError(Exception):
    """The source returned data that does not have the documented shape."""


STARTING_DETAIL = "stages are still starting: no startup report yet"


def live_numbers(stages: Mapping[int, Any]) -> list[StageLive]:
    """The stages' live numbers in stage order.

    Sources hand out ``StageLive``; a third-party source that returns plain dicts
    is validated here, and a malformed one is a 502 naming the stage and field.
    """
    out = []
    for key in sorted(stages):
        value = stages[key]
        if isinstance(value, StageLive):
            out.append(value)
            continue
        try:
            out.append(StageLive.model_validate(value))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise SourceShapeError(
                f"stage {key}: live numbers do not match the StageLive model "
                f"(runtime/live/numbers.py): {where}: {first['msg']} ({exc.error_count()} problem(s))"
            ) from None
    return out


def status_of(rep: StartupReportModel | None) -> str:
    if rep is None:
        return "starting"
    return "ok" if rep.ok else "failed"


class Reader:
    """The app's one way to the source (asked afresh on every call)."""

    def __init__(self, source: SnapshotSource, history: History | None = None):
        self.source = source
        self.history = history or History()
        #: values derived from one report object (the parse, the layer maps), kept while the
        #: source hands out that same object
        self.derived = PerReport()

    def optional_report(self) -> StartupReportModel | None:
        raw = self.source.startup()
        if raw is None:
            return None
        try:
            return self.derived.get(raw, "report", lambda: parse_report(raw))
        except ReportShapeError as exc:
            raise SourceShapeError(f"startup report from the source: {exc}") from None

    def report(self) -> StartupReportModel:
        rep = self.optional_report()
        if rep is None:
            raise NotReady()
        return rep

    def stages(self) -> list[StageLive]:
        """Every stage's numbers now; recorded in the rate history as a sample."""
        live = live_numbers(self.source.stages())
        self.history.observe(live, time.time())
        return live

    def run(self) -> Mapping[str, Any] | None:
        """The serving parent's record (``RunDirSource.run()``) where the source has one."""
        info = run_of(self.source)
        return info.model_dump() if info is not None else None

    def run_state(self, rep: StartupReportModel | None, live: list[StageLive]) -> RunState:
        return run_state(rep, live, self.run())

    def summary(self, window_s: float = DEFAULT_WINDOW_S) -> MetricsSummary:
        rep = self.optional_report()
        live = self.stages()
        now = time.time()
        return MetricsSummary(
            status=status_of(rep), has_live_numbers=bool(live), time=now,
            run=self.run_state(rep, live), window_s=window_s,
            rates=self.history.rates(window_s), stages=live,
            liveness=liveness_of(self.source, now),
        )
