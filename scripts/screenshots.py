"""The README's screenshots, taken from real runs with headless Chromium (Debian's ``chromium`` and
``chromium-driver``; selenium and pillow come with ``pip install -e '.[test]'``).

    python scripts/screenshots.py            # writes docs/img/readme-serve-live.png, readme-serve-fault.png

1. ``stagecache serve`` (the plain demo, on a free port) is started; once the page shows the run
   live and a third of the trace is through, the page is captured mid-run, from the top down to
   the pipeline timeline (stage table, layer maps, live charts).
2. ``stagecache serve --fault missing-c4-state@2`` (sglang's known C4 compress-state mapping bug
   on stage 2): startup validation refuses the run, the dashboard stays up showing the errors,
   and that page is captured down to the layer maps.

Each serve is stopped with Ctrl-C (SIGINT).  The PNGs are quantized to 256 colours (a dashboard
has few) so they stay small in the repository.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"
WIDTH = 1400
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1")


def wait(predicate: Callable[[], object], what: str, timeout: float = 120.0) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"screenshots: timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


@contextmanager
def serve(*flags: str) -> Iterator[str]:
    """A real ``stagecache serve`` on a free port; yields the dashboard URL it prints first."""
    log = tempfile.NamedTemporaryFile("w+", prefix="stagecache-screenshots-", suffix=".log")
    proc = subprocess.Popen([sys.executable, "-m", "stagecache", "serve", "--port", "0", *flags],
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        def url() -> str | None:
            if proc.poll() is not None:
                raise SystemExit(f"screenshots: serve exited {proc.returncode}: "
                                 f"{Path(log.name).read_text()[-2000:]}")
            found = re.search(r"dashboard: (http://\S+/)", Path(log.name).read_text())
            return found.group(1) if found else None

        yield str(wait(url, "the dashboard URL"))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - loopback URL printed by serve
        return json.load(r)


@contextmanager
def chromium() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="stagecache-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in (*CHROME_FLAGS, f"--window-size={WIDTH},1000", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(shutil.which("chromedriver") or
                                                            "/usr/bin/chromedriver"))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def capture(driver: object, path: Path, down_to: str) -> None:
    """The page at WIDTH px from the top down to the element ``down_to`` (CSS selector),
    quantized to 256 colours."""
    from PIL import Image

    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(WIDTH, height + 150)
    time.sleep(1.5)  # plotly's responsive relayout, then the title fit, after the resize
    bottom = driver.execute_script(f"return document.querySelector({down_to!r})"
                                   ".getBoundingClientRect().bottom + window.scrollY + 12")
    scale = driver.execute_script("return window.devicePixelRatio") or 1
    img = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    img = img.crop((0, 0, img.width, min(img.height, int(bottom * scale))))
    img = img.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, optimize=True)
    print(f"{path.relative_to(ROOT)}: {img.width}x{img.height}, {path.stat().st_size // 1024} KiB")


def live_run(driver: object, out: Path, requests: int | None) -> None:
    flags = ("--requests", str(requests)) if requests else ()
    with serve(*flags) as url:
        print(f"serve: {url}")
        driver.get(url)

        def third_through() -> bool:
            run = get_json(url + "api/metrics/summary")["run"]
            return run["phase"] == "running" and (run["progress"] or 0) >= 1 / 3

        wait(third_through, "a third of the trace", timeout=300)
        driver.get(url)  # a fresh page holds the report's table and maps; charts fill from polls
        time.sleep(12)  # a dozen polls: lines across the whole x axis of the rate charts
        assert driver.execute_script("return document.getElementById('live-state').textContent"
                                     ).startswith("live"), "the run ended before the capture"
        capture(driver, out, "#chart-timeline")


def fault_run(driver: object, out: Path) -> None:
    with serve("--fault", "missing-c4-state@2", "--requests", "8") as url:
        print(f"serve --fault missing-c4-state@2: {url}")
        wait(lambda: get_json(url + "api/metrics/summary")["status"] == "failed",
             "startup validation to refuse the run")
        driver.get(url)
        time.sleep(3)
        capture(driver, out, ".maps")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=IMG, help="directory for the PNGs (default docs/img)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests of the live run (default: serve's own, a run of about 80 s)")
    args = p.parse_args()
    os.environ.setdefault("STAGECACHE_LOG", "warning")
    with chromium() as driver:
        live_run(driver, args.out / "readme-serve-live.png", args.requests)
        fault_run(driver, args.out / "readme-serve-fault.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
