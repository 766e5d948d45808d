"""A model name with markup in it runs nothing in a real browser, on every HTML page.

The model's name is a config's path (or a saved report's field), so it is the user's string;
the dashboard puts it into the page, /docs and /redoc (FastAPI's own templates put the title
into ``<title>`` unescaped).  Headless Chromium loads each page with a name that would run
script if it were markup; the script's side effect never happens and the name shows as text.
"""

from __future__ import annotations

import time

from browser_support import MARKS, _wait, js
from plans import report
from stagecache.dashboard.server import DashboardThread, bind_dashboard_socket
from stagecache.runtime.live.source import StaticSource

pytestmark = MARKS

NAME = ('tiny</title><script>window.__xss = 1</script>'
        '<img src=x onerror="window.__xss = 2"><svg onload="window.__xss = 3">')


def test_a_script_in_the_model_name_never_runs(driver):
    rep = report("tiny-v4", 2).model_copy(update={"model": NAME})
    dash = DashboardThread(StaticSource(rep), bind_dashboard_socket("127.0.0.1", 0),
                           title=f"stagecache {NAME} pp=2")
    dash.start()
    try:
        for path in ("", "docs", "redoc"):
            driver.get("about:blank")
            driver.get(dash.url + path)
            _wait(lambda: js(driver, "document.readyState") == "complete", what=f"/{path} to load")
            time.sleep(1.0)  # give any injected handler (onerror, onload) its chance to run
            assert js(driver, "window.__xss") is None, f"script from the model name ran on /{path}"
            assert "<script>window.__xss = 1</script>" in js(driver, "document.title"), path
        driver.get(dash.url)
        _wait(lambda: NAME in js(driver, "document.body.innerText"), what="the name shown as text")
    finally:
        dash.stop()
