"""Dashboard JSON API, probes and /metrics, against real uvicorn servers on 127.0.0.1.

Every source is a real ``SnapshotSource``: ``StaticSource`` over a real
``preflight`` report (with and without faults), one with no report yet, and one
with live numbers.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from live_helpers import blank_live
from plans import report
from stagecache.dashboard.server import dashboard_in_thread
from stagecache.runtime.live.numbers import L3Live, StageLive
from stagecache.runtime.live.source import StaticSource
from stagecache.runtime.model.families.deepseek_v4 import POOLS
from stagecache.runtime.validation.report import StartupReport

PP = 4


def report_of(model: str = "tiny-v4", faults: tuple[str, ...] = ()) -> StartupReport:
    return report(model, PP, list(faults))


def report_dict(model: str = "tiny-v4", faults: tuple[str, ...] = ()) -> dict:
    """The report as ``check --json`` prints it (what the API must serve)."""
    return report_of(model, faults).to_dict()


def live_numbers(stage: int) -> StageLive:
    return StageLive.model_validate(live_dict(stage))


def live_dict(stage: int) -> dict:
    """A shape-correct live dict (empty_stage_numbers) filled with distinct numbers per stage."""
    d = blank_live(stage, POOLS)
    d.update(time=1_700_000_000.0 + stage, steps=10 + stage, requests=3 + stage, phase="serving",
             total_requests=10, stage_seconds=1.5, bubble_seconds=0.25)
    d["cache_tokens"] = {"device": 1000 * (stage + 1), "host": 200 * (stage + 1),
                         "storage": 30 * (stage + 1), "miss": 50 + stage}
    d["l3"] = L3Live(backend="mooncake", up=stage != 1, downs=int(stage == 1),
                     down_reason="mooncake master 127.0.0.1:9 unreachable (code -900)" if stage == 1 else None,
                     prefetched_tokens=256, errors={"corrupt": 0, "failed": stage, "no_space": 0}).model_dump()
    d["transfer_bytes"] = {"d2h": 4096 * (stage + 1), "h2d": 2048}
    d["transfer_seconds"] = {"d2h": 0.001, "h2d": 0.002}
    d["transfer_count"] = {"d2h": 2, "h2d": 1}
    d["page_spaces"]["device"].update(used=7, total=16)
    d["timeline"] = [{"kind": "compute", "start": 1_700_000_000.0, "seconds": 0.01, "micro_batch": 1},
                     {"kind": "recv_wait", "start": 1_700_000_000.01, "seconds": 0.002 * stage,
                      "micro_batch": 2}]
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SOURCES = {
    "ok": lambda: StaticSource(report_of()),
    "fault": lambda: StaticSource(report_of(faults=("global-swa",))),
    "ids": lambda: StaticSource(report_of("deepseek-v4-flash", ("global-compress-ids", "overlap"))),
    "starting": lambda: StaticSource(None),
    "live": lambda: StaticSource(report_of(), {s: live_numbers(s) for s in range(PP)}),
}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, httpx.Client]]:
    from contextlib import ExitStack

    with ExitStack() as stack:
        clients = {}
        for name, make in SOURCES.items():
            url = stack.enter_context(dashboard_in_thread(make(), port=_free_port()))
            clients[name] = stack.enter_context(httpx.Client(base_url=url, timeout=10))
        yield clients


# -- probes -------------------------------------------------------------------------------------


def test_healthz_answers_even_while_starting(servers):
    for name in ("ok", "fault", "starting"):
        r = servers[name].get("/healthz")
        assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_startupz_ok_lists_every_stage(servers):
    r = servers["ok"].get("/startupz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "stages": [{"stage": s, "ok": True} for s in range(PP)]}


def test_startupz_503_lists_every_error_with_expected_and_got(servers):
    r = servers["fault"].get("/startupz")
    assert r.status_code == 503
    body = r.json()
    want = [e for s in report_dict(faults=("global-swa",))["stages"] for e in s["errors"]]
    assert body["status"] == "failed"
    assert body["errors"] == want
    assert [e["pool"] for e in body["errors"]] == ["swa"] * PP
    assert body["errors"][0] == {
        "stage": 0, "pool": "swa", "expected": 3, "got": 12,
        "message": "DeepSeek V4 SWA KV pool must be PP-stage-local: got 12 buffers for 3 local layers",
    }
    assert all(not s["ok"] for s in body["stages"])


def test_startupz_includes_cross_stage_errors(servers):
    body = servers["ids"].get("/startupz").json()
    cross = [e for e in body["errors"] if e["stage"] is None]
    assert cross and cross[0]["pool"] == "partition" and "overlap" in cross[0]["message"]


def test_no_report_yet_is_503_starting_everywhere_it_matters(servers):
    c = servers["starting"]
    for path in ("/startupz", "/api/stages", "/api/startup", "/api/stages/0/layer-map"):
        r = c.get(path)
        assert r.status_code == 503, path
        assert r.json()["status"] == "starting", path
    summary = c.get("/api/metrics/summary")
    assert summary.status_code == 200
    assert summary.json()["status"] == "starting" and summary.json()["stages"] == []
    page = c.get("/")
    assert page.status_code == 200 and 'data-status="starting"' in page.text
    assert "No startup report yet" in page.text


# -- stage table and layer maps ---------------------------------------------------------------------


def test_api_stages_rows_match_the_report(servers):
    rep = report_dict()
    body = servers["ok"].get("/api/stages").json()
    assert body["ok"] and body["pp_size"] == PP and body["cross_stage_errors"] == []
    for row, s in zip(body["stages"], rep["stages"], strict=True):
        assert (row["start_layer"], row["end_layer"], row["local_layers"]) == (
            s["start_layer"], s["end_layer"], s["local_layers"])
        assert row["status"] == "OK"
        assert {p["pool"]: (p["buffers"], p["expected"]) for p in row["pools"]} == {
            p: (s["buffers"][p], s["expected_buffers"][p]) for p in POOLS}


def test_api_stages_flags_the_wrong_pool_with_the_exact_message(servers):
    body = servers["fault"].get("/api/stages").json()
    assert not body["ok"]
    for row in body["stages"]:
        bad = [p for p in row["pools"] if not p["ok"]]
        assert [p["pool"] for p in bad] == ["swa"]
        assert bad[0]["buffers"] == 12 and bad[0]["expected"] == 3
        msg = f"DeepSeek V4 SWA KV pool must be PP-stage-local: got 12 buffers for {row['local_layers']} local layers"
        assert row["status"] == msg and bad[0]["errors"] == [msg]


def test_layer_map_cells_and_figure(servers):
    rep = report_dict()
    for s in rep["stages"]:
        body = servers["ok"].get(f"/api/stages/{s['stage']}/layer-map").json()
        per_pool = {p: [c for c in body["cells"] if c["pool"] == p] for p in POOLS}
        assert {p: len(v) for p, v in per_pool.items()} == s["expected_buffers"]
        assert [c["index"] for c in per_pool["swa"]] == list(range(s["local_layers"]))
        assert all(c["error"] is None for c in body["cells"])
        heat = body["figure"]["data"][0]
        assert heat["type"] == "heatmap"
        assert heat["x"] == list(range(s["start_layer"], s["end_layer"]))
        # a cell exactly where a layer needs a buffer in the pool
        need = sum(1 for row in heat["z"] for v in row if v is not None)
        assert need == sum(s["expected_buffers"].values())
        assert body["figure"]["layout"].get("shapes", []) == []


def test_layer_map_highlights_the_bad_pool_row(servers):
    body = servers["fault"].get("/api/stages/2/layer-map").json()
    layout = body["figure"]["layout"]
    assert len(layout["shapes"]) == 1  # one red band: the SWA row (row 0)
    assert layout["shapes"][0]["y0"] == -0.5 and layout["shapes"][0]["y1"] == 0.5
    assert "✗ SWA KV 12/3" in layout["yaxis"]["ticktext"][0]
    assert "✗" not in "".join(layout["yaxis"]["ticktext"][1:])


def test_layer_map_marks_out_of_range_compress_ids_cell_by_cell(servers):
    body = servers["ids"].get("/api/stages/2/layer-map").json()
    bad = [c for c in body["cells"] if c["error"]]
    assert bad, "global compress ids on stage 2 must leave ids out of range"
    sizes = {p["pool"]: p["buffers"] for p in body["pools"]}
    for c in bad:
        assert c["index"] >= sizes[c["pool"]]
        assert c["error"] == f"index {c['index']} out of range for {sizes[c['pool']]} buffers"
    good = [c for c in body["cells"] if not c["error"]]
    assert all(c["index"] < sizes[c["pool"]] for c in good)


def test_unknown_stage_is_404_json(servers):
    for stage in (PP, 99, -1):
        r = servers["ok"].get(f"/api/stages/{stage}/layer-map")
        assert r.status_code == 404
        assert r.json() == {"detail": f"stage {stage} does not exist; this run has stages 0, 1, 2, 3"}
    assert servers["ok"].get("/api/stages/abc/layer-map").status_code == 422
    assert servers["ok"].get("/api/nope").status_code == 404


def test_no_write_endpoints(servers):
    c = servers["ok"]
    paths = ["/", "/api/stages", "/api/stages/0/layer-map", "/api/metrics/summary", "/api/startup",
             "/healthz", "/startupz", "/metrics"]
    for path in paths:
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            r = c.request(method, path)
            assert r.status_code == 405, (method, path)
            assert "GET" in r.headers["allow"]
    spec = c.get("/openapi.json").json()
    assert {m for ops in spec["paths"].values() for m in ops} == {"get"}


# -- live numbers ------------------------------------------------------------------------------------


def test_the_page_shows_each_stages_l3_health(servers):
    page = servers["live"].get("/").text
    assert 'id="l3-table"' in page
    rows = page.split('class="l3-row"')[1:]
    assert len(rows) == PP
    assert 'class="l3-state warn">down' in rows[1] and "unreachable (code -900)" in rows[1]
    assert 'class="l3-state ok">up' in rows[0] and ">mooncake<" in rows[0]


def test_summary_is_empty_in_a_preflight_view(servers):
    body = servers["fault"].get("/api/metrics/summary").json()
    assert body["has_live_numbers"] is False and body["stages"] == [] and body["status"] == "failed"
    assert body["run"]["phase"] == "preflight" and body["run"]["live"] is False
    assert body["rates"] == []


def test_summary_returns_every_stage_numbers_unchanged(servers):
    body = servers["live"].get("/api/metrics/summary").json()
    assert body["has_live_numbers"] is True and body["status"] == "ok"
    assert body["stages"] == [live_numbers(s).model_dump(mode="json") for s in range(PP)]
    assert body["run"] == {"phase": "running", "live": True, "detail": "3/10 requests",
                           "requests_done": 3, "requests_planned": 10, "progress": 0.3,
                           "finished_at": None}


def test_summary_rates_are_windowed_and_validated(servers):
    c = servers["live"]
    body = c.get("/api/metrics/summary", params={"window": 30}).json()
    assert body["window_s"] == 30
    assert [r["stage"] for r in body["rates"]] == list(range(PP))
    # constant counters: rates over the window are zero, ratios have nothing to divide
    time.sleep(0.3)
    rates = c.get("/api/metrics/summary", params={"window": 30}).json()["rates"]
    assert all(r["lookup_tokens_per_s"] == 0 and r["host_hit_rate"] is None for r in rates)
    for bad in ("0", "301", "x"):
        assert c.get("/api/metrics/summary", params={"window": bad}).status_code == 422


def test_live_page_embeds_current_points(servers):
    page = servers["live"].get("/")
    assert 'data-phase="running"' in page.text and "live · running" in page.text
    assert "no live data (preflight view)" not in page.text


def test_preflight_page_is_never_live(servers):
    page = servers["fault"].get("/").text
    assert 'data-phase="preflight"' in page and "preflight view" in page and "live ·" not in page


# -- HTML, static assets, /metrics ---------------------------------------------------------------------


def test_index_has_table_maps_and_error_text(servers):
    page = servers["fault"].get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.text.count('class="layer-map"') == PP
    assert page.text.count('class="stage-row error"') == PP
    assert "DeepSeek V4 SWA KV pool must be PP-stage-local: got 12 buffers for 3 local layers" in page.text
    assert "no live data (preflight view)" in page.text
    ok = servers["ok"].get("/").text
    assert ok.count('class="stage-row ok"') == PP and "stage-row error" not in ok


def test_plotly_js_is_served_locally_from_the_plotly_package(servers):
    import plotly

    r = servers["ok"].get("/vendor/plotly.min.js")
    assert r.status_code == 200 and "javascript" in r.headers["content-type"]
    assert len(r.content) > 1_000_000 and b"plotly.js" in r.content[:2000]
    assert plotly.__version__ and "cdn" not in servers["ok"].get("/").text.lower()
    assert servers["ok"].get("/static/dashboard.js").status_code == 200


def test_metrics_is_prometheus_text(servers):
    from prometheus_client.parser import text_string_to_metric_families

    r = servers["live"].get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(r.text)}  # raises on a bad format
    assert {"stagecache_requests", "stagecache_build_info", "stagecache_model_info"} <= names
    # the prometheus-client default collectors of the serving process, beside ours
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds",
            "process_start_time_seconds", "python_info", "python_gc_collections"} <= names, names
    assert len([n for n in names if n.startswith(("process_", "python_"))]) >= 8


def test_process_metrics_are_read_at_every_scrape(servers):
    """The stagecache families come from a cache while the run directory is unchanged; the
    process's own CPU seconds must not (a cached body would freeze them)."""
    import time

    from prometheus_client.parser import text_string_to_metric_families

    def cpu() -> float:
        text = servers["live"].get("/metrics").text
        (fam,) = [f for f in text_string_to_metric_families(text) if f.name == "process_cpu_seconds"]
        return fam.samples[0].value

    first = cpu()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # burn 0.3 s of this process's CPU (the server's own)
        pass
    assert cpu() >= first + 0.2


