"""A stage on another host goes unreachable and comes back: the page shades the gap on the rate
charts and the timeline, and leaves the stage's rates empty (not zero) while it is out."""

from __future__ import annotations

import time

from browser_support import MARKS, _wait, go_running, js, screenshot, severe_console_messages
from dashboard_sources import ScriptedRun
from stagecache.runtime.live.numbers import StageLive

pytestmark = MARKS


class CutRun(ScriptedRun):
    """ScriptedRun whose stage 2 is remote (its numbers pushed from another host); ``cut`` freezes
    them as a cut link would: no new numbers arrive, the last ones age."""

    cut_at: float | None = None
    frozen: StageLive | None = None

    def stages(self):
        out = super().stages()
        if 2 in out:
            live = out[2]
            live.remote, live.host, live.heartbeat_at = True, "node 1", time.time()
            if self.cut_at is not None:
                self.frozen = self.frozen or live.model_copy(update={"heartbeat_at": self.cut_at})
                out[2] = self.frozen.model_copy()
            else:
                self.frozen = None
        return out


def test_an_unreachable_stage_is_shaded_and_its_rates_are_empty(driver, free_port, tmp_path):
    from stagecache.dashboard.server import dashboard_in_thread

    source = CutRun()
    with dashboard_in_thread(source, port=free_port) as url:
        go_running(driver, source, url + "/?window=3", points=2)
        hit = "document.getElementById('chart-hit-rate')"
        source.cut_at = time.time()
        shapes = f"({hit}.layout.shapes || [])"
        _wait(lambda: js(driver, f"{shapes}.some(s => s.name === 'stage 2 unreachable')"), timeout=20,
              what="the gap shaded on the hit-rate chart")
        assert js(driver, "(document.getElementById('chart-timeline').layout.shapes || [])"
                          ".some(s => s.name === 'stage 2 unreachable')")
        time.sleep(2.5)  # polls while out: stage 2's line breaks (null), the others go on
        last = js(driver, f"{hit}.data.map(t => [t.meta.stage, t.y.slice(-2)])")
        by = dict((s, ys) for s, ys in last)
        assert by[2] == [None, None], by
        assert all(v is not None for s in (0, 1, 3) for v in by[s]), by
        screenshot(driver, "dashboard-outage.png", tmp_path)
        source.cut_at = None  # the link is back
        _wait(lambda: js(driver, f"{hit}.data[2].y[{hit}.data[2].y.length - 1]") is not None, timeout=20,
              what="stage 2's rates again")
        x0, x1 = js(driver, f"(s => [s.x0, s.x1])({shapes}.find(s => s.name === 'stage 2 unreachable'))")
        assert 4000 < x1 - x0 < 20000  # the gap, closed: about the time it was out, in ms
        assert severe_console_messages(driver) == []
