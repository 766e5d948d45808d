"""What the dashboard computes once and reuses while its inputs stay the same objects.

Sources hand out the same objects while nothing changed (``RunDirSource`` keeps
each parsed file until it is rewritten; ``StaticSource`` never changes), so
object identity is an exact, free version number: a parsed report, a drawn
layer map or a rendered ``/metrics`` text stays valid for as long as the
objects it came from are the ones the source returns.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from stagecache.runtime.live.liveness import assess
from stagecache.runtime.live.source import SnapshotSource


class PerReport:
    """Values derived from one report object, kept until the source hands out another one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[Any, Any] = {}  # key -> the object its value was derived from
        self._values: dict[Any, Any] = {}

    def get(self, owner: Any, key: Any, compute: Any) -> Any:
        # computed under the lock: concurrent first requests wait for one computation instead of
        # each drawing the same figure (the work holds the GIL either way)
        with self._lock:
            if self._owners.get(key) is not owner:
                self._values[key] = compute()
                self._owners[key] = owner
            return self._values[key]


def source_state(source: SnapshotSource) -> tuple[Any, ...] | None:
    """What a scrape depends on: the source's objects (compared by identity) and the liveness
    verdict (which moves with the clock); None when the source cannot be compared."""
    try:
        startup, stages, run = source.startup(), source.stages(), source.run()
        verdict = assess(run, startup, stages, time.time())
    except Exception:  # noqa: BLE001 - a broken source is reported by the collector itself
        return None
    ups = tuple((h.stage, h.up) for h in verdict.stages)
    # the parent's in-memory counters (RunDirSource.write_failures) go with the verdicts
    parent = (verdict.failed_stage, source.write_failures)
    return (startup, run, tuple(stages.items()), ups, parent)


def same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Same source state: identical objects (``is``), equal verdicts."""
    (s1, r1, st1, up1, f1), (s2, r2, st2, up2, f2) = a, b
    return (s1 is s2 and r1 is r2 and up1 == up2 and f1 == f2 and len(st1) == len(st2)
            and all(k1 == k2 and v1 is v2 for (k1, v1), (k2, v2) in zip(st1, st2, strict=True)))
