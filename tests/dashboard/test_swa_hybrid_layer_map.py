"""The SWA-hybrid layer map: its own legend (sliding window / full attention / plain MHA), one cell
per layer in its sub-pool with the sub-pool index, and a faulted stage in red -- from the API of a
real server and in a real headless Chromium."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest
from browser_support import CHROMIUM, _wait, load
from plans import report
from stagecache.dashboard.server import dashboard_in_thread
from stagecache.runtime.live.source import StaticSource

PP = 4
LEGEND = ["sliding window", "full attention", "plain MHA"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client():
    rep = report("gpt-oss-20b", PP, ["global-swa-subpool@2"])
    with dashboard_in_thread(StaticSource(rep), port=_free_port()) as url, \
            httpx.Client(base_url=url, timeout=10) as c:
        yield c


def test_layer_map_api_has_the_family_legend_and_sub_pool_cells(client):
    for stage in range(PP):
        body = client.get(f"/api/stages/{stage}/layer-map").json()
        heat = body["figure"]["data"][0]
        bar = heat["colorbar"]
        assert bar["ticktext"] == LEGEND and bar["title"]["text"] == "attention"
        start = stage * 6
        assert heat["x"] == list(range(start, start + 6))
        cells = {(c["pool"], c["global"]): c for c in body["cells"]}
        swa = sorted(g for p, g in cells if p == "swa")
        full = sorted(g for p, g in cells if p == "full")
        assert swa == list(range(start, start + 6, 2)) and full == list(range(start + 1, start + 6, 2))
        assert [cells[("swa", g)]["index"] for g in swa] == [0, 1, 2]
        assert not any(p == "kv" for p, _ in cells)
        # z: the legend place of each cell's layer kind (0 sliding, 1 full), None where no buffer
        z = heat["z"]
        assert {v for row in z for v in row if v is not None} == {0, 1}
        rows = body["figure"]["layout"]["yaxis"]["ticktext"]
        if stage == 2:  # the faulted SWA sub-pool: its row red, framed, the others fine
            assert "✗ SWA KV 12/3" in rows[0] and "✗" not in "".join(rows[1:])
            assert body["figure"]["layout"]["shapes"]
        else:
            assert rows[:2] == ["SWA KV 3/3", "full KV 3/3"]


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (tests/setup.d installs it)")
def test_chromium_draws_the_swa_legend(driver, tmp_path):
    from selenium.webdriver.common.by import By

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "stagecache.runtime", "dashboard", "--from-check", "--model",
                             "gpt-oss-20b", "--pp-size", str(PP), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert f"http://127.0.0.1:{port}/" in proc.stdout.readline()

        def up() -> bool:
            assert proc.poll() is None
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        _wait(up, what="the dashboard process")
        load(driver, f"http://127.0.0.1:{port}/")
        maps = driver.find_elements(By.CSS_SELECTOR, ".layer-map.js-plotly-plot")
        assert len(maps) == PP
        for m in maps:
            ticks = [t.text for t in m.find_elements(By.CSS_SELECTOR, ".colorbar .cbaxis text, .colorbar text")]
            assert all(word in ticks for word in LEGEND), ticks
            assert "attention" in ticks
            assert m.find_elements(By.CSS_SELECTOR, ".heatmaplayer")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
