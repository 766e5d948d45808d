"""Reading a ``SnapshotSource`` for the web app, with the run state and the rates.

Every route asks a ``Reader`` instead of the source, so every read of the stages
also feeds the rate ``History`` the charts plot -- the way each Prometheus scrape
adds a sample.  The source hands out the runtime's own typed models
(``StartupReport``, ``StageLive``), which the app serves as they are.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from stagecache.runtime.live.liveness import liveness_of
from stagecache.runtime.live.numbers import StageLive
from stagecache.runtime.live.source import SnapshotSource
from stagecache.runtime.validation.report import StartupReport

from .caching import PerReport
from .models import MetricsSummary, RunState
from .outages import Outages
from .rates import DEFAULT_WINDOW_S, History, StageRates
from .view import run_state


class NotReady(Exception):
    """The source has no startup report yet (stages still starting)."""


STARTING_DETAIL = "stages are still starting: no startup report yet"
#: Seconds to wait for a watch thread's last reading when it is stopped.
WATCH_JOIN_S = 5.0
#: The readers whose watch thread runs, stopped at interpreter exit (``Reader.watch``).
_WATCHING: weakref.WeakSet[Reader] = weakref.WeakSet()


@atexit.register
def _stop_all_watching() -> None:
    for reader in list(_WATCHING):
        reader.stop_watching()


def status_of(rep: StartupReport | None) -> str:
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
        #: the stages' gaps (unreachable, stale, crashed) seen by this dashboard's verdicts
        self.outages = Outages()
        self._watching: tuple[threading.Event, threading.Thread] | None = None

    def watch(self, interval_s: float = 0.5) -> None:
        """Judge the stages every ``interval_s`` in a thread of its own, so a gap is recorded (start
        and end) even while nobody has the page open; until :meth:`stop_watching`, the reader is
        dropped, or the interpreter exits.

        The thread is stopped and joined before the interpreter finalizes: a daemon thread still
        reading a source there (sglang's pools are torch objects, whose calls release the GIL) is
        killed in C++ code on its way back and aborts the whole process ("terminate called without
        an active exception")."""
        if self._watching is not None:
            return
        ref = weakref.ref(self)
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                reader = ref()
                if reader is None:
                    return
                try:
                    reader.outages.observe(liveness_of(reader.source, time.time()))
                except Exception:  # noqa: BLE001 - a source mid-write; the next tick reads again
                    pass
                del reader

        thread = threading.Thread(target=loop, name="stagecache-outages", daemon=True)
        self._watching = (stop, thread)
        _WATCHING.add(self)
        thread.start()

    def stop_watching(self) -> None:
        """Stop the thread :meth:`watch` started and wait for its last reading to end."""
        watching, self._watching = self._watching, None
        _WATCHING.discard(self)
        if watching is not None:
            stop, thread = watching
            stop.set()
            if thread is not threading.current_thread():
                thread.join(timeout=WATCH_JOIN_S)

    def report(self) -> StartupReport:
        rep = self.source.startup()
        if rep is None:
            raise NotReady()
        return rep

    def stages(self) -> list[StageLive]:
        """Every stage's numbers now; recorded in the rate history as a sample."""
        live = [s for _, s in sorted(self.source.stages().items())]
        now = time.time()
        self.outages.observe(liveness_of(self.source, now))
        out = self.outages.out_now()  # an unreachable stage's counters are not arriving: no sample
        self.history.observe([s for s in live if s.stage not in out], now)
        return live

    def run(self) -> Mapping[str, Any] | None:
        """The serving parent's record (``RunDirSource.run()``) where the source has one."""
        info = self.source.run()
        return info.model_dump() if info is not None else None

    def run_state(self, rep: StartupReport | None, live: list[StageLive]) -> RunState:
        return run_state(rep, live, self.run())

    def summary(self, window_s: float = DEFAULT_WINDOW_S) -> MetricsSummary:
        rep = self.source.startup()
        live = self.stages()
        now = time.time()
        verdict = liveness_of(self.source, now)
        self.outages.observe(verdict)
        out = self.outages.out_now()
        return MetricsSummary(
            status=status_of(rep), has_live_numbers=bool(live), time=now,
            run=self.run_state(rep, live), window_s=window_s,
            rates=[r if r.stage not in out else StageRates(stage=r.stage, time=r.time, window_s=0.0)
                   for r in self.history.rates(window_s)], stages=live,
            liveness=verdict, outages=self.outages.all(),
        )
