"""``.venv-sglang``: the environment with the real sglang, and waiting for its set-up.

tests/run.sh builds it in the background (tests/setup.d/50-sglang.sh) while the suite runs, and
says where the step reports through ``$STAGECACHE_TEST_SETUP_DIR`` (``50-sglang.rc`` holds the
step's exit status once it is done, ``50-sglang.log`` its output).  Tests that need the
environment carry the ``sglang_venv`` marker (conftest.py queues them after a head start) and call
:func:`sglang_python`, which waits for the step, bounded by ``$STAGECACHE_SGLANG_WAIT_S``.
Outside tests/run.sh (a plain ``pytest``) nothing is waited for: the environment is used when it
is there and the test skips with the command that builds it when it is not.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The release before the pinned one, over the same environment (tests/setup.d/50-sglang.sh).
PREVIOUS_VERSION = "0.5.22"
STEP = "50-sglang"
#: How long a test waits for the background build (a fresh machine builds it in ~4-6 minutes).
WAIT_S = float(os.environ.get("STAGECACHE_SGLANG_WAIT_S", "900"))
#: pytest-timeout for a test that waits and then runs: the wait plus the test's own time (the live
#: suites, the deployment suite and the agreement suite, one after the other).
TIMEOUT_S = int(WAIT_S) + 2400


def _wait_for_step(setup_dir: Path) -> None:
    """Block until the background step reports, failing with its log when it failed."""
    rc_file, deadline = setup_dir / f"{STEP}.rc", time.monotonic() + WAIT_S
    while not rc_file.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"tests/setup.d/{STEP}.sh did not finish within {WAIT_S:.0f} s "
                        f"(STAGECACHE_SGLANG_WAIT_S); its log: {setup_dir / (STEP + '.log')}")
        time.sleep(1.0)
    rc = rc_file.read_text().strip()
    if rc != "0":
        log = (setup_dir / f"{STEP}.log").read_text(errors="replace")[-3000:]
        pytest.fail(f"tests/setup.d/{STEP}.sh failed (exit {rc}):\n{log}")


def sglang_python(version: str | None = None) -> Path:
    """The python of ``.venv-sglang`` (``version``: of ``.venv-sglang-<version>``, the release
    before), once tests/run.sh's build of it is done; skips (fails under CI) where it was never
    built."""
    setup_dir = os.environ.get("STAGECACHE_TEST_SETUP_DIR")
    if setup_dir and (Path(setup_dir) / f"{STEP}.log").exists():
        _wait_for_step(Path(setup_dir))
    name = ".venv-sglang" + (f"-{version}" if version else "")
    python = ROOT / name / "bin" / "python"
    if not python.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: tests/setup.d/50-sglang.sh did not run")
        pytest.skip(f"{name} not built: run bash tests/setup.d/50-sglang.sh")
    return python


def checkout_on_path(tmp_path: Path) -> Path:
    """A PYTHONPATH entry that holds this checkout as the ``stagecache`` package, ahead of
    .venv-sglang's own install (which may be another checkout's): the sglang runs test this code."""
    root = Path(__file__).resolve().parents[2]
    pkg = tmp_path / "path" / "stagecache"
    pkg.mkdir(parents=True)
    for part in ("runtime", "exporters", "dashboard"):
        (pkg / part).symlink_to(root / part)
    return pkg.parent
