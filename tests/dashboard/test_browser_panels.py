"""The dashboard's cache-insight and host-tier panels in a real headless Chromium (see
``tests/dashboard/test_browser.py`` for the pages and the live run)."""

from __future__ import annotations

import pytest
from browser_support import (
    MARKS,
    _wait,
    go_running,
    js,
    screenshot,
    severe_console_messages,
)
from dashboard_sources import (
    PP,
    RATIO,
    SKEWED_STAGE,
    ScriptedRun,
)

pytestmark = MARKS


def test_host_tier_table_and_occupancy_heatmap_follow_the_stages(driver, free_port, tmp_path):
    """Per stage: its host-tier status (red when not ready, orange for a warning) and a heatmap of
    pool kind x tier -- the state, indexer and per-request pools included -- refilled every poll."""
    from selenium.webdriver.common.by import By
    from stagecache.dashboard.server import dashboard_in_thread

    source = ScriptedRun()
    with dashboard_in_thread(source, port=free_port) as url:
        go_running(driver, source, url + "/")
        _wait(lambda: js(driver, "window.stagecacheOccupancy.updates") >= 1, timeout=15,
              what="the occupancy script's first update")
        rows = driver.find_elements(By.CSS_SELECTOR, "#host-tier-table tr.host-tier-row")
        cells = [r.find_element(By.CSS_SELECTOR, "td.host-tier-status") for r in rows]
        assert [c.text for c in cells] == ["ok", "smaller_than_device", "ok", "exceeds_ram"]
        assert [c.get_attribute("class").split()[-1] for c in cells] == ["ok", "warn", "ok", "bad"]
        assert rows[3].find_element(By.CSS_SELECTOR, "td.host-tier-available").text == "512.0 MiB"
        assert rows[2].find_element(By.CSS_SELECTOR, "td.host-tier-pinned").text == "no"
        heat = "document.getElementById('chart-occupancy')"
        labels = js(driver, f"{heat}.data[0].y")
        for label in ("C4 compress-state · device", "C4 indexer compress-state · host",
                      "C4 indexer · device", "C128 compress-state · device"):
            assert label in labels, labels
        assert "C128 compress-state · host" not in labels  # per-request: never host-cached

        def cell(label: str, stage: int):
            i = labels.index(label)
            return js(driver, f"[{heat}.data[0].z[{i}][{stage}], {heat}.data[0].text[{i}][{stage}]]")

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
        go_running(driver, source, url + "/?window=3")
        _wait(lambda: int(driver.find_element(By.ID, "agreement-total").text) >= 3, timeout=20,
              what="three disagreements counted")
        assert js(driver, "window.stagecacheInsight.updates") >= 1
        assert driver.find_element(By.ID, "stage-agreement").get_attribute("class") == "warn"
        kinds = driver.find_elements(By.CSS_SELECTOR, "#agreement-kinds td.agreement-kind.bad")
        assert {c.find_element(By.XPATH, "..").get_attribute("data-stage") for c in kinds} == {str(SKEWED_STAGE)}
        rows = js(driver, "Array.from(document.querySelectorAll('#agreement-table tr.disagreement'))"
                           ".map(tr => Array.from(tr.cells).map(td => td.textContent))")  # one snapshot
        assert len(rows) >= 3 and rows[0][2:] == [f"session-{len(rows) - 1}/1", "matched_prefix",
                                                   str(SKEWED_STAGE), "3", "3 / 3 / 2 / 3"]
        assert driver.find_element(By.ID, "agreement-none").get_attribute("hidden")
        chart = "document.getElementById('chart-miss-reasons').data"
        _wait(lambda: js(driver, f"{chart}.every(t => t.y.filter(v => v !== null).length >= 3)"),
              timeout=20, what="three points on every stage's reasons")
        last = js(driver, f"Object.fromEntries({chart}.map(t => [t.meta.stage + ' ' + t.meta.key,"
                           " t.y[t.y.length - 1]]))")
        for s in range(PP):  # 1000 lookups/s per stage: the stack is the device misses
            stack = sum(v for k, v in last.items() if k.startswith(f"{s} "))
            assert stack == pytest.approx(1000, rel=0.05), (s, last)
            assert last[f"{s} miss_reasons.evicted_from_device"] == pytest.approx(1000 * RATIO[s], rel=0.05)
            assert (last[f"{s} miss_reasons.stage_disagreement"] > 0) == (s == SKEWED_STAGE)
        assert severe_console_messages(driver) == []
        screenshot(driver, "dashboard-insight.png", tmp_path)