def test_metrics_speaks_openmetrics_when_asked(servers):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    r = servers["live"].get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    types = {f.name: f.type for f in text_string_to_metric_families(r.text)}  # one # EOF, at the end
    assert types["stagecache_build"] == "info" and types["stagecache_stage_phase"] == "stateset"
    assert types["process_cpu_seconds"] == "counter" and types["python_info"] == "gauge"
    assert r.text.count("# EOF") == 1 and r.text.endswith("# EOF\n")


def test_api_docs_are_served_offline_from_the_app(servers):
    """/docs and /redoc load Swagger UI / ReDoc from this server only (fastapi-offline's files)."""
    import re

    c = servers["ok"]
    for page, assets in (("/docs", ("swagger-ui-bundle.js", "swagger-ui.css")),
                         ("/redoc", ("redoc.standalone.js",))):
        html = c.get(page).text
        urls = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert urls and all(not u.startswith(("http:", "https:", "//")) for u in urls), urls
        for name in assets:
            (url,) = [u for u in urls if u.endswith(name)]
            r = c.get(url)
            assert r.status_code == 200 and len(r.content) > 100_000, url
    assert "fonts.googleapis" not in c.get("/redoc").text


def test_busy_port_is_a_clear_error(free_port):
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port))
        s.listen()
        with pytest.raises(RuntimeError, match=f"did not start on 127.0.0.1:{free_port}"), \
                dashboard_in_thread(StaticSource(None), port=free_port, startup_timeout_s=5):
            pass
