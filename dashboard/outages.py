"""The gaps in a stage's numbers: when it went unreachable, stale or crashed, and when it came back.

``/readyz`` says what is true now; an operator looking at the page after a link flapped needs
what happened: each stage's outages, start and end on this server's clock, kept while the
dashboard runs (bounded).  The rate charts and the timeline shade them, and a stage that is
unreachable has no rates (its counters are not arriving: empty, not zero).
"""

from __future__ import annotations

import threading
from collections import deque

from pydantic import BaseModel, Field
from stagecache.runtime.live.liveness import Liveness

#: The stage states that are a gap in its numbers.
GAP_STATES = frozenset({"unreachable", "stale", "crashed"})
MAX_OUTAGES = 200


class Outage(BaseModel):
    stage: int
    state: str = Field(description="unreachable, stale or crashed (the state it went into first)")
    start: float = Field(description="unix time (this server's clock) the verdict first said so")
    end: float | None = Field(None, description="unix time it was up again (None: still out)")
    reason: str | None = None


class Outages:
    """Every stage's outages seen by the verdicts this dashboard computed (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, Outage] = {}
        self._done: deque[Outage] = deque(maxlen=MAX_OUTAGES)

    def observe(self, verdict: Liveness) -> None:
        with self._lock:
            for h in verdict.stages:
                current = self._open.get(h.stage)
                if h.state in GAP_STATES and current is None:
                    self._open[h.stage] = Outage(stage=h.stage, state=h.state, start=verdict.time, reason=h.reason)
                elif current is not None and h.state == "up":
                    current.end = verdict.time
                    self._done.append(self._open.pop(h.stage))

    def all(self) -> list[Outage]:
        with self._lock:
            return [o.model_copy() for o in [*self._done, *self._open.values()]]

    def out_now(self) -> set[int]:
        with self._lock:
            return {k for k, o in self._open.items() if o.state == "unreachable"}
