"""Shared parts of the browser tests: a headless Chromium driver, waits, page helpers.

Skipped only when Chromium itself is absent (``MARKS``).  Set ``STAGECACHE_DOCS_IMG=1`` to also
write the screenshots to docs/img/ for docs/dashboard.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dashboard_sources import (
    MODEL,
    PP,
    ScriptedRun,
)

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
#: The window every test starts from (width, height).
WINDOW = (1400, 1000)
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--window-size={WINDOW[0]},{WINDOW[1]}",
                # offline: every name but the loopback fails to resolve, so a CDN can never load
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1")
N_LIVE_CHARTS = 7  # hit rate, tokens, transfer, bubble, transfer split, timeline, miss reasons

MARKS = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (tests/setup.d installs it)"),
]


def _wait(predicate, timeout: float = 30.0, what: str = "condition"):
    """Poll ``predicate`` until truthy; an element the page re-rendered mid-read is read again."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except StaleElementReferenceException:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


@contextlib.contextmanager
def cli_dashboard(port: int, *extra: str) -> Iterator[subprocess.Popen]:
    """A ``stagecache dashboard --from-check`` subprocess for the block, stopped after it."""
    proc = start_cli_dashboard(port, *extra)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


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


def blank(driver) -> None:
    """The browser as a fresh one starts: a blank page (the previous page's polling stopped), no
    console or network lines left from it, the default window size."""
    driver.get("about:blank")
    driver.get_log("browser")
    driver.get_log("performance")
    driver.set_window_size(*WINDOW)


def load(driver, url: str) -> None:
    from selenium.webdriver.common.by import By

    blank(driver)
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



def js(driver, expr: str):
    return driver.execute_script("return " + expr)


def phase_is(driver, text: str):
    return _wait(lambda: badge(driver)[0] == text, timeout=20, what=f"the badge to read {text!r}")


def go_running(driver, source: ScriptedRun, url: str, points: int = 0) -> None:
    """starting -> validating -> running, as the page sees it (one reload when the report arrives);
    then, with ``points``, that many windowed points on every stage's hit-rate line."""
    from selenium.webdriver.common.by import By

    load(driver, url)
    assert badge(driver) == ("live · starting", "badge live")
    assert js(driver, "document.getElementById('run-progress-box').hidden") is True
    source.phase = "validating"
    phase_is(driver, "live · validating")
    source.phase = "running"
    _wait(lambda: len(driver.find_elements(By.CSS_SELECTOR, ".layer-map.js-plotly-plot")) == PP,
          timeout=20, what="the reload with the layer maps")
    phase_is(driver, "live · running")
    hit = "document.getElementById('chart-hit-rate').data"
    if points:
        _wait(lambda: js(driver, f"{hit}.every(t => t.y.filter(v => v !== null).length >= {points})"),
              timeout=20, what=f"{points} windowed hit-rate points on every stage's line")


