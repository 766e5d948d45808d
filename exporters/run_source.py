"""A ``SnapshotSource`` over a ``serve`` run directory: what the stage processes last reported.

Stage processes each rewrite ``stage-<k>.json`` atomically; rank 0 writes
``startup.json``; the serve parent writes ``run.json``.  This source just reads
those files on every call, so the dashboard and ``/metrics`` (both in the
parent process) always show the stages' latest numbers, and a stage that died
still shows the last numbers it reported.  Reading is a few small JSON files
per scrape -- cheap next to a Prometheus scrape interval.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from stagecache.runtime.serve import run_dir as rd

from .snapshot import empty_stage_numbers


def _merge(base: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """``got`` over ``base`` one level deep, so a partial stage file still has every key."""
    out = dict(base)
    for key, value in got.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged = dict(base[key])
            merged.update(value)
            out[key] = merged
        else:
            out[key] = value
    return out


class RunDirSource:
    """Reads a run directory; implements ``SnapshotSource`` (``startup()``, ``stages()``) plus ``run()``."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir)

    def startup(self) -> dict[str, Any] | None:
        data = rd.read_json(self.run_dir / rd.STARTUP_FILE)
        return data if isinstance(data, dict) else None

    def stages(self) -> dict[int, dict[str, Any]]:
        out = {}
        for stage, data in rd.read_stage_files(self.run_dir).items():
            out[stage] = _merge(empty_stage_numbers(stage, ()), data)
            out[stage]["stage"] = stage
        return out

    def run(self) -> dict[str, Any] | None:
        """The parent's view: phase (starting/serving/done/refused/failed), pids, failure message."""
        data = rd.read_json(self.run_dir / rd.RUN_FILE)
        return data if isinstance(data, dict) else None

    def snapshot(self) -> dict[str, Any]:
        """One JSON document with everything: ``{"run", "startup", "stages"}`` (``snapshot.json``)."""
        return {
            "run": self.run(),
            "startup": self.startup(),
            "stages": {str(k): v for k, v in self.stages().items()},
        }


__all__ = ["RunDirSource"]
