"""The probes, with Kubernetes' meanings: liveness, readiness, startup.

* ``/healthz``: this server process answers (async and I/O-free, so it is never
  queued behind the thread pool or a slow page).
* ``/readyz``: every stage process alive, startup validation passed, every
  heartbeat fresh -- the ``serve.liveness`` verdict, the same one behind
  ``stagecache_stage_up``; 503 with the reasons otherwise.
* ``/startupz``: startup validation passed (503 with every error, or starting).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from stagecache.runtime.live.liveness import Liveness, liveness_of
from stagecache.runtime.live.source import SnapshotSource
from stagecache.runtime.validation.report import StartupReport

from .models import Health, StageOk, Starting, StartupzFailed, StartupzOk


def add_probes(app: FastAPI, source: SnapshotSource, report: Callable[[], StartupReport]) -> None:
    """Register the three probes; ``report()`` raises the app's not-ready error while starting."""

    @app.get("/healthz", response_model=Health, summary="liveness: this server process answers")
    async def healthz() -> Health:
        return Health(status="ok")

    @app.get("/readyz", response_model=Liveness,
             responses={503: {"model": Liveness, "description": "not ready: the reasons and stages"}},
             summary="readiness: every stage up (process alive, maps valid, fresh heartbeat)")
    async def readyz():
        verdict = liveness_of(source, time.time())
        if verdict.ready:
            return verdict
        return JSONResponse(verdict.model_dump(mode="json"), status_code=503)

    @app.get("/startupz", response_model=StartupzOk,
             responses={503: {"model": StartupzFailed | Starting,
                              "description": "validation failed (errors listed) or still starting"}},
             summary="startup probe: 200 when every stage validated, else 503")
    async def startupz():
        rep = report()
        stages = [StageOk(stage=s.stage, ok=s.ok) for s in rep.stages]
        if rep.ok:
            return StartupzOk(status="ok", stages=stages)
        errors = rep.all_errors
        body = StartupzFailed(status="failed", stages=stages, errors=errors)
        return JSONResponse(body.model_dump(mode="json"), status_code=503)
