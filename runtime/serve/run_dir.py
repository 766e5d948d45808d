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
from pathlib import Path
from typing import Any

from .live import StageLive

STARTUP_FILE = "startup.json"
RUN_FILE = "run.json"
SNAPSHOT_FILE = "snapshot.json"


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
    """The parsed file, or None when it does not exist (yet)."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        # Only a non-atomic writer could cause this; treat it as "not there yet".
        return None


def read_stage_files(run_dir: str | os.PathLike[str]) -> dict[int, StageLive]:
    """Every ``stage-<k>.json`` in the directory, parsed, by stage id.

    A file that does not parse as a ``StageLive`` is skipped like a missing one:
    only a non-atomic writer (or a stranger's file) can produce it.
    """
    out: dict[int, StageLive] = {}
    for p in Path(run_dir).glob("stage-*.json"):
        try:
            stage = int(p.stem.split("-", 1)[1])
            live = StageLive.model_validate_json(p.read_bytes())
        except (ValueError, OSError):  # pydantic's ValidationError is a ValueError
            continue
        out[stage] = live.model_copy(update={"stage": stage})
    return dict(sorted(out.items()))


class RunDirSource:
    """What the stage processes last reported, read afresh from the run directory on every call.

    The dashboard and ``/metrics`` (both in the parent process) read this, so they
    always show the stages' latest numbers, and a stage that died still shows the
    last numbers it reported.  A scrape costs a few small JSON files.
    """

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir)

    def startup(self) -> dict[str, Any] | None:
        """The startup report rank 0 wrote, or None while stages are still starting."""
        data = read_json(self.run_dir / STARTUP_FILE)
        return data if isinstance(data, dict) else None

    def stages(self) -> dict[int, StageLive]:
        return read_stage_files(self.run_dir)

    def run(self) -> dict[str, Any] | None:
        """The parent's view: phase (starting/serving/done/refused/failed), pids, failure message."""
        data = read_json(self.run_dir / RUN_FILE)
        return data if isinstance(data, dict) else None

    def snapshot(self) -> dict[str, Any]:
        """One JSON document with everything: ``{"run", "startup", "stages"}`` (``snapshot.json``)."""
        return {
            "run": self.run(),
            "startup": self.startup(),
            "stages": {str(k): v.model_dump(mode="json") for k, v in self.stages().items()},
        }
