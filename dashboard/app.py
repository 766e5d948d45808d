"""The dashboard web app: stage table, per-stage layer maps, live charts, probes, /metrics.

Read-only by design: every route is GET, every number comes from one
``SnapshotSource`` (the same one the Prometheus collector reads), so the page,
the JSON API and ``/metrics`` cannot disagree.  The source is asked afresh on
every request -- a ``serve`` source changes under us (``None`` while stages
start, then a report, then live numbers).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError
from stagecache.exporters.snapshot import SnapshotSource
from stagecache.runtime.model.pool_kinds import KINDS, POOLS

from . import figures
from .models import (
    ErrorMessage,
    Health,
    LayerMapResponse,
    MetricsSummary,
    StageLive,
    StageOk,
    StagesResponse,
    Starting,
    StartupReportModel,
    StartupzFailed,
    StartupzOk,
)
from .view import (
    ReportShapeError,
    find_stage,
    layer_map_cells,
    parse_report,
    pool_statuses,
    stages_response,
)

HERE = Path(__file__).resolve().parent
POLL_MS = 2000
METRICS_MODULE = "stagecache.exporters.metrics"


def plotly_js_path() -> Path:
    """plotly.min.js shipped inside the installed ``plotly`` package (no CDN: machines may be offline)."""
    import plotly

    path = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
    if not path.is_file():  # pragma: no cover - a broken plotly install
        raise RuntimeError(f"plotly.min.js not found at {path}; reinstall plotly")
    return path


class NotReady(Exception):
    """The source has no startup report yet (stages still starting)."""


class SourceShapeError(Exception):
    """The source returned data that does not have the documented shape."""


def _error_body(status: str, detail: str) -> dict[str, str]:
    return {"status": status, "detail": detail}


STARTING_DETAIL = "stages are still starting: no startup report yet"
NOT_READY = {503: {"model": Starting, "description": "no startup report yet"}}
BAD_SOURCE = {502: {"model": ErrorMessage, "description": "the snapshot source returned a malformed report"}}


def _live_numbers(stages: Mapping[int, Mapping[str, Any]]) -> list[StageLive]:
    out = []
    for key in sorted(stages):
        try:
            out.append(StageLive.model_validate(stages[key]))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise SourceShapeError(
                f"stage {key}: live numbers do not match the snapshot shape "
                f"(exporters/snapshot.py): {where}: {first['msg']} ({exc.error_count()} problem(s))"
            ) from None
    return out


class _MetricsRegistry:
    """``make_registry(source)`` from the exporters, imported and built on first scrape.

    Lazy so the dashboard works (with an empty registry) in a checkout where the
    exporter module does not exist yet, and so importing the app stays cheap.
    """

    def __init__(self, source: SnapshotSource):
        self._source = source
        self._lock = threading.Lock()
        self._registry: Any = None
        self.exported = False

    def get(self) -> Any:
        with self._lock:
            if self._registry is None:
                from prometheus_client import CollectorRegistry

                try:
                    from stagecache.exporters.metrics import make_registry
                except ModuleNotFoundError as exc:
                    if exc.name != METRICS_MODULE:
                        raise
                    self._registry = CollectorRegistry()
                else:
                    self._registry = make_registry(self._source)
                    self.exported = True
            return self._registry


def create_app(source: SnapshotSource, *, title: str = "stagecache") -> FastAPI:
    """The dashboard over ``source``; mount it or run it with ``serve_dashboard``."""
    from stagecache import runtime

    app = FastAPI(
        title=title,
        version=getattr(runtime, "__version__", "0"),
        description="Read-only view of stagecache's PP stages: layer maps, pool validation, "
        "live cache numbers. Data comes from one SnapshotSource.",
    )
    app.add_middleware(GZipMiddleware, minimum_size=2048)  # plotly.min.js is ~4.8 MB raw
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    metrics = _MetricsRegistry(source)
    app.state.source = source
    app.state.metrics = metrics

    @app.exception_handler(NotReady)
    def _not_ready(request: Request, exc: NotReady) -> JSONResponse:
        return JSONResponse(_error_body("starting", STARTING_DETAIL), status_code=503)

    @app.exception_handler(SourceShapeError)
    def _bad_source(request: Request, exc: SourceShapeError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=502)

    def optional_report() -> StartupReportModel | None:
        raw = source.startup()
        if raw is None:
            return None
        try:
            return parse_report(raw)
        except ReportShapeError as exc:
            raise SourceShapeError(f"startup report from the source: {exc}") from None

    def report() -> StartupReportModel:
        rep = optional_report()
        if rep is None:
            raise NotReady()
        return rep

    def status_of(rep: StartupReportModel | None) -> str:
        if rep is None:
            return "starting"
        return "ok" if rep.ok else "failed"

    def layer_map(rep: StartupReportModel, stage: int) -> LayerMapResponse | None:
        s = find_stage(rep, stage)
        if s is None:
            return None
        pools, cells = pool_statuses(s), layer_map_cells(s)
        fig = figures.layer_map_figure(s, pools, cells)
        return LayerMapResponse(
            stage=s.stage, start_layer=s.start_layer, end_layer=s.end_layer, ok=s.ok,
            pools=pools, cells=cells, figure=figures.to_json_dict(fig),
        )

    # -- HTML -------------------------------------------------------------------------------
    @app.get("/", response_class=HTMLResponse, summary="dashboard page")
    def index(request: Request) -> HTMLResponse:
        rep = optional_report()
        live = _live_numbers(source.stages())
        stage_ids = [s.stage for s in rep.stages] if rep else [s.stage for s in live]
        now_ms = time.time() * 1000
        context = {
            "title": title,
            "status": status_of(rep),
            "report": rep,
            "stages": stages_response(rep) if rep else None,
            "pools": [(p, KINDS[p].label) for p in POOLS],
            "layer_maps": [layer_map(rep, s.stage) for s in rep.stages] if rep else [],
            "live": bool(live),
            "live_figures": {
                "hit-ratio": figures.to_json_dict(figures.hit_ratio_figure(stage_ids, now_ms, live)),
                "tokens": figures.to_json_dict(figures.tokens_figure(stage_ids, live)),
                "bandwidth": figures.to_json_dict(figures.bandwidth_figure(stage_ids, now_ms, live)),
            },
            "no_live_text": figures.NO_LIVE_TEXT,
            "poll_ms": POLL_MS,
            "n_bad_stages": sum(1 for s in rep.stages if not s.ok) if rep else 0,
            "n_errors": (sum(len(s.errors) for s in rep.stages) + len(rep.errors)) if rep else 0,
        }
        return templates.TemplateResponse(request, "index.html", context)

    @app.get("/vendor/plotly.min.js", include_in_schema=False)
    def plotly_js() -> FileResponse:
        return FileResponse(plotly_js_path(), media_type="application/javascript",
                            headers={"Cache-Control": "public, max-age=86400"})

    # -- JSON API ------------------------------------------------------------------------------
    @app.get("/api/startup", response_model=StartupReportModel, responses={**NOT_READY, **BAD_SOURCE},
             summary="the startup report (StartupReport.to_dict())")
    def api_startup() -> StartupReportModel:
        return report()

    @app.get("/api/stages", response_model=StagesResponse, responses={**NOT_READY, **BAD_SOURCE},
             summary="one row per PP stage: layer range, buffers per pool vs expected, errors")
    def api_stages() -> StagesResponse:
        return stages_response(report())

    @app.get("/api/stages/{stage}/layer-map", response_model=LayerMapResponse,
             responses={404: {"model": ErrorMessage, "description": "no such stage"},
                        **NOT_READY, **BAD_SOURCE},
             summary="a stage's layer map: cells per (pool, global layer) and the Plotly figure")
    def api_layer_map(stage: int):
        rep = report()
        out = layer_map(rep, stage)
        if out is None:
            ids = ", ".join(str(s.stage) for s in rep.stages)
            return JSONResponse(
                {"detail": f"stage {stage} does not exist; this run has stages {ids}"}, status_code=404
            )
        return out

    @app.get("/api/metrics/summary", response_model=MetricsSummary, responses=BAD_SOURCE,
             summary="every stage's live numbers now (empty list in a preflight view)")
    def api_summary() -> MetricsSummary:
        rep = optional_report()
        live = _live_numbers(source.stages())
        return MetricsSummary(status=status_of(rep), live=bool(live), time=time.time(), stages=live)

    # -- probes ----------------------------------------------------------------------------------
    @app.get("/healthz", response_model=Health, summary="liveness: the process answers")
    def healthz() -> Health:
        return Health(status="ok")

    @app.get("/startupz", response_model=StartupzOk,
             responses={503: {"model": StartupzFailed | Starting,
                              "description": "validation failed (errors listed) or still starting"},
                        **BAD_SOURCE},
             summary="startup probe: 200 when every stage validated, else 503")
    def startupz():
        rep = report()
        stages = [StageOk(stage=s.stage, ok=s.ok) for s in rep.stages]
        if rep.ok:
            return StartupzOk(status="ok", stages=stages)
        errors = [e for s in rep.stages for e in s.errors] + rep.errors
        body = StartupzFailed(status="failed", stages=stages, errors=errors)
        return JSONResponse(body.model_dump(mode="json"), status_code=503)

    @app.get("/metrics", response_class=Response, summary="Prometheus text exposition",
             responses={200: {"content": {"text/plain": {}}, "description": "metrics"}})
    def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.get()), media_type=CONTENT_TYPE_LATEST)

    return app


def make_server(
    source: SnapshotSource, host: str = "127.0.0.1", port: int = 8000, *,
    title: str = "stagecache", log_level: str = "warning",
) -> Any:
    """A ``uvicorn.Server`` for the dashboard; ``.run()`` it (any thread), set ``.should_exit`` to stop."""
    import uvicorn

    config = uvicorn.Config(create_app(source, title=title), host=host, port=port,
                            log_level=log_level, access_log=False)
    return uvicorn.Server(config)


def serve_dashboard(
    source: SnapshotSource, host: str = "127.0.0.1", port: int = 8000, *,
    title: str = "stagecache", log_level: str = "warning",
) -> None:
    """Serve the dashboard until interrupted (blocks; run it in a thread or a process)."""
    make_server(source, host, port, title=title, log_level=log_level).run()


@contextmanager
def dashboard_in_thread(
    source: SnapshotSource, host: str = "127.0.0.1", port: int = 8000, *,
    title: str = "stagecache", startup_timeout_s: float = 15.0,
) -> Iterator[str]:
    """Serve the dashboard in a daemon thread while the block runs; yields its base URL.

    For processes that already do something else in the main thread (``serve``'s
    rank 0, tests).  Startup waits are bounded; a port that cannot be bound is a
    RuntimeError naming it instead of a silently dead thread.
    """
    server = make_server(source, host, port, title=title)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except (SystemExit, Exception) as exc:  # uvicorn sys.exit()s when it cannot bind
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"stagecache-dashboard:{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            why = f" ({failure[0]!r}; uvicorn logged the cause)" if failure else ""
            raise RuntimeError(
                f"dashboard did not start on {host}:{port} within {startup_timeout_s:.0f} s{why}"
            )
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
