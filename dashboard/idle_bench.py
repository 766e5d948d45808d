"""Idle cost of the dashboard: server CPU while a real browser keeps the page open.

    python -m stagecache.dashboard.idle_bench [--seconds 20] [--json-out FILE]

Starts a real ``stagecache serve --model tiny-v4 --pp-size 4`` (a short trace,
then ``--hold-seconds``: the run is over, nothing runs) and a real
``stagecache dashboard --from-check`` (a preflight view).  For each server it
measures the serving process's CPU time (``/proc/<pid>/stat``: user + system,
all threads) over ``--seconds`` twice: with no client (the baseline) and with
headless Chromium showing the page, which polls every second.  It prints JSON:
CPU percent of one core for both, their difference, and the polls the page
made (so the update interval is measured, not assumed).  Needs Linux, the
``chromium`` + ``chromedriver`` binaries and selenium (a test extra).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_percent(pid: int, seconds: float) -> float:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return 100.0 * (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"idle_bench: timed out waiting for {what}")
        time.sleep(0.2)


@contextmanager
def process(argv: list[str]) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    profile = tempfile.mkdtemp(prefix="stagecache-idle-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--window-size=1400,1000",
                 f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    drv = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"))
    try:
        yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)


def measure(pid: int, url: str, seconds: float) -> dict[str, Any]:
    """CPU of ``pid`` with no client, then with the page open in Chromium."""
    idle = cpu_percent(pid, seconds)
    with browser() as drv:
        drv.get(url)
        wait(lambda: drv.execute_script("return (window.stagecacheDashboard || {}).polls || 0") >= 2,
             30, "the page's first polls")
        polls0 = drv.execute_script("return window.stagecacheDashboard.polls")
        t0 = time.monotonic()
        open_ = cpu_percent(pid, seconds)
        polls = drv.execute_script("return window.stagecacheDashboard.polls") - polls0
        span = time.monotonic() - t0
        phase = drv.execute_script("return window.stagecacheDashboard.phase")
    return {"cpu_percent_no_client": round(idle, 2), "cpu_percent_page_open": round(open_, 2),
            "cpu_percent_added_by_page": round(open_ - idle, 2), "polls": polls,
            "mean_poll_interval_s": round(span / polls, 3) if polls else None, "phase": phase,
            "seconds": seconds}


def bench_serve(seconds: float) -> dict[str, Any]:
    port, run_dir = free_port(), tempfile.mkdtemp(prefix="stagecache-idle-run-")
    argv = [sys.executable, "-m", "stagecache.runtime", "serve", "--model", "tiny-v4", "--pp-size", "4",
            "--requests", "64", "--rate", "0", "--port", str(port), "--run-dir", run_dir,
            "--hold-seconds", str(int(6 * seconds + 120))]
    run_file = Path(run_dir) / "run.json"

    def done() -> bool:
        try:
            return json.loads(run_file.read_text()).get("phase") == "done"
        except (OSError, ValueError):
            return False

    try:
        with process(argv) as proc:
            wait(done, 180, "the serve run to finish")
            time.sleep(1.0)  # the supervisor's last writes
            return {"server": "stagecache serve (run done, holding)",
                    **measure(proc.pid, f"http://127.0.0.1:{port}/", seconds)}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def bench_preflight(seconds: float) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "stagecache.runtime", "dashboard", "--from-check", "--model",
            "deepseek-v4-flash", "--pp-size", "4", "--port", str(port)]
    with process(argv) as proc:
        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait(up, 60, "the preflight dashboard")
        return {"server": "stagecache dashboard --from-check (preflight view)",
                **measure(proc.pid, f"http://127.0.0.1:{port}/", seconds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stagecache.dashboard.idle_bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="length of each CPU measurement (default %(default)s)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if not Path("/proc/self/stat").exists():
        print("idle_bench: needs Linux (/proc)", file=sys.stderr)
        return 2
    result = {"cpu_count": os.cpu_count(), "runs": [bench_serve(args.seconds), bench_preflight(args.seconds)]}
    text = json.dumps(result, indent=2)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
