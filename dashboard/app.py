"""The dashboard web app: stage table, per-stage layer maps, live charts, probes, /metrics.

Read-only by design: every route is GET, every number comes from one
``SnapshotSource`` (the same one the Prometheus collector reads), so the page,
the JSON API and ``/metrics`` cannot disagree.  The source is asked afresh on
every request (``reader.Reader``) -- a ``serve`` source changes under us
(``None`` while stages start, then a report, then live numbers) -- and each
read feeds the rate history the charts plot.  /docs and /redoc are FastAPI's
own pages over the Swagger UI and ReDoc files that the ``fastapi-offline``
package ships, served from this app: they work without any network.
"""

from __future__ import annotations

import html
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from fastapi_offline import FastAPIOffline
from prometheus_client.exposition import choose_encoder
from stagecache.exporters.metrics import make_registry, process_registry
from stagecache.runtime.live.liveness import liveness_of
from stagecache.runtime.live.numbers import StageLive
from stagecache.runtime.live.source import SnapshotSource
from stagecache.runtime.model.families import family_named
from stagecache.runtime.validation.report import StartupReport

from . import figures, insight_figures, l3_view, live_figures, occupancy_figures
from .advise_models import AdviseReport
from .advise_page import add_advise_routes
from .caching import same_state, source_state
from .models import (
    ErrorMessage,
    LayerMapResponse,
    MetricsSummary,
    StagesResponse,
    Starting,
)
from .probes import add_probes
from .rates import DEFAULT_WINDOW_S, MAX_WINDOW_S
from .reader import STARTING_DETAIL, NotReady, Reader, status_of
from .view import (
    layer_map_cells,
    pool_label,
    pool_statuses,
    stage_pools,
    stages_response,
)

HERE = Path(__file__).resolve().parent
POLL_MS = 1000  # the page polls /api/metrics/summary this often
DOCS_ASSETS = "/vendor/docs"  # Swagger UI / ReDoc files of the fastapi-offline package
DOCS_URL, REDOC_URL = "/docs", "/redoc"
NOT_READY = {503: {"model": Starting, "description": "no startup report yet"}}
Window = Annotated[float, Query(ge=1, le=MAX_WINDOW_S, description="rate window, seconds")]


def plotly_js_path() -> Path:
    """plotly.min.js shipped inside the installed ``plotly`` package (no CDN: machines may be offline)."""
    import plotly

    path = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
    if not path.is_file():  # pragma: no cover - a broken plotly install
        raise RuntimeError(f"plotly.min.js not found at {path}; reinstall plotly")
    return path


def layer_map(reader: Reader, rep: StartupReport, stage: int) -> LayerMapResponse | None:
    """Drawn once per report and stage (a Plotly figure costs ~10 ms; a report never changes)."""
    return reader.derived.get(rep, ("layer-map", stage), lambda: build_layer_map(rep, stage))


def build_layer_map(rep: StartupReport, stage: int) -> LayerMapResponse | None:
    s = rep.stage(stage)
    if s is None:
        return None
    pools, cells = pool_statuses(s), layer_map_cells(s)
    fig = figures.layer_map_figure(s, pools, cells, family_named(rep.family))
    return LayerMapResponse(
        stage=s.stage, start_layer=s.start, end_layer=s.end, ok=s.ok,
        pools=pools, cells=cells, figure=figures.to_json_dict(fig),
    )


def capacity_rows(live: list[StageLive]) -> list[dict[str, Any]]:
    """The capacity ledger (sglang deployments): each stage alone, the deployment's minimum and
    the HBM it strands; empty when no stage knows its capacity."""
    if not any(s.capacity.tokens for s in live):
        return []
    limit = min((s.capacity.tokens_alone for s in live if s.capacity.tokens_alone), default=0)
    return [{"stage": s.stage, "alone": s.capacity.tokens_alone, "tokens": s.capacity.tokens,
             "used": _gib(s.capacity.used_bytes), "stranded": _gib(s.capacity.stranded_bytes),
             "limits": bool(s.capacity.tokens_alone) and s.capacity.tokens_alone == limit}
            for s in sorted(live, key=lambda s: s.stage)]


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):.1f} MiB"


