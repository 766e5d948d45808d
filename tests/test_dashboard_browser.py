"""The dashboard in a real headless Chromium (selenium + chromedriver).

The preflight pages come from a real ``stagecache dashboard --from-check``
subprocess; the live-chart test serves a source whose numbers grow on every
read and checks the page appends points without a reload.  Screenshots are
checked to be real renders (many colours, not one flat fill).  Set
``STAGECACHE_DOCS_IMG=1`` to also write them to docs/img/ for docs/dashboard.md.
Skipped only when Chromium itself is absent.
"""

from __future__ import annotations

import io
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
from stagecache.exporters.snapshot import empty_stage_numbers
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.model.pool_kinds import POOLS
from stagecache.runtime.model.spec import load_spec
from stagecache.runtime.validation.faults import parse_faults
from stagecache.runtime.validation.report import preflight

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
MODEL, PP = "deepseek-v4-flash", 4
DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,1000")

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
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
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
    driver.set_window_size(1400, 1000)
    driver.get(url)
    _wait(lambda: len(driver.find_elements(By.CSS_SELECTOR, ".live-chart.js-plotly-plot")) == 3,
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


def expected_report(faults: list[str]) -> dict:
    layout = build_layout(load_spec(MODEL), PP)
    return preflight(layout, 256, parse_faults(faults, PP)).to_dict()


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
        # the empty live state, and the polling script reaching the summary endpoint
        assert driver.page_source.count("no live data (preflight view)") >= 3
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


class GrowingSource:
    """A SnapshotSource whose stages serve more traffic every time they are read."""

    def __init__(self) -> None:
        self.reads = 0
        self._report = expected_report([])

    def startup(self):
        return self._report

    def stages(self):
        self.reads += 1
        n = self.reads
        out = {}
        for s in range(PP):
            d = empty_stage_numbers(s, POOLS)
            d.update(time=time.time(), steps=n, requests=n)
            d["cache_tokens"] = {"device": 900 * n * (s + 1), "host": 300 * n, "miss": 100 * n}
            d["host_hit_ratio"] = min(0.95, 0.1 * s + 0.02 * n)
            d["bandwidth_bytes_per_second"] = {"d2h": 1e9 * (s + 1 + n % 3), "h2d": 5e8 * (s + 1)}
            out[s] = d
        return out


def test_live_charts_extend_without_reload(driver, free_port, tmp_path):
    from stagecache.dashboard.app import dashboard_in_thread

    source = GrowingSource()
    with dashboard_in_thread(source, port=free_port) as url:
        load(driver, url + "/")
        driver.execute_script("window.__sameDocument = true;")
        _wait(lambda: driver.execute_script(
            "return document.getElementById('chart-hit-ratio').data[0].x.length") >= 3,
            timeout=20, what="three points on the hit-ratio chart")
        assert driver.execute_script("return window.__sameDocument") is True  # no page reload
        assert driver.execute_script(
            "return (document.getElementById('chart-hit-ratio').layout.annotations || []).length") == 0
        last, bars = driver.execute_script(  # one script: no poll can land in between
            "return [window.stagecacheDashboard.lastSummary,"
            " document.getElementById('chart-tokens').data.map(t => Array.from(t.y))]")
        want = [[s["cache_tokens"][k] for s in last["stages"]] for k in ("device", "host", "miss")]
        assert bars == want
        bw = driver.execute_script("return document.getElementById('chart-bandwidth').data.length")
        assert bw == 2 * PP
        assert severe_console_messages(driver) == []
        screenshot(driver, "dashboard-live.png", tmp_path)


class LateReportSource:
    """No report until ``ready`` is set: what ``serve`` looks like while its stages start."""

    def __init__(self) -> None:
        self.ready = False
        self._report = expected_report(["global-swa"])

    def startup(self):
        return self._report if self.ready else None

    def stages(self):
        return {}


def test_starting_page_reloads_once_the_report_arrives(driver, free_port):
    from selenium.webdriver.common.by import By
    from stagecache.dashboard.app import dashboard_in_thread

    source = LateReportSource()
    with dashboard_in_thread(source, port=free_port) as url:
        load(driver, url + "/")
        assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-status") == "starting"
        assert driver.find_elements(By.CSS_SELECTOR, ".layer-map") == []
        source.ready = True
        _wait(lambda: len(driver.find_elements(By.CSS_SELECTOR, ".layer-map.js-plotly-plot")) == PP,
              timeout=20, what="the reload with the report's layer maps")
        assert len(driver.find_elements(By.CSS_SELECTOR, "tr.stage-row.error")) == PP
        assert severe_console_messages(driver) == []
