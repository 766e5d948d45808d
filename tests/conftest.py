"""Shared test fixtures: free loopback ports, one torch thread, a browser, and the GPU skip rule.

The tests mirror the packages (``tests/model`` for ``runtime/model``, ...); helpers that tests of
several packages share live in ``tests/support``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

#: Helpers shared by tests of several packages (``tests/support``): importable by name.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    """Each pytest process (each xdist worker too) gets its own ``$XDG_RUNTIME_DIR``: the per-user
    run root, crash logs and sockets of the runs it starts cannot meet another process's.

    A suite started as a background job of a non-interactive shell (``bash tests/run.sh &``)
    inherits SIGINT ignored, and an ignored signal stays ignored across exec: the commands the
    tests start and then send Ctrl-C would never see it.  A handler here is reset to the default
    at exec, so they see Ctrl-C as a terminal's foreground job does."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    private = tempfile.mkdtemp(prefix="stagecache-test-xdg-")  # 0700, ours
    config._stagecache_xdg = (private, os.environ.get("XDG_RUNTIME_DIR"))
    os.environ["XDG_RUNTIME_DIR"] = private


def pytest_unconfigure(config):
    private, old = getattr(config, "_stagecache_xdg", (None, None))
    if private is None:
        return
    if old is None:
        os.environ.pop("XDG_RUNTIME_DIR", None)
    else:
        os.environ["XDG_RUNTIME_DIR"] = old
    shutil.rmtree(private, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    # Files with a test that needs .venv-sglang run last, whole (pytest-xdist's --dist loadfile
    # keeps a file on one worker): tests/run.sh builds that environment while the rest runs.
    late = {item.path for item in items if "sglang_venv" in item.keywords}
    items.sort(key=lambda item: item.path in late)  # stable: the order is otherwise unchanged
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_torch_thread():
    """torch on one intra-op thread for the test, restored after: the suite runs on 2 shared
    cores, and replays of many small page copies should not spread each copy over threads."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def driver() -> Iterator[object]:
    from browser_support import (  # selenium and the dashboard: browser tests only
        CHROME_FLAGS,
        CHROMIUM,
    )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path = shutil.which("chromedriver") or "/usr/bin/chromedriver"
    assert os.path.exists(driver_path), "chromium is installed but chromedriver is not (apt: chromium-driver)"
    profile = tempfile.mkdtemp(prefix="stagecache-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in CHROME_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    drv = webdriver.Chrome(options=opts, service=Service(driver_path))
    drv.set_page_load_timeout(60)
    try:
        yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)