def page_context(reader: Reader, title: str, window_s: float) -> dict[str, Any]:
    """Everything index.html renders; the live charts start with the rate history so far."""
    rep = reader.source.startup()
    live = reader.stages()
    stage_ids = [s.stage for s in rep.stages] if rep else [s.stage for s in live]
    history = reader.history
    series = history.series(window_s)
    figs = live_figures.live_figures(stage_ids, live, history.rates(window_s), series, window_s)
    figs["miss-reasons"] = insight_figures.miss_reasons_figure(stage_ids, series, window_s, bool(live))
    first = rep.stages[0] if rep and rep.stages else None
    pools = stage_pools(first) if first is not None else []
    liveness = liveness_of(reader.source, time.time())
    return {
        "title": title,
        "status": status_of(rep),
        "run": reader.run_state(rep, live),
        "report": rep,
        "stages": stages_response(rep) if rep else None,
        "pools": [(p, pool_label(first, p)) for p in pools],
        "layer_maps": [layer_map(reader, rep, s.stage) for s in rep.stages] if rep else [],
        "has_live_numbers": bool(live),
        "live_figures": {key: figures.to_json_dict(fig) for key, fig in figs.items()},
        # host-tier status and pool occupancy (their own section; static/occupancy.js updates them)
        "occupancy_figure": figures.to_json_dict(occupancy_figures.occupancy_figure(
            stage_ids, live, first.kinds if first is not None else ())),
        "host_tiers": occupancy_figures.host_tier_rows(stage_ids, live),
        "l3_rows": l3_view.l3_rows(stage_ids, live),
        "capacity_rows": capacity_rows(live),
        # stage agreement (static/insight.js updates it); the miss-reasons chart is in live_figures
        "agreement": _agreement(reader.source, live, liveness),
        "poll_ms": POLL_MS,
        "window_s": window_s,
        "n_bad_stages": sum(1 for s in rep.stages if not s.ok) if rep else 0,
        "n_errors": len(rep.all_errors) if rep else 0,
        "liveness": liveness,
        "failed_at_text": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(liveness.failed_at))
        if liveness.failed_at else "?",
    }


def add_page_routes(app: FastAPI, reader: Reader, title: str) -> None:
    templates = Jinja2Templates(directory=str(HERE / "templates"))

    @app.get("/", response_class=HTMLResponse, summary="dashboard page")
    def index(request: Request, window: Window = DEFAULT_WINDOW_S) -> HTMLResponse:
        return templates.TemplateResponse(request, "index.html", page_context(reader, title, window))

    @app.get("/vendor/plotly.min.js", include_in_schema=False)
    def plotly_js() -> FileResponse:
        return FileResponse(plotly_js_path(), media_type="application/javascript",
                            headers={"Cache-Control": "public, max-age=86400"})


def add_api_routes(app: FastAPI, reader: Reader) -> None:
    @app.get("/api/startup", response_model=StartupReport, response_model_by_alias=True,
             responses=NOT_READY, summary="the startup report (`stagecache check --json`)")
    async def api_startup() -> StartupReport:
        return reader.report()

    @app.get("/api/stages", response_model=StagesResponse, responses=NOT_READY,
             summary="one row per PP stage: layer range, buffers per pool vs expected, errors")
    async def api_stages() -> StagesResponse:
        return stages_response(reader.report())

    @app.get("/api/stages/{stage}/layer-map", response_model=LayerMapResponse,
             responses={404: {"model": ErrorMessage, "description": "no such stage"},
                        **NOT_READY},
             summary="a stage's layer map: cells per (pool, global layer) and the Plotly figure")
    async def api_layer_map(stage: int):
        rep = reader.report()
        out = layer_map(reader, rep, stage)
        if out is None:
            ids = ", ".join(str(s.stage) for s in rep.stages)
            return JSONResponse(
                {"detail": f"stage {stage} does not exist; this run has stages {ids}"}, status_code=404
            )
        return out

    @app.get("/api/metrics/summary", response_model=MetricsSummary,
             summary="the run's phase and progress, each stage's counters now and their rates "
                     "over the last `window` seconds (no stages in a preflight view)")
    async def api_summary(window: Window = DEFAULT_WINDOW_S) -> MetricsSummary:
        return reader.summary(window)


