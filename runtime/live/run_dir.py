"""The run directory: how stage processes hand their numbers to the serving parent.

Every stage process owns exactly one file (``stage-<k>.json``) and rewrites it
whole, atomically (write a temp file, ``os.replace``), so a reader never sees a
half-written snapshot and no lock or shared memory is needed.  Rank 0 also
writes ``startup.json`` (the ``StartupReport.to_dict()``); the parent writes
``run.json`` (phase, pids, the failure message) and ``snapshot.json`` (all of it
in one document).  Files, not queues, because they survive a crashed stage:
the last numbers it reported stay readable for the dashboard and the summary.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..validation.report import StartupReport
from .numbers import RunInfo, StageLive

STARTUP_FILE = "startup.json"
RUN_FILE = "run.json"
SNAPSHOT_FILE = "snapshot.json"
RENDEZVOUS_FILE = "rendezvous.json"


def stage_file(run_dir: str | os.PathLike[str], stage: int) -> Path:
    return Path(run_dir) / f"stage-{stage}.json"


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` as JSON so that readers see either the old or the new file, never a mix."""
    write_text_atomic(path, json.dumps(data, separators=(",", ":")))


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to a temp file, then rename it over ``path`` (atomic on POSIX)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """The parsed file, or None when it cannot be read (not written yet, being replaced; only a
    non-atomic writer makes it unparsable)."""
    try:
        return json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None


def _stage_id(name: str) -> int | None:
    if not (name.startswith("stage-") and name.endswith(".json")):
        return None
    text = name[len("stage-"):-len(".json")]
    return int(text) if text.isdigit() else None


class ParsedFiles:
    """Parsed run-dir files, parsed again only when a file changed (inode, mtime, size).

    The writers replace files whole (``os.replace``), so a changed file always has
    a new signature; between changes every reader (each scrape, each API call, the
    supervisor) gets the already-parsed model for the cost of one ``stat``.
    """

    def __init__(self) -> None:
        self._cache: dict[str, tuple[tuple[int, int, int], Any]] = {}

    def get(self, path: str, parse: Callable[[bytes], Any]) -> Any | None:
        try:
            st = os.stat(path)
        except OSError:
            self._cache.pop(path, None)
            return None
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        hit = self._cache.get(path)
        if hit is not None and hit[0] == sig:
            return hit[1]
        try:
            with open(path, "rb") as f:
                value = parse(f.read())
        except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
            value = None
        self._cache[path] = (sig, value)
        return value

    def stages(self, run_dir: str | os.PathLike[str]) -> dict[int, StageLive]:
        out: dict[int, StageLive] = {}
        try:
            entries = list(os.scandir(run_dir))
        except OSError:
            return out
        for entry in entries:
            stage = _stage_id(entry.name)
            if stage is None:
                continue
            live = self.get(entry.path, lambda b, k=stage: _parse_stage(b, k))
            if live is not None:
                out[stage] = live
        return dict(sorted(out.items()))


def _parse_stage(data: bytes, stage: int) -> StageLive:
    live = StageLive.model_validate_json(data)
    return live if live.stage == stage else live.model_copy(update={"stage": stage})


class RunDirSource:
    """What the stage processes last reported, read from the run directory on every call.

    The dashboard and ``/metrics`` (both in the parent process) read this, so they
    always show the stages' latest numbers, and a stage that died still shows the
    last numbers it reported.  Unchanged files are not parsed again (``ParsedFiles``).
    """

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir)
        self._files = ParsedFiles()
        #: Failed writes of run.json / snapshot.json by the serving parent (each retried).
        self.write_failures = 0

    def startup(self) -> StartupReport | None:
        """The startup report rank 0 wrote, or None while stages are still starting."""
        return self._files.get(str(self.run_dir / STARTUP_FILE), StartupReport.model_validate_json)

    def stages(self) -> dict[int, StageLive]:
        return self._files.stages(self.run_dir)

    def run(self) -> RunInfo | None:
        """The parent's view: phase, pids, exit codes, the failure (None before it wrote one)."""
        return self._files.get(str(self.run_dir / RUN_FILE), RunInfo.model_validate_json)

    def snapshot(self) -> dict[str, Any]:
        """One JSON document with everything: ``{"run", "startup", "stages"}`` (``snapshot.json``)."""
        run, startup = self.run(), self.startup()
        return {
            "run": run.model_dump(mode="json") if run is not None else None,
            "startup": startup.to_dict() if startup is not None else None,
            "stages": {str(k): v.model_dump(mode="json") for k, v in self.stages().items()},
        }
