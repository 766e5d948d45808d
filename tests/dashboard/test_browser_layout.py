"""The dashboard's layout at a phone's, a laptop's and a wide monitor's width (360, 1280, 1920 px),
measured in real Chromium: the page never scrolls sideways, no element clips its text, and every
chart's title and axis titles lie inside the chart.

A live run (every chart drawn) and a fault page (the widest stage table, the error texts) are
each measured at the three widths.  A table wider than the window scrolls inside its own box
(``overflow-x: auto``), which is a design choice, not clipping: what lies inside a scrolling box
is exempt from the per-element check, and the test asserts that at 360 px the stage table does
scroll (so the check is not passing on an empty page).
"""

from __future__ import annotations

import time

import pytest
from browser_support import MARKS, _wait, go_running, js, load
from dashboard_sources import PP, ScriptedRun, expected_report

pytestmark = MARKS

WIDTHS = (360, 1280, 1920)

#: Every layout problem on the page, as one line each (empty: none).  Plotly draws inside its own
#: SVG, so its titles are checked by their boxes against the chart's box; other elements by their
#: scroll width against their client width where they hide what overflows.
PROBLEMS_JS = r"""
const out = [], de = document.documentElement, W = de.clientWidth;
function* ancestors(el) { for (let p = el.parentElement; p; p = p.parentElement) yield p; }
const name = el => el.id ? '#' + el.id : el.tagName.toLowerCase() + '.' + [...el.classList].join('.');
if (de.scrollWidth > W + 1) out.push(`the page scrolls sideways: ${de.scrollWidth} px wide in ${W}`);
for (const plot of document.querySelectorAll('.js-plotly-plot')) {
  const box = plot.getBoundingClientRect();
  if (box.left < -1 || box.right > W + 1)
    out.push(`${name(plot)}: chart spans ${box.left | 0}..${box.right | 0}, the window 0..${W}`);
  for (const t of plot.querySelectorAll('.gtitle, .xtitle, .ytitle, .g-gtitle text')) {
    const r = t.getBoundingClientRect();
    if (!r.width || !t.textContent.trim()) continue;
    if (r.left < box.left - 1 || r.right > box.right + 1 || r.top < box.top - 1)
      out.push(`${name(plot)}: title "${t.textContent}" spans ${r.left | 0}..${r.right | 0}, ` +
               `its chart ${box.left | 0}..${box.right | 0}`);
  }
}
const scrolls = el => ['auto', 'scroll'].includes(getComputedStyle(el).overflowX);
for (const el of document.querySelectorAll('body *')) {
  if (el.closest('.js-plotly-plot') || !el.getClientRects().length) continue;
  if (el.parentElement.closest('*') && [...ancestors(el)].some(scrolls)) continue;  // inside a scroll box
  const r = el.getBoundingClientRect(), ox = getComputedStyle(el).overflowX;
  if (r.right > W + 1 && el.parentElement.getBoundingClientRect().right <= W + 1)
    out.push(`${name(el)} reaches ${r.right | 0} px, past the window's ${W}`);
  if (!scrolls(el) && ox !== 'visible' && el.scrollWidth > el.clientWidth + 1)
    out.push(`${name(el)} clips its content: ${el.scrollWidth} px in ${el.clientWidth} (overflow-x ${ox})`);
}
return out;
"""


def problems(driver, width: int, settle_s: float = 10.0) -> list[str]:
    """The layout problems at ``width``, once the page has settled: plotly relayouts after the
    resize event and the titles are fitted after that, so the page is measured until it has no
    problem or ``settle_s`` passed (then the last measurement's problems are the answer)."""
    driver.set_window_size(width, 1000)
    _wait(lambda: js(driver, "document.documentElement.clientWidth") <= width, what=f"width {width}")
    deadline = time.monotonic() + settle_s
    while True:
        found = driver.execute_script(PROBLEMS_JS)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.25)


@pytest.mark.parametrize("page", ["live", "fault"])
def test_nothing_is_clipped_or_cropped_at_360_1280_and_1920_px(driver, free_port, page):
    from stagecache.dashboard.server import dashboard_in_thread

    source = ScriptedRun()
    with dashboard_in_thread(source, port=free_port) as url:
        if page == "live":
            go_running(driver, source, url + "/?window=3")
        else:  # refused at startup: the error rows hold the longest texts of any page
            source._report = expected_report(["global-swa", "missing-c4-state@2"])
            source.phase = "running"
            load(driver, url + "/?window=3")
            assert js(driver, "document.querySelectorAll('tr.stage-row.error').length") == PP
        found = {w: problems(driver, w) for w in WIDTHS}
        assert found == {w: [] for w in WIDTHS}, "\n".join(
            f"{w} px: {p}" for w, ps in found.items() for p in ps)
        problems(driver, 360)
        scrolling = js(driver, "[...document.querySelectorAll('table')]"
                               ".filter(e => e.scrollWidth > e.clientWidth + 1).length")
        assert scrolling >= 1  # at 360 px the stage table scrolls inside its own box
