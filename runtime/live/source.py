"""Where the exporters and the dashboard get their numbers from: a ``SnapshotSource``.

A source answers what startup validation said (``startup()``: the ``StartupReport``, or None
while stages are still reporting), what each stage's live numbers are now (``stages()``: one
``StageLive`` per stage), and -- where a serving parent exists -- the parent's own record
(``run()``: phase, failure) and its failed file writes (``write_failures``).  Stage processes
produce the numbers; the dashboard and the Prometheus collector only read them, so both
always show the same figures.  Sources: ``run_dir.RunDirSource`` (a ``serve`` run directory),
``StaticSource`` (a preflight report, no live numbers) and the sglang integration's source.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from ..validation.report import StartupReport
from .numbers import RunInfo, StageLive


@runtime_checkable
class SnapshotSource(Protocol):
    """What every reader of a run's numbers asks (see the module docstring)."""

    def startup(self) -> StartupReport | None:
        """The startup report, or None until every stage reported."""

    def stages(self) -> dict[int, StageLive]:
        """Live numbers per stage id (may be empty: a preflight view has none)."""

    def run(self) -> RunInfo | None:
        """The serving parent's record (phase, failure), or None where there is no parent."""

    #: Failed writes of the parent's run files (None: no parent writes any).
    write_failures: int | None


class StaticSource:
    """A fixed report and fixed (or no) live numbers: ``stagecache dashboard --from-check``."""

    def __init__(self, report: StartupReport | None, stages: Mapping[int, StageLive] | None = None):
        self._report = report
        self._stages = dict(stages or {})
        self.write_failures: int | None = None

    def startup(self) -> StartupReport | None:
        return self._report

    def stages(self) -> dict[int, StageLive]:
        return dict(self._stages)

    def run(self) -> None:
        """No serving parent behind a static view (liveness comes from the stages alone)."""
        return None
