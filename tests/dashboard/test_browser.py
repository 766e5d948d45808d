"""The dashboard in a real headless Chromium (selenium + chromedriver).

The preflight pages come from a real ``stagecache dashboard --from-check``
subprocess; the live tests serve a source that plays a whole run (starting,
validating, running with per-stage traffic and pipeline waits, done or failed)
and check what an operator sees: the phase badge ("live" only while the run
goes), the progress bar, windowed rates per stage with lines that differ, the
timeline's bubbles, and /docs and /redoc rendering with every host but
127.0.0.1 unresolvable.  Screenshots are checked to be real renders (many
colours, not one flat fill).  Set ``STAGECACHE_DOCS_IMG=1`` to also write them
to docs/img/ for docs/dashboard.md.  Skipped only when Chromium itself is absent.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from browser_support import (
    MARKS,
    N_LIVE_CHARTS,
    _wait,
    badge,
    cli_dashboard,
    go_running,
    js,
    load,
    network_log,
    phase_is,
    screenshot,
    severe_console_messages,
)
from dashboard_sources import (
    PP,
    RATIO,
    LateReportSource,
    ScriptedRun,
    expected_report,
)

pytestmark = MARKS


def test_preflight_page_draws_one_layer_map_per_stage(driver, free_port, tmp_path):
    from selenium.webdriver.common.by import By

    with cli_dashboard(free_port):
        load(driver, f"http://127.0.0.1:{free_port}/")
        maps = driver.find_elements(By.CSS_SELECTOR, ".layer-map.js-plotly-plot")
        assert len(maps) == PP
        assert all(m.find_elements(By.CSS_SELECTOR, ".heatmaplayer") for m in maps)
        rows = driver.find_elements(By.CSS_SELECTOR, "#stage-table tr.stage-row")
        assert [r.get_attribute("class") for r in rows] == ["stage-row ok"] * PP
        rep = expected_report([]).to_dict()
        for row, s in zip(rows, rep["stages"], strict=True):
            cells = row.find_elements(By.TAG_NAME, "td")
            assert cells[1].text == f"[{s['start_layer']}, {s['end_layer']})"
            assert cells[-1].text == "OK"
        # the empty live state, a badge that is not "live", and the polling script at work
        assert driver.page_source.count("no live data (preflight view)") >= N_LIVE_CHARTS
        assert badge(driver) == ("preflight view", "badge preflight")
        _wait(lambda: driver.execute_script("return window.stagecacheDashboard.polls") >= 1,
              timeout=15, what="the first /api/metrics/summary poll")
        assert driver.execute_script("return window.stagecacheDashboard.failures") == 0
        assert severe_console_messages(driver) == []
        screenshot(driver, "dashboard.png", tmp_path)


def test_fault_page_shows_every_error_row_and_red_pool(driver, free_port, tmp_path):
    from selenium.webdriver.common.by import By

    with cli_dashboard(free_port, "--fault", "global-swa"):
        load(driver, f"http://127.0.0.1:{free_port}/")
        assert len(driver.find_elements(By.CSS_SELECTOR, ".layer-map.js-plotly-plot")) == PP
        rows = driver.find_elements(By.CSS_SELECTOR, "#stage-table tr.stage-row.error")
        rep = expected_report(["global-swa"]).to_dict()
        assert len(rows) == PP
        for row, s in zip(rows, rep["stages"], strict=True):
            status = row.find_element(By.CSS_SELECTOR, "td.status").text
            assert status == s["errors"][0]["message"]  # the exact error text
            swa = row.find_element(By.CSS_SELECTOR, "td.pool[data-pool=swa]")
            assert "bad" in swa.get_attribute("class")
            assert swa.text == f"{rep['num_layers']} / {s['local_layers']} ✗"
        # each map draws the red band over its SWA row, and labels it
        for stage in range(PP):
            shapes = driver.execute_script(
                f"return document.getElementById('layer-map-{stage}').layout.shapes.length")
            assert shapes == 1
        labels = driver.find_element(By.ID, "layer-map-0").find_elements(By.CSS_SELECTOR, ".ytick text")
        assert any("SWA KV" in t.text and "✗" in t.text for t in labels)
        assert "stage(s) invalid" in driver.find_element(By.ID, "overall").text
        assert severe_console_messages(driver) == []
        screenshot(driver, "dashboard-fault.png", tmp_path)



def test_a_run_goes_live_shows_rates_per_stage_and_timeline_then_done(driver, free_port, tmp_path):
    from stagecache.dashboard.server import dashboard_in_thread

    source = ScriptedRun()
    with dashboard_in_thread(source, port=free_port) as url:
        go_running(driver, source, url + "/?window=3", points=3)
        hit = "document.getElementById('chart-hit-rate').data"
        polls = js(driver, "window.stagecacheDashboard.polls")
        assert js(driver, "window.stagecacheDashboard.pollMs") <= 1000  # updates at <= 1 s ...
        _wait(lambda: js(driver, "window.stagecacheDashboard.polls") - polls >= 3,  # ... and goes on
              timeout=15, what="three more polls")
        # every stage has its own line: its own data, colour, marker and dash
        traces = js(driver, f"{hit}.map(t => [t.meta.stage, t.line.color, t.marker.symbol, t.line.dash])")
        assert [t[0] for t in traces] == list(range(PP))
        # each line's newest point is its stage's own share (a point whose window held no sample,
        # on a loaded machine, is a gap: the next poll's point is read)
        _wait(lambda: all(last is not None and abs(last - RATIO[stage]) <= 0.01 for stage, last in
                          js(driver, f"{hit}.map(t => [t.meta.stage, t.y[t.y.length - 1]])")),
              timeout=15, what="each stage's newest hit-rate point to be its own share")
        assert len({t[1] for t in traces}) == PP and len({t[2] for t in traces}) == PP
        # progress bar and the timeline's bubbles: downstream stages wait, stage 0 never does
        value = js(driver, "document.getElementById('run-progress').value")
        assert 0 < value < 1 and js(driver, "document.getElementById('run-progress-box').hidden") is False
        kinds = js(driver, "Object.fromEntries(document.getElementById('chart-timeline').data"
                            ".map(t => [t.meta.kind, Array.from(new Set(t.y))]))")
        assert sorted(kinds["compute"]) == [f"stage {s}" for s in range(PP)]
        assert sorted(kinds["recv_wait"]) == [f"stage {s}" for s in range(1, PP)]
        assert js(driver, "document.getElementById('chart-timeline')._fullLayout.xaxis.type") == "date"
        # transfers: each stage's mean queue wait stacked under its DMA time, per direction
        split = js(driver, "document.getElementById('chart-transfer-split').data.map(t => t.y)")
        assert split[0][0::2] == pytest.approx([0.001 * (s + 1) for s in range(PP)], rel=0.05)
        assert split[0][1::2] == pytest.approx([0.0005] * PP, rel=0.05)
        assert split[1] == pytest.approx([0.002, 0.001] * PP, rel=0.05)
        assert severe_console_messages(driver) == []
        screenshot(driver, "dashboard-live.png", tmp_path)
        source.phase = "done"
        assert phase_is(driver, "done") and badge(driver)[1] == "badge done"
        assert js(driver, "document.getElementById('run-progress-text').textContent") == "100%"
        # the run is over: windowed rates fall to zero instead of freezing at a since-start mean
        _wait(lambda: js(driver, "document.getElementById('chart-tokens').data"
                                  ".every(t => t.y.every(v => v === 0))"),
              timeout=15, what="tokens/s to drop to zero after the run")
        assert js(driver, f"{hit}[0].y[{hit}[0].y.length - 1]") is None  # no lookups: no ratio


def test_a_failed_run_says_so_and_is_not_live(driver, free_port, tmp_path):
    from selenium.webdriver.common.by import By
    from stagecache.dashboard.server import dashboard_in_thread

    source = ScriptedRun()
    with dashboard_in_thread(source, port=free_port) as url:
        go_running(driver, source, url + "/")
        source.phase = "failed"
        phase_is(driver, "failed")
        assert badge(driver)[1] == "badge failed"
        detail = driver.find_element(By.ID, "run-detail")
        assert detail.text == "stage 2 (pid 4242) exited with code 1: boom"
        assert "error-text" in detail.get_attribute("class")
        screenshot(driver, "dashboard-failed.png", tmp_path)


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class StallingRun(ScriptedRun):
    """A run whose next answer to a request takes ``stall_s`` once ``stall`` is set: a request
    lost on the way, as the page sees it (the reader's own sampling thread is not held)."""

    stall_s = 13.0

    def __init__(self) -> None:
        super().__init__()
        self.stall = threading.Event()

    def startup(self):
        if self.stall.is_set() and _in_event_loop():
            self.stall.clear()
            time.sleep(self.stall_s)
        return super().startup()


def test_a_poll_without_an_answer_is_given_up_and_polling_goes_on(driver, free_port):
    from stagecache.dashboard.server import dashboard_in_thread

    source = StallingRun()
    with dashboard_in_thread(source, port=free_port) as url:
        go_running(driver, source, url + "/")
        source.stall.set()
        _wait(lambda: "no answer within 10 s" in js(driver, "document.getElementById('poll-state').textContent"),
              timeout=source.stall_s, what="the page to give the unanswered poll up")
        assert "badge failed" in js(driver, "document.getElementById('poll-state').className")
        failures, polls = js(driver, "window.stagecacheDashboard.failures"), js(driver, "window.stagecacheDashboard.polls")
        _wait(lambda: js(driver, "window.stagecacheDashboard.polls") > polls, timeout=15,
              what="polling to go on once the server answers again")
        assert js(driver, "window.stagecacheDashboard.failures") == failures
        assert js(driver, "document.getElementById('poll-state').textContent").startswith("updated ")


def test_api_docs_work_offline_from_the_apps_own_assets(driver, free_port):
    from selenium.webdriver.common.by import By

    base = f"http://127.0.0.1:{free_port}"
    with cli_dashboard(free_port):
        spec = httpx.get(base + "/openapi.json", timeout=10).json()
        n_ops = sum(len(ops) for ops in spec["paths"].values())
        driver.get("about:blank")
        driver.get_log("performance")
        driver.get_log("browser")
        driver.get(base + "/docs")
        _wait(lambda: len(driver.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock")) == n_ops,
              what="Swagger UI to list every operation")
        swagger = network_log(driver)
        driver.get(base + "/redoc")
        _wait(lambda: "/api/metrics/summary" in driver.find_element(By.TAG_NAME, "body").text,
              what="ReDoc to render the operations")
        redoc = network_log(driver)
        for asked, blocked in (swagger, redoc):
            foreign = {rid: u for rid, u in asked.items() if not u.startswith((base, "data:", "blob:"))}
            # nothing left this machine: anything foreign was refused by the page's CSP first
            assert all(blocked.get(rid) == "csp" for rid in foreign), (foreign, blocked)
        assert any(u.endswith("swagger-ui-bundle.js") for u in swagger[0].values())
        assert any(u.endswith("redoc.standalone.js") for u in redoc[0].values())
        console = severe_console_messages(driver)
        assert all("cdn.redoc.ly" in m for m in console), console  # only the refused attribution logo


def test_starting_page_reloads_once_the_report_arrives(driver, free_port):
    from selenium.webdriver.common.by import By
    from stagecache.dashboard.server import dashboard_in_thread

    source = LateReportSource()
    with dashboard_in_thread(source, port=free_port) as url:
        load(driver, url + "/")
        assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-status") == "starting"
        assert driver.find_elements(By.CSS_SELECTOR, ".layer-map") == []
        assert badge(driver) == ("live · starting", "badge live")
        source.ready = True
        _wait(lambda: len(driver.find_elements(By.CSS_SELECTOR, ".layer-map.js-plotly-plot")) == PP,
              timeout=20, what="the reload with the report's layer maps")
        assert len(driver.find_elements(By.CSS_SELECTOR, "tr.stage-row.error")) == PP
        assert severe_console_messages(driver) == []
