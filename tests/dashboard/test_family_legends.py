"""Each family's layer map on a real dashboard (``stagecache dashboard --from-check`` processes): its
legend, cells only where a layer owns a buffer, and red where a fault breaks a pool; the DSA legend
also as a real headless Chromium draws it."""

from __future__ import annotations

import httpx
import pytest
from browser_support import CHROMIUM, cli_dashboard, load


def layer_map(port: int, stage: int) -> dict:
    r = httpx.get(f"http://127.0.0.1:{port}/api/stages/{stage}/layer-map", timeout=10)
    assert r.status_code == 200
    return r.json()


@pytest.mark.parametrize(("model", "legend", "title"), [
    ("glm-5.2", ["computes top-k", "shared top-k"], "top-k"),
    ("deepseek-v3", ["MLA latent KV"], "attention"),
    ("llama-3.1-8b", ["MHA K and V"], "attention"),
])
def test_each_family_draws_its_own_legend(free_port, model, legend, title):
    with cli_dashboard(free_port, "--model", model, "--pp-size", "2"):
        out = layer_map(free_port, 1)
    heat = out["figure"]["data"][0]
    assert heat["colorbar"]["ticktext"] == legend and heat["colorbar"]["title"]["text"] == title
    assert out["ok"] and not out["figure"]["layout"].get("shapes")
    kv = [c for c in out["cells"] if c["pool"] == "kv"]
    assert [c["global"] for c in kv] == list(range(out["start_layer"], out["end_layer"]))
    assert [c["index"] for c in kv] == list(range(len(kv)))  # local ids


def test_dsa_cells_only_on_top_k_computing_layers_and_red_under_a_fault(free_port):
    with cli_dashboard(free_port, "--model", "glm-5.2", "--pp-size", "2"):
        healthy = layer_map(free_port, 1)
    rows = {p["pool"]: i for i, p in enumerate(healthy["pools"])}
    z = healthy["figure"]["data"][0]["z"][rows["indexer"]]
    owners = [c["global"] for c in healthy["cells"] if c["pool"] == "indexer"]
    assert owners == list(range(42, 78, 4))
    assert [i + 39 for i, v in enumerate(z) if v is not None] == owners  # shared layers: no cell
    assert [c["index"] for c in healthy["cells"] if c["pool"] == "indexer"] == list(range(9))
    with cli_dashboard(free_port, "--model", "glm-5.2", "--pp-size", "2", "--fault", "shared-topk-start"):
        broken = layer_map(free_port, 1)
    assert not broken["ok"]
    (bad,) = [p for p in broken["pools"] if not p["ok"]]
    assert bad["pool"] == "indexer" and "#28525" in bad["errors"][0]
    (band,) = broken["figure"]["layout"]["shapes"]
    assert band["line"]["color"] == "#d62728" and band["y0"] < rows["indexer"] < band["y1"]


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (tests/setup.d installs it)")
def test_chromium_draws_the_dsa_legend(driver, free_port):
    from selenium.webdriver.common.by import By

    with cli_dashboard(free_port, "--model", "glm-5.2", "--pp-size", "2", "--fault", "shared-topk-start"):
        load(driver, f"http://127.0.0.1:{free_port}/")
        maps = driver.find_elements(By.CSS_SELECTOR, ".layer-map.js-plotly-plot")
        assert len(maps) == 2
        texts = driver.execute_script(
            "return Array.from(document.querySelectorAll('.layer-map')).map("
            "m => Array.from(m.querySelectorAll('.colorbar text')).map(t => t.textContent))")
        for legend in texts:
            assert "computes top-k" in legend and "shared top-k" in legend and "top-k" in legend
        rows = driver.find_elements(By.CSS_SELECTOR, "#stage-table tr.stage-row")
        assert [r.get_attribute("class") for r in rows] == ["stage-row ok", "stage-row error"]
        assert "#28525" in rows[1].text
