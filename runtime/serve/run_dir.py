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

STARTUP_FILE = "startup.json"
RUN_FILE = "run.json"
SNAPSHOT_FILE = "snapshot.json"


def stage_file(run_dir: str | os.PathLike[str], stage: int) -> Path:
    return Path(run_dir) / f"stage-{stage}.json"


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write ``data`` as JSON so that readers see either the old or the new file, never a mix."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, separators=(",", ":"))
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


def read_stage_files(run_dir: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """Every ``stage-<k>.json`` in the directory, by stage id."""
    out: dict[int, dict[str, Any]] = {}
    for p in Path(run_dir).glob("stage-*.json"):
        try:
            stage = int(p.stem.split("-", 1)[1])
        except ValueError:
            continue
        data = read_json(p)
        if isinstance(data, dict):
            out[stage] = data
    return dict(sorted(out.items()))
