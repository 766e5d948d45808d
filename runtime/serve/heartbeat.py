"""A stage's heartbeat: a thread that re-stamps the stage file while the main thread works or waits.

The main thread of a stage spends most of a run inside torch.distributed calls
(recv of the next activation, a credit, a collective) that release the GIL, so a
thread of its own can keep beating while the stage is healthy and merely waiting.
What stops the beat is what should: a stopped (SIGSTOP), killed or wedged process.

The beat rewrites the stage's last published ``StageLive`` with a new
``heartbeat_at`` -- one file per stage, one typed model -- under the same lock
as the main thread's publish, so a beat can never put older numbers over newer
ones (counters would appear to go backwards).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..defaults import HEARTBEAT_INTERVAL_S
from ..live import run_dir as rd
from ..live.numbers import StageLive


class StageFile:
    """Writes one stage's ``stage-<k>.json``: numbers from the main thread, beats from the heartbeat."""

    def __init__(self, path: Path, refresh: Callable[[], dict[str, Any]] | None = None):
        self.path = path
        self._lock = threading.Lock()
        self._last: StageLive | None = None
        #: Fields a beat recomputes (states that change while the main thread waits, such as
        #: the host-tier verdict); None: a beat only re-stamps ``heartbeat_at``.
        self.refresh = refresh

    def publish(self, live: StageLive) -> None:
        """Write new numbers (stamped as a heartbeat too: the main thread is evidently alive)."""
        now = time.time()
        live = live.model_copy(update={"heartbeat_at": now})
        with self._lock:
            self._last = live
            rd.write_text_atomic(self.path, live.model_dump_json())

    def beat(self) -> None:
        """Re-write the last numbers with a fresh ``heartbeat_at`` (nothing before the first publish)."""
        try:
            fresh = self.refresh() if self.refresh is not None else {}
        except Exception:  # noqa: BLE001 - a failed refresh must never stop the beat
            fresh = {}
        with self._lock:
            if self._last is None:
                return
            self._last = self._last.model_copy(update={**fresh, "heartbeat_at": time.time()})
            rd.write_text_atomic(self.path, self._last.model_dump_json())


class Heartbeat:
    """A daemon thread calling ``StageFile.beat`` every ``interval`` seconds until stopped."""

    def __init__(self, stage_file: StageFile, interval: float = HEARTBEAT_INTERVAL_S):
        self.stage_file = stage_file
        self.interval = interval
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="stagecache-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.stage_file.beat()
            except OSError:
                pass  # run dir gone (parent exiting): the next beat or the exit settles it
