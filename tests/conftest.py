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


#: Files whose tests are scheduled one by one (each test its own unit of work, free to go to
#: either xdist worker) rather than whole: each test is minutes of its own and shares no module
#: fixture with the others.
PER_TEST_FILES = ("tests/integrations/test_sglang_venv.py",)
#: Seconds a unit of work (a file, or a test of PER_TEST_FILES) takes in tests/run.sh's parallel
#: run (3 workers on an idle 2-core machine; each test's start and end, summed per unit), for the
#: units of 8 s and more; any other unit counts its tests (EACH_S apiece).  Only the queue depends
#: on these figures: its order (longest first, so the workers end together; a unit left out runs
#: last) and which units are heavy (HEAVY_S).
EXPECTED_S = {
    **{f"tests/integrations/test_sglang_venv.py::test_real_sglang_suite_in_its_venv[{case}]": s
       for case, s in (("pinned", 260), ("0.5.22-live", 95))},
    "tests/dashboard/test_browser.py": 89,
    "tests/integrations/test_sglang_two_hosts.py": 80,
    "tests/cli/test_doc_examples.py": 54,
    "tests/serve/test_serve_faults.py": 46,
    "tests/harness/test_setup_steps.py": 46,
    "tests/serve/test_serve_two_hosts.py": 42,
    "tests/cli/test_family_commands.py": 41,
    "tests/serve/test_serve_run.py": 38,
    "tests/serve/test_serve_l3.py": 35,
    "tests/dashboard/test_browser_layout.py": 32,
    "tests/cli/test_advise.py": 30,
    "tests/validation/test_report_golden.py": 28,
    "tests/serve/test_serve_transfer_check.py": 27,
    "tests/storage/test_mooncake.py": 27,
    "tests/serve/test_rendezvous.py": 24,
    "tests/dashboard/test_guard.py": 23,
    "tests/cli/test_bad_input.py": 23,
    "tests/sizing/test_curves.py": 23,
    "tests/cli/test_interrupt.py": 22,
    "tests/dashboard/test_browser_outages.py": 21,
    "tests/dashboard/test_browser_panels.py": 20,
    "tests/dashboard/test_schemathesis.py": 19,
    "tests/cli/test_fuzz.py": 19,
    "tests/cache/test_hicache_integrity.py": 18,
    "tests/serve/test_agreement.py": 18,
    "tests/exporters/test_prometheus_scrape.py": 18,
    "tests/bench/test_policies_bench.py": 17,
    "tests/dashboard/test_family_legends.py": 15,
    "tests/plan/test_dsa_faults.py": 15,
    "tests/cli/test_commands.py": 14,
    "tests/model/test_linear_hybrid.py": 14,
    "tests/dashboard/test_browser_escaping.py": 14,
    "tests/cli/test_swa_hybrid_commands.py": 13,
    "tests/transfer/test_kernels_interpret.py": 13,
    "tests/cache/test_hicache_l3.py": 11,
    "tests/cache/test_hicache_metadata.py": 10,
    "tests/plan/test_faults_everywhere.py": 9,
    "tests/dashboard/test_swa_hybrid_layer_map.py": 9,
    "tests/dashboard/test_dashboard_linear_hybrid.py": 8,
}
EACH_S = 0.5
#: Seconds of other work (EXPECTED_S, all workers together) queued before the units that need
#: .venv-sglang: tests/run.sh builds it in the background meanwhile (seconds when its cache is
#: there, a few minutes when not).
SGLANG_VENV_HEAD_START_S = 240


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its file (one worker runs it whole, so module fixtures
    are made once), or the test itself in PER_TEST_FILES.  The xdist scheduler (below) and the
    queue order (pytest_collection_modifyitems) both use it."""
    path = nodeid.split("::", 1)[0]
    return nodeid if path in PER_TEST_FILES else path


#: A unit of at least this many seconds (EXPECTED_S) is heavy: no second heavy unit is queued
#: behind it on the same worker.
HEAVY_S = 60


def unit_cost(unit: str, tests: int) -> float:
    """Expected seconds of a unit of ``tests`` tests."""
    return EXPECTED_S.get(unit, EACH_S * tests)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (tests/run.sh) with work_unit's units, taken in collection order (which
    pytest_collection_modifyitems makes longest first) rather than xdist's most-tests-first.

    xdist hands a worker its next unit while the current one still runs (a worker needs to know
    its next test before it runs the last one it holds).  Behind a heavy unit of one test (an
    sglang suite run) that next unit would be the queue's head, often another heavy one, which
    then waits minutes while other workers run out of work: a worker that holds a heavy unit gets
    the first light unit in the queue instead."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            held = self.assigned_work.get(node, {})
            if any(unit_cost(unit, len(tests)) >= HEAVY_S for unit, tests in held.items()
                   if not all(tests.values())):
                light = next((unit for unit, tests in self.workqueue.items()
                              if unit_cost(unit, len(tests)) < HEAVY_S), None)
                if light is not None:
                    self.workqueue.move_to_end(light, last=False)
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False
    return Units(config, log)


def _queue_order(items: list) -> None:
    """Longest unit of work first (EXPECTED_S), so that the last units to start are short and both
    workers finish together; the units that need .venv-sglang (marker ``sglang_venv``) come after
    SGLANG_VENV_HEAD_START_S of the others, when tests/run.sh's background build of it has had a
    head start.  Tests keep their order within a unit."""
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(work_unit(item.nodeid), []).append(item)

    def cost(unit: str) -> float:
        return unit_cost(unit, len(units[unit]))

    venv = {u for u, its in units.items() if any("sglang_venv" in it.keywords for it in its)}
    rest = sorted((u for u in units if u not in venv), key=cost, reverse=True)
    first = sorted((u for u in units if u in venv), key=cost, reverse=True)  # not the set's order
    head, queued = 0, 0.0
    while head < len(rest) and queued < SGLANG_VENV_HEAD_START_S:
        queued += cost(rest[head])
        head += 1
    order = rest[:head] + first + rest[head:]
    items[:] = [item for unit in order for item in units[unit]]


#: Set by tests/run.sh for its parallel run: the tests marked ``alone`` (timing-sensitive: they
#: assert latencies that hold only with the machine to themselves) are left out of that run and
#: their node ids written to this file, for a short run of their own once the parallel one is over.
ALONE_FILE_ENV = "STAGECACHE_TEST_ALONE_FILE"


def _set_aside_alone(config, items: list) -> None:
    """Deselect the ``alone`` tests and write their node ids (one a line) to $ALONE_FILE_ENV.
    Every xdist worker collects the same items and writes the same file (atomically).  The
    variable is taken out of the environment: a pytest that a test starts (the sglang suites in
    their venv) would otherwise overwrite the list with its own, empty one."""
    path = os.environ.pop(ALONE_FILE_ENV, None)
    if not path:
        return
    alone = [item for item in items if "alone" in item.keywords]
    if alone:
        items[:] = [item for item in items if "alone" not in item.keywords]
        config.hook.pytest_deselected(items=alone)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.writelines(f"{item.nodeid}\n" for item in alone)
    os.replace(tmp, path)


def pytest_collection_modifyitems(config, items):
    _set_aside_alone(config, items)
    # The queue's order is for a parallel run's workers (xdist gives each a ``workerinput``; it
    # sets their ``dist`` option to "no"); elsewhere (a plain pytest, the real-sglang suites in
    # their venv: tests/integrations/test_sglang_venv.py) files run in the command line's order.
    if hasattr(config, "workerinput"):
        _queue_order(items)
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


@pytest.fixture(scope="session")
def _chromium() -> Iterator[object]:
    """One headless Chromium per pytest process (about 3 CPU-seconds to start), shared by the
    browser test modules it runs; each module gets it back as ``driver`` on a blank page."""
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


@pytest.fixture(scope="module")
def driver(_chromium) -> Iterator[object]:
    """The process's Chromium for one test module, left as a fresh one starts: a blank page (no
    page of the module polls on), the default window size, no console or network lines."""
    from browser_support import blank

    yield _chromium
    blank(_chromium)
