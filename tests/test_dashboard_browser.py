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

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dashboard_sources import (
    MODEL,
    PP,
    RATIO,
    SKEWED_STAGE,
    LateReportSource,
    ScriptedRun,
    expected_report,
)

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,1000",
                # offline: every name but the loopback fails to resolve, so a CDN can never load
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1")
N_LIVE_CHARTS = 7  # hit rate, tokens, transfer, bubble, transfer split, timeline, miss reasons

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (tests/setup.d installs it)"),
]


@pytest.fixture(scope="module")
def driver() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    assert os.path.exists(driver_path), "chromium is installed but chromedriver is not (apt: chromium-driver)"
    profile = tempfile.mkdtemp(prefix="stagecache-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in CHROME_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    drv = webdriver.Chrome(options=opts, service=Service(driver_path))
    drv.set_page_load_timeout(60)
    try:
        yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def start_cli_dashboard(port: int, *extra: str) -> subprocess.Popen:
    """``stagecache dashboard --from-check`` as a real process; returns once /healthz answers."""
    cmd = [sys.executable, "-m", "stagecache.runtime", "dashboard", "--from-check", "--model", MODEL,
           "--pp-size", str(PP), "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    assert f"http://127.0.0.1:{port}/" in line, line

    def up() -> bool:
        assert proc.poll() is None, f"dashboard exited: {proc.stdout.read()}"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    _wait(up, what="the dashboard process")
    return proc


def load(driver, url: str) -> None:
    from selenium.webdriver.common.by import By

    driver.get("about:blank")  # stop the previous page's polling, then drop its console lines
    driver.get_log("browser")
    driver.get_log("performance")
    driver.set_window_size(1400, 1000)
    driver.get(url)
    _wait(lambda: len(driver.find_elements(By.CSS_SELECTOR, ".live-chart.js-plotly-plot")) == N_LIVE_CHARTS,
          what="the live charts to render")


def screenshot(driver, name: str, tmp_path: Path) -> bytes:
    """Full-page PNG; asserted to be a real render, optionally copied to docs/img."""
    from PIL import Image, ImageStat

    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, height + 150)
    time.sleep(0.5)  # let plotly's responsive relayout settle after the resize
    png = driver.get_screenshot_as_png()
    img = Image.open(io.BytesIO(png)).convert("RGB")
    assert img.width >= 1000 and img.height >= height * 0.9, img.size
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 200, "screenshot has almost no colours: blank page?"
    assert max(ImageStat.Stat(img.convert("L")).stddev) > 10, "screenshot is one flat fill"
    (tmp_path / name).write_bytes(png)
    if os.environ.get("STAGECACHE_DOCS_IMG") == "1":
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        (DOCS_IMG / name).write_bytes(png)
    return png


def severe_console_messages(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def network_log(driver) -> tuple[dict[str, str], dict[str, str]]:
    """Since the last drain (DevTools performance log): {request id: URL} asked for, and
    {request id: blocked reason} of the requests the browser refused to send."""
    asked, blocked = {}, {}
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            asked[msg["params"]["requestId"]] = msg["params"]["request"]["url"]
        elif msg["method"] == "Network.loadingFailed" and msg["params"].get("blockedReason"):
            blocked[msg["params"]["requestId"]] = msg["params"]["blockedReason"]
    return asked, blocked


def badge(driver) -> tuple[str, str]:
    from selenium.webdriver.common.by import By

    el = driver.find_element(By.ID, "live-state")
    return el.text, el.get_attribute("class")


def test_preflight_page_draws_one_layer_map_per_stage(driver, free_port, tmp_path):
    from selenium.webdriver.common.by import By

    proc = start_cli_dashboard(free_port)
    try:
        load(driver, f"http://127.0.0.1:{free_port}/")
        maps = driver.find_elements(By.CSS_SELECTOR, ".layer-map.js-plotly-plot")
        assert len(maps) == PP
        assert all(m.find_elements(By.CSS_SELECTOR, ".heatmaplayer") for m in maps)
        rows = driver.find_elements(By.CSS_SELECTOR, "#stage-table tr.stage-row")
        assert [r.get_attribute("class") for r in rows] == ["stage-row ok"] * PP
        rep = expected_report([])
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
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_fault_page_shows_every_error_row_and_red_pool(driver, free_port, tmp_path):
    from selenium.webdriver.common.by import By

    proc = start_cli_dashboard(free_port, "--fault", "global-swa")
    try:
        load(driver, f"http://127.0.0.1:{free_port}/")
        assert len(driver.find_elements(By.CSS_SELECTOR, ".layer-map.js-plotly-plot")) == PP
        rows = driver.find_elements(By.CSS_SELECTOR, "#stage-table tr.stage-row.error")
        rep = expected_report(["global-swa"])
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
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _js(driver, expr: str):
    return driver.execute_script("return " + expr)


def _phase_is(driver, text: str):
    return _wait(lambda: badge(driver)[0] == text, timeout=20, what=f"the badge to read {text!r}")


def _go_running(driver, source: ScriptedRun, url: str) -> None:
    """starting -> validating -> running, as the page sees it (one reload when the report arrives)."""
    from selenium.webdriver.common.by import By

    load(driver, url)
    assert badge(driver) == ("live · starting", "badge live")
    assert _js(driver, "document.getElementById('run-progress-box').hidden") is True
    source.phase = "validating"
    _phase_is(driver, "live · validating")
    source.phase = "running"
    _wait(lambda: len(driver.find_elements(By.CSS_SELECTOR, ".layer-map.js-plotly-plot")) == PP,
          timeout=20, what="the reload with the layer maps")
    _phase_is(driver, "live · running")


def test_a_run_goes_live_shows_rates_per_stage_and_timeline_then_done(driver, free_port, tmp_path):
    from stagecache.dashboard.server import dashboard_in_thread

    source = ScriptedRun()
    with dashboard_in_thread(source, port=free_port) as url:
        _go_running(driver, source, url + "/?window=3")
        hit = "document.getElementById('chart-hit-rate').data"
        _wait(lambda: _js(driver, f"{hit}.every(t => t.y.filter(v => v !== null).length >= 3)"),
              timeout=20, what="three windowed hit-rate points on every stage's line")
        polls = _js(driver, "window.stagecacheDashboard.polls")
        time.sleep(3.2)
        assert _js(driver, "window.stagecacheDashboard.polls") - polls >= 3  # updates at <= 1 s
        # every stage has its own line: its own data, colour, marker and dash
        traces = _js(driver, f"{hit}.map(t => [t.meta.stage, t.y[t.y.length - 1], t.line.color,"
                             " t.marker.symbol, t.line.dash])")
        assert [t[0] for t in traces] == list(range(PP))
        for stage, last, *_ in traces:
            assert last == pytest.approx(RATIO[stage], abs=0.01), (stage, last)
        assert len({t[2] for t in traces}) == PP and len({t[3] for t in traces}) == PP
        # progress bar and the timeline's bubbles: downstream stages wait, stage 0 never does
        value = _js(driver, "document.getElementById('run-progress').value")
        assert 0 < value < 1 and _js(driver, "document.getElementById('run-progress-box').hidden") is False
        kinds = _js(driver, "Object.fromEntries(document.getElementById('chart-timeline').data"
                            ".map(t => [t.meta.kind, Array.from(new Set(t.y))]))")
        assert sorted(kinds["compute"]) == [f"stage {s}" for s in range(PP)]
        assert sorted(kinds["recv_wait"]) == [f"stage {s}" for s in range(1, PP)]
        assert _js(driver, "document.getElementById('chart-timeline')._fullLayout.xaxis.type") == "date"
        # transfers: each stage's mean queue wait stacked under its DMA time, per direction
        split = _js(driver, "document.getElementById('chart-transfer-split').data.map(t => t.y)")
        assert split[0][0::2] == pytest.approx([0.001 * (s + 1) for s in range(PP)], rel=0.05)
        assert split[0][1::2] == pytest.approx([0.0005] * PP, rel=0.05)
        assert split[1] == pytest.approx([0.002, 0.001] * PP, rel=0.05)
        assert severe_console_messages(driver) == []
        screenshot(driver, "dashboard-live.png", tmp_path)
        source.phase = "done"
        assert _phase_is(driver, "done") and badge(driver)[1] == "badge done"
        assert _js(driver, "document.getElementById('run-progress-text').textContent") == "100%"
        # the run is over: windowed rates fall to zero instead of freezing at a since-start mean
        _wait(lambda: _js(driver, "document.getElementById('chart-tokens').data"
                                  ".every(t => t.y.every(v => v === 0))"),
              timeout=15, what="tokens/s to drop to zero after the run")
        assert _js(driver, f"{hit}[0].y[{hit}[0].y.length - 1]") is None  # no lookups: no ratio


def test_a_failed_run_says_so_and_is_not_live(driver, free_port, tmp_path):
    from selenium.webdriver.common.by import By
    from stagecache.dashboard.server import dashboard_in_thread

    source = ScriptedRun()
    with dashboard_in_thread(source, port=free_port) as url:
        _go_running(driver, source, url + "/")
        source.phase = "failed"
        _phase_is(driver, "failed")
        assert badge(driver)[1] == "badge failed"
        detail = driver.find_element(By.ID, "run-detail")
        assert detail.text == "stage 2 (pid 4242) exited with code 1: boom"
        assert "error-text" in detail.get_attribute("class")
        screenshot(driver, "dashboard-failed.png", tmp_path)


def test_api_docs_work_offline_from_the_apps_own_assets(driver, free_port):
    from selenium.webdriver.common.by import By

    proc = start_cli_dashboard(free_port)
    base = f"http://127.0.0.1:{free_port}"
    try:
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
    finally:
        proc.terminate()
        proc.wait(timeout=10)


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


def test_host_tier_table_and_occupancy_heatmap_follow_the_stages(driver, free_port, tmp_path):
    """Per stage: its host-tier status (red when not ready, orange for a warning) and a heatmap of
    pool kind x tier -- the state, indexer and per-request pools included -- refilled every poll."""
    from selenium.webdriver.common.by import By
    from stagecache.dashboard.server import dashboard_in_thread

    source = ScriptedRun()
    with dashboard_in_thread(source, port=free_port) as url:
        _go_running(driver, source, url + "/")
        _wait(lambda: _js(driver, "window.stagecacheOccupancy.updates") >= 1, timeout=15,
              what="the occupancy script's first update")
        rows = driver.find_elements(By.CSS_SELECTOR, "#host-tier-table tr.host-tier-row")
        cells = [r.find_element(By.CSS_SELECTOR, "td.host-tier-status") for r in rows]
        assert [c.text for c in cells] == ["ok", "smaller_than_device", "ok", "exceeds_ram"]
        assert [c.get_attribute("class").split()[-1] for c in cells] == ["ok", "warn", "ok", "bad"]
        assert rows[3].find_element(By.CSS_SELECTOR, "td.host-tier-available").text == "512.0 MiB"
        assert rows[2].find_element(By.CSS_SELECTOR, "td.host-tier-pinned").text == "no"
        heat = "document.getElementById('chart-occupancy')"
        labels = _js(driver, f"{heat}.data[0].y")
        for label in ("C4 compress-state · device", "C4 indexer compress-state · host",
                      "C4 indexer · device", "C128 compress-state · device"):
            assert label in labels, labels
        assert "C128 compress-state · host" not in labels  # per-request: never host-cached

        def cell(label: str, stage: int):
            i = labels.index(label)
            return _js(driver, f"[{heat}.data[0].z[{i}][{stage}], {heat}.data[0].text[{i}][{stage}]]")

        assert cell("C128 compress-state · device", 0) == [0.25, "1/4 slots"]
        assert cell("SWA KV · host", 2) == [0.75, "24/32"]
        assert cell("SWA KV · device", 1) == [0.25, "4/16"]
        source.device_used = 12
        _wait(lambda: cell("SWA KV · device", 1) == [0.75, "12/16"], timeout=15,
              what="the heatmap to follow the stages' pages")
        assert severe_console_messages(driver) == []
        screenshot(driver, "dashboard-host-tier.png", tmp_path)


def test_stage_agreement_panel_and_miss_reasons_follow_the_stages(driver, free_port, tmp_path):
    """The disagreement count and the recent disagreements (request, stages, values) refill from
    every poll; the miss-reasons chart stacks each stage's device misses by reason over time."""
    from selenium.webdriver.common.by import By
    from stagecache.dashboard.server import dashboard_in_thread

    source = ScriptedRun()
    with dashboard_in_thread(source, port=free_port) as url:
        _go_running(driver, source, url + "/?window=3")
        _wait(lambda: int(driver.find_element(By.ID, "agreement-total").text) >= 3, timeout=20,
              what="three disagreements counted")
        assert _js(driver, "window.stagecacheInsight.updates") >= 1
        assert driver.find_element(By.ID, "stage-agreement").get_attribute("class") == "warn"
        kinds = driver.find_elements(By.CSS_SELECTOR, "#agreement-kinds td.agreement-kind.bad")
        assert {c.find_element(By.XPATH, "..").get_attribute("data-stage") for c in kinds} == {str(SKEWED_STAGE)}
        rows = _js(driver, "Array.from(document.querySelectorAll('#agreement-table tr.disagreement'))"
                           ".map(tr => Array.from(tr.cells).map(td => td.textContent))")  # one snapshot
        assert len(rows) >= 3 and rows[0][2:] == [f"session-{len(rows) - 1}/1", "matched_prefix",
                                                   str(SKEWED_STAGE), "3", "3 / 3 / 2 / 3"]
        assert driver.find_element(By.ID, "agreement-none").get_attribute("hidden")
        chart = "document.getElementById('chart-miss-reasons').data"
        _wait(lambda: _js(driver, f"{chart}.every(t => t.y.filter(v => v !== null).length >= 3)"),
              timeout=20, what="three points on every stage's reasons")
        last = _js(driver, f"Object.fromEntries({chart}.map(t => [t.meta.stage + ' ' + t.meta.key,"
                           " t.y[t.y.length - 1]]))")
        for s in range(PP):  # 1000 lookups/s per stage: the stack is the device misses
            stack = sum(v for k, v in last.items() if k.startswith(f"{s} "))
            assert stack == pytest.approx(1000, rel=0.05), (s, last)
            assert last[f"{s} miss_reasons.evicted_from_device"] == pytest.approx(1000 * RATIO[s], rel=0.05)
            assert (last[f"{s} miss_reasons.stage_disagreement"] > 0) == (s == SKEWED_STAGE)
        assert severe_console_messages(driver) == []
        screenshot(driver, "dashboard-insight.png", tmp_path)
