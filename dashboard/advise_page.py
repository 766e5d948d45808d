"""``/advise`` and ``/api/advise``: a saved advise report, as a page and as JSON.

The report is what ``stagecache advise --json`` printed, given to the dashboard
with ``stagecache dashboard --advise FILE`` and checked once at startup
(``advise_models.AdviseReport``); it never changes while the app runs, so the
figure is drawn once.  Without a report both routes say how to get one (404).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError
from stagecache.runtime.bounded_io import read_bounded_json
from stagecache.runtime.errors import ConfigError

from .advise_figures import GIB, figure_json, policy_figure_json
from .advise_models import AdviseReport, AdviseResponse
from .models import ErrorMessage

HERE = Path(__file__).resolve().parent
#: A report of a 4096-stage plan with every curve point is a few MB; anything larger is refused.
MAX_ADVISE_BYTES = 32 << 20
NO_REPORT = ("no advise report: start the dashboard with --advise FILE, FILE being what "
             "`stagecache advise --trace TRACE ... --json` printed")


def load_advise_report(path: Path) -> AdviseReport:
    """A saved ``stagecache advise --json`` report, checked: one ConfigError line otherwise."""
    raw = read_bounded_json(path, MAX_ADVISE_BYTES, f"--advise {path}",
                            "a `stagecache advise --json` report")
    try:
        return AdviseReport.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the report"
        raise ConfigError(f"--advise {path}: not an advise report: {where}: {first['msg']} "
                          "(expected `stagecache advise --json` output)") from None


def page_rows(report: AdviseReport) -> list[dict[str, Any]]:
    """Per stage, the GiB of each target on both tiers (the page's table)."""
    return [{"stage": s.stage, "layers": f"[{s.start_layer}, {s.end_layer})",
             "kib_per_page": s.token_page_bytes / 1024,
             "host": [t.host_bytes / GIB for t in s.targets],
             "device": [t.device_bytes / GIB for t in s.targets],
             "configured": s.configured.host_bytes / GIB} for s in report.stages]


def add_advise_routes(app: FastAPI, report: AdviseReport | None, title: str) -> None:
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    figure = figure_json(report) if report is not None else None
    pfigure = policy_figure_json(report) if report is not None else None
    missing = {404: {"model": ErrorMessage, "description": "the dashboard was started without --advise"}}

    @app.get("/api/advise", response_model=AdviseResponse, responses=missing,
             summary="the advise report given with --advise, and its Plotly figure (hit rate vs "
                     "host GiB per stage)")
    async def api_advise():
        if report is None:
            return JSONResponse({"detail": NO_REPORT}, status_code=404)
        return AdviseResponse(report=report, figure=figure, policy_figure=pfigure)

    @app.get("/advise", response_class=HTMLResponse, summary="advise page: memory per stage",
             responses={404: {"content": {"text/html": {}},
                              "description": "the dashboard was started without --advise"}})
    def advise_page(request: Request) -> HTMLResponse:
        context = {"title": title, "report": report, "figure": figure, "missing": NO_REPORT,
                   "rows": page_rows(report) if report is not None else [],
                   "policy_figure": pfigure, "gib": GIB}
        return templates.TemplateResponse(request, "advise.html", context,
                                          status_code=200 if report is not None else 404)