def add_metrics_route(app: FastAPI, source: SnapshotSource) -> None:
    """/metrics: prometheus-client's registry and encoder (text or OpenMetrics, by Accept).

    The stagecache families are rendered again only when what they show can have changed:
    while the source hands out the same objects (``RunDirSource`` does until a file changes)
    and every stage keeps its up/down verdict, the last rendering is still exact.  The
    process's own ``process_*`` / ``python_*`` families follow, read fresh on every scrape
    (the OpenMetrics ``# EOF`` line ends the whole body, once).
    """
    registry = make_registry(source)
    process = process_registry()
    rendered: dict[str, tuple[Any, bytes]] = {}

    def ours(encoder: Any, content_type: str) -> bytes:
        key = source_state(source)
        last = rendered.get(content_type)
        if key is not None and last is not None and same_state(last[0], key):
            return last[1]
        body = encoder(registry)
        if key is not None:
            rendered[content_type] = (key, body)
        return body

    def render(encoder: Any, content_type: str) -> bytes:
        return ours(encoder, content_type).removesuffix(b"# EOF\n") + encoder(process)

    @app.get("/metrics", response_class=Response, summary="Prometheus exposition",
             responses={200: {"content": {"text/plain": {}, "application/openmetrics-text": {}},
                              "description": "metrics"}})
    async def prometheus_metrics(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(render(encoder, content_type), media_type=content_type)


#: /docs and /redoc may load from this server only.  ReDoc's bundle still asks for its
#: attribution logo on cdn.redoc.ly; the browser blocks that before it reaches the network.
DOCS_CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
            "script-src 'self' 'unsafe-inline'; worker-src 'self' blob:; connect-src 'self'")


def add_docs_pages(app: FastAPI) -> None:
    """/docs and /redoc over the fastapi-offline files, with the title HTML-escaped (FastAPI puts
    it into ``<title>`` as it is, and the title holds the model's name: a config's path), served
    with ``DOCS_CSP``."""
    title = html.escape(app.title)
    favicon = "static/favicon.svg"

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{title} - Swagger UI",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css", swagger_favicon_url=favicon,
            swagger_ui_parameters=app.swagger_ui_parameters)

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=app.openapi_url or "/openapi.json",
                              title=f"{title} - ReDoc",
                              redoc_js_url=f"{DOCS_ASSETS}/redoc.standalone.js",
                              with_google_fonts=False, redoc_favicon_url=favicon)

    @app.middleware("http")  # added after the gzip middleware, so it is the outer one
    async def same_origin_docs(request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        if request.url.path in (DOCS_URL, REDOC_URL):
            response.headers["Content-Security-Policy"] = DOCS_CSP
        return response


def _watching(reader: Reader) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the reader judges the stages while the server runs, and stops with it
    (a stopped dashboard leaves no thread reading its source)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reader.watch()
        try:
            yield
        finally:
            reader.stop_watching()

    return lifespan


def create_app(source: SnapshotSource, *, title: str = "stagecache",
               advise: AdviseReport | None = None) -> FastAPI:
    """The dashboard over ``source`` (and a saved advise report: ``/advise``); mount it or run it
    with ``serve_dashboard``.  Its lifespan runs the reader's watch (gaps recorded while nobody
    polls); a host app that mounts it enters ``app.router.lifespan_context`` for that."""
    from stagecache import runtime

    reader = Reader(source)
    app: FastAPI = FastAPIOffline(
        title=title,
        version=getattr(runtime, "__version__", "0"),
        description="Read-only view of stagecache's PP stages: layer maps, pool validation, "
        "live cache numbers. Data comes from one SnapshotSource.",
        docs_url=None, redoc_url=None, static_url=DOCS_ASSETS,  # the pages: add_docs_pages
        swagger_ui_parameters={"validatorUrl": None},  # never call the online spec validator
        lifespan=_watching(reader),
    )
    app.add_middleware(GZipMiddleware, minimum_size=2048)  # plotly.min.js is ~4.8 MB raw
    add_docs_pages(app)
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    app.state.source = source
    app.state.reader = reader
    @app.exception_handler(NotReady)
    async def _not_ready(request: Request, exc: NotReady) -> JSONResponse:
        return JSONResponse({"status": "starting", "detail": STARTING_DETAIL}, status_code=503)

    add_page_routes(app, reader, title)
    add_api_routes(app, reader)
    add_advise_routes(app, advise, title)

    add_probes(app, source, reader.report)
    add_metrics_route(app, source)
    return app


def _agreement(source: Any, live: Any, liveness: Any) -> dict[str, Any]:
    """The stage-agreement panel; on the sglang endpoint the PP ranks' live agreement
    (``divergence()``), whose strict setting makes any divergence fail /readyz."""
    divergence = getattr(source, "divergence", None)
    d = divergence() if callable(divergence) else None
    limit = 0 if d is not None and getattr(source, "strict_agreement", False) else liveness.max_disagreements
    return insight_figures.agreement_view(live, limit, d)
