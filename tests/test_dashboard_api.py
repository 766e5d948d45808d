"""Dashboard JSON API, probes and /metrics, against real uvicorn servers on 127.0.0.1.

Every source is a real ``SnapshotSource``: ``StaticSource`` over a real
``preflight`` report (with and without faults), one with no report yet, one
with shape-correct live numbers, and deliberately malformed ones.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from stagecache.dashboard.app import dashboard_in_thread
from stagecache.exporters.snapshot import StaticSource, empty_stage_numbers
from stagecache.runtime.cli.main import main
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.model.pool_kinds import POOLS
from stagecache.runtime.model.spec import load_spec
from stagecache.runtime.validation.faults import parse_faults
from stagecache.runtime.validation.report import preflight

PP = 4


def report_dict(model: str = "tiny-v4", faults: tuple[str, ...] = ()) -> dict:
    layout = build_layout(load_spec(model), PP)
    return preflight(layout, 256, parse_faults(list(faults), PP)).to_dict()


def live_numbers(stage: int) -> dict:
    """A shape-correct live dict (empty_stage_numbers) filled with distinct numbers per stage."""
    d = empty_stage_numbers(stage, POOLS)
    d.update(time=1_700_000_000.0 + stage, steps=10 + stage, requests=3 + stage,
             host_hit_ratio=0.25 * (stage % 4), stage_seconds=1.5, bubble_seconds=0.25)
    d["cache_tokens"] = {"device": 1000 * (stage + 1), "host": 200 * (stage + 1), "miss": 50 + stage}
    d["transfer_bytes"] = {"d2h": 4096 * (stage + 1), "h2d": 2048}
    d["transfer_seconds"] = {"d2h": 0.001, "h2d": 0.002}
    d["transfer_count"] = {"d2h": 2, "h2d": 1}
    d["bandwidth_bytes_per_second"] = {"d2h": 4.0e9 * (stage + 1), "h2d": 1.0e9}
    d["pool_pages"]["swa"] = {"used": 7, "free": 9}
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SOURCES = {
    "ok": lambda: StaticSource(report_dict()),
    "fault": lambda: StaticSource(report_dict(faults=("global-swa",))),
    "ids": lambda: StaticSource(report_dict("deepseek-v4-flash", ("global-compress-ids", "overlap"))),
    "starting": lambda: StaticSource(None),
    "live": lambda: StaticSource(report_dict(), {s: live_numbers(s) for s in range(PP)}),
    "bad-live": lambda: StaticSource(report_dict(), {0: live_numbers(0), 1: {"stage": 1, "time": 0.0}}),
    "bad-report": lambda: StaticSource({"ok": True, "model": "x"}),
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


def test_summary_is_empty_in_a_preflight_view(servers):
    body = servers["fault"].get("/api/metrics/summary").json()
    assert body["live"] is False and body["stages"] == [] and body["status"] == "failed"


def test_summary_returns_every_stage_numbers_unchanged(servers):
    body = servers["live"].get("/api/metrics/summary").json()
    assert body["live"] is True and body["status"] == "ok"
    assert body["stages"] == [live_numbers(s) for s in range(PP)]


def test_malformed_source_data_is_502_naming_the_stage_and_field(servers):
    r = servers["bad-live"].get("/api/metrics/summary")
    assert r.status_code == 502
    assert r.json()["detail"].startswith("stage 1: live numbers do not match the snapshot shape")
    r = servers["bad-report"].get("/api/stages")
    assert r.status_code == 502
    assert "startup report from the source: not a startup report" in r.json()["detail"]
    assert "num_layers: Field required" in r.json()["detail"]


def test_live_page_embeds_current_points(servers):
    page = servers["live"].get("/")
    assert 'data-live="true"' in page.text
    assert "no live data (preflight view)" not in page.text


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
    list(text_string_to_metric_families(r.text))  # raises on anything but the text format


def test_metrics_falls_back_to_an_empty_registry_without_the_exporter(monkeypatch, free_port):
    # Simulate a checkout without exporters/metrics.py: the import machinery refuses the module.
    monkeypatch.setitem(sys.modules, "stagecache.exporters.metrics", None)
    with dashboard_in_thread(StaticSource(report_dict()), port=free_port) as url:
        r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.text == ""


@pytest.mark.skipif(importlib.util.find_spec("stagecache.exporters.metrics") is None,
                    reason="exporters/metrics.py not written yet")
def test_metrics_uses_make_registry_when_the_exporter_exists(free_port):
    source = StaticSource(report_dict(), {s: live_numbers(s) for s in range(PP)})
    with dashboard_in_thread(source, port=free_port) as url:
        r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.text.strip()


def test_busy_port_is_a_clear_error(free_port):
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port))
        s.listen()
        with pytest.raises(RuntimeError, match=f"did not start on 127.0.0.1:{free_port}"), \
                dashboard_in_thread(StaticSource(None), port=free_port, startup_timeout_s=5):
            pass


# -- the CLI ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--from-json", "/nonexistent/report.json"], "cannot read"),
    (["--from-check"], "--from-check needs --model"),
    (["--from-check", "--model", "tiny-v4", "--pp-size", "4", "--fault", "nope"], "unknown --fault 'nope'"),
    (["--from-check", "--model", "no-such-model"], "no-such-model"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(["dashboard", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err


def test_cli_rejects_json_that_is_not_a_report(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["dashboard", "--from-json", str(bad)]) == 2
    assert "not JSON (line 1" in capsys.readouterr().err
    bad.write_text(json.dumps({"ok": True, "stages": []}))
    assert main(["dashboard", "--from-json", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not a startup report: model: Field required" in err and len(err.strip().splitlines()) == 1
    good = tmp_path / "good.json"
    good.write_text(json.dumps(report_dict()))
    assert main(["dashboard", "--from-json", str(good), "--model", "tiny-v4"]) == 2
    assert "--from-json takes model" in capsys.readouterr().err


def test_cli_busy_port_is_exit_2(free_port, tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(report_dict()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port))
        s.listen()
        assert main(["dashboard", "--from-json", str(good), "--port", str(free_port)]) == 2
    assert f"cannot listen on 127.0.0.1:{free_port}" in capsys.readouterr().err


def test_cli_from_json_serves_a_saved_check_report(tmp_path, free_port):
    """`stagecache check --json` output, saved, then served by a real `stagecache dashboard` process."""
    check = subprocess.run(
        [sys.executable, "-m", "stagecache.runtime", "check", "--model", "tiny-v4", "--pp-size", "4",
         "--fault", "missing-c4-state", "--json"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 1, check.stderr
    saved = tmp_path / "check.json"
    saved.write_text(check.stdout)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stagecache.runtime", "dashboard", "--from-json", str(saved),
         "--port", str(free_port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{free_port}/" in line and "MAPPING ERRORS" in line
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{free_port}/api/stages", timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "dashboard did not start"
                time.sleep(0.1)
        body = r.json()
        assert body["faults"] == ["missing-c4-state"]
        bad = {(row["stage"], p["pool"]) for row in body["stages"] for p in row["pools"] if not p["ok"]}
        assert bad == {(1, "c4_state"), (2, "c4_state"), (3, "c4_state")}
        assert any("state_pools must not contain None" in row["status"] for row in body["stages"])
    finally:
        proc.terminate()
        proc.wait(timeout=10)
