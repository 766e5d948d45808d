"""The demo a person watches: ``stagecache serve``'s first line is the dashboard URL, printed
before the stages start, one unbroken line even into a pipe; the default run lasts long enough to
watch; after the run the page says it finished and when, and /readyz's 503 says why.

One real run (4 stage processes, 8 requests), looked at from outside the way a person would.
"""

from __future__ import annotations

import re
import signal
import time

import httpx
from serve_helpers import start, wait_for
from stagecache.runtime import defaults

UTC_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"


def test_the_default_run_lasts_over_a_minute_of_arrivals():
    assert defaults.REQUESTS / defaults.RATE >= 60


def test_url_first_then_a_finished_run_says_when(tmp_path):
    out = tmp_path / "serve.out"
    proc = start(["--requests", "8", "--rate", "0", "--port", "0", "--hold-seconds", "120"], out)
    try:
        lines = lambda: out.read_text().splitlines()  # noqa: E731
        wait_for(lambda: any("done in" in ln for ln in lines()), 120, "the run's summary", proc, out)
        first = lines()[0]
        # the URL line comes before anything the stages print, whole (stdout is a file here: rich
        # would break it at 80 columns), with every probe on it
        assert re.fullmatch(r"dashboard: http://127\.0\.0\.1:\d+/  \(metrics: .*/startupz\)", first), first
        assert lines().index(first) < min(k for k, ln in enumerate(lines()) if "stage processes" in ln)
        url = re.search(r"(http://\S+/)", first).group(1)

        def finished():
            ready = httpx.get(url + "readyz", timeout=10)
            return ready if ready.json()["phase"] == "done" else None

        ready = wait_for(finished, 30, "run.json to say done", proc, out)
        body = ready.json()
        assert ready.status_code == 503 and not body["ready"]
        assert re.match(rf"run finished at {UTC_TIME}: every stage served the whole trace", body["reasons"][0])
        assert abs(body["finished_at"] - time.time()) < 120
        run = httpx.get(url + "api/metrics/summary", timeout=10).json()["run"]
        assert run["phase"] == "done" and run["finished_at"] == body["finished_at"]
        assert re.fullmatch(rf"run finished at {UTC_TIME}: 8 requests served", run["detail"])
        assert run["detail"] in httpx.get(url, timeout=10).text  # the page, as first drawn
        proc.send_signal(signal.SIGINT)  # Ctrl-C ends the hold: 130, as for every command
        assert proc.wait(30) == 130, out.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
