"""The dashboard of a linear-attention / Mamba hybrid: Nemotron-H-8B at pp 8, whose stages 0, 2, 5
and 7 hold no attention layer (sglang cannot build their HiCache host KV pool).

The API test reads a real uvicorn server over a real ``preflight`` report; the browser test a real
``stagecache dashboard --from-check`` process in headless Chromium.  Both check that the layer maps
carry the family's own legend (attention, Mamba, no cache) and that the stages sglang fails on are
named.
"""

from __future__ import annotations

import socket

import httpx
from browser_support import MARKS
from plans import report
from stagecache.dashboard.server import dashboard_in_thread
from stagecache.runtime.live.source import StaticSource
from stagecache.runtime.model.families.linear_hybrid import FAMILY

PP = 8
NO_ATTENTION = [0, 2, 5, 7]
LEGEND = [k.text for k in FAMILY.layer_kinds]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_api_layer_maps_use_the_familys_legend_and_name_the_stages_without_attention():
    rep = report("nemotron-h-8b", PP)
    with dashboard_in_thread(StaticSource(rep), port=_free_port()) as url, \
            httpx.Client(base_url=url, timeout=10) as c:
        stages = c.get("/api/stages").json()
        assert not stages["ok"]
        bad = [r["stage"] for r in stages["stages"] if r["status"] != "OK"]
        assert bad == NO_ATTENTION
        assert all("no attention layer" in stages["stages"][s]["status"] for s in bad)
        for s in range(PP):
            body = c.get(f"/api/stages/{s}/layer-map").json()
            heat = body["figure"]["data"][0]
            assert heat["colorbar"]["ticktext"] == LEGEND
            assert body["figure"]["data"][0]["colorbar"]["title"]["text"] == FAMILY.legend_title
            pools = {p["pool"]: p["buffers"] for p in body["pools"]}
            assert set(pools) == {"attention", "mamba"}
            assert (pools["attention"] == 0) == (s in NO_ATTENTION)
            kinds = {c["kind"] for c in body["cells"]}
            assert kinds <= {"attention", "mamba"}  # MLP layers own no buffer: no cell
        startupz = c.get("/startupz")
        assert startupz.status_code == 503


def _in_chromium(fn):
    """The browser marks (skipped where Chromium is absent) on one test of this module."""
    for mark in MARKS:
        fn = mark(fn)
    return fn


@_in_chromium
def test_browser_draws_nemotron_h_at_pp8_with_the_familys_legend(driver, free_port):
    from browser_support import cli_dashboard, load, severe_console_messages
    from selenium.webdriver.common.by import By

    with cli_dashboard(free_port, "--model", "nemotron-h-8b", "--pp-size", str(PP)):
        load(driver, f"http://127.0.0.1:{free_port}/")
        maps = driver.find_elements(By.CSS_SELECTOR, ".layer-map.js-plotly-plot")
        assert len(maps) == PP
        rows = driver.find_elements(By.CSS_SELECTOR, "#stage-table tr.stage-row")
        bad = [i for i, r in enumerate(rows) if "ok" not in r.get_attribute("class").split()]
        assert bad == NO_ATTENTION
        ticks = driver.execute_script(
            "return document.getElementById('layer-map-3').data[0].colorbar.ticktext")
        assert ticks == LEGEND
        legend = maps[3].find_elements(By.CSS_SELECTOR, ".colorbar text")
        assert {"full attention", "Mamba / linear"} <= {t.text for t in legend}
        assert severe_console_messages(driver) == []
