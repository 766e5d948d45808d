"""The serving parent's own files: a run.json that cannot be written (read-only file system, disk
full) is logged, counted on /metrics and retried, while the dashboard keeps answering.

The file system really fails: the run dir lies on a small tmpfs that the test remounts
read-only, then fills (needs root and mount; skipped elsewhere).
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess

import httpx
import pytest
from stagecache.dashboard.server import dashboard_in_thread
from stagecache.runtime.cli.main import build_parser
from stagecache.runtime.cli.serve import options_from_args
from stagecache.runtime.serve.supervisor import Supervisor


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _remount(mnt, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], check=True)


def _fill(path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def _failures(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    [line] = [ln for ln in text.splitlines() if ln.startswith("stagecache_run_file_write_failures_total")]
    return float(line.split()[-1])


def test_a_failed_run_file_write_is_logged_counted_and_retried(small_fs, caplog, free_port):
    opts = options_from_args(build_parser().parse_args(
        ["serve", "--no-dashboard", "--requests", "4", "--run-dir", str(small_fs)]))
    sup = Supervisor(opts, str(small_fs))
    assert sup.write_run_file()
    with dashboard_in_thread(sup.source, port=free_port) as url, \
            caplog.at_level(logging.WARNING, "stagecache"):
        _remount(small_fs, "ro")
        try:
            assert [sup.write_run_file() for _ in range(3)] == [False, False, False]
            assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
            assert _failures(url) == 3
        finally:
            _remount(small_fs, "rw")
        [warning] = [r.getMessage() for r in caplog.records]
        assert warning == (f"cannot write run.json in {small_fs}: Read-only file system; "
                           "retrying (the run and the dashboard go on)")
        _fill(small_fs / "filler")  # disk full: ENOSPC
        assert not sup.write_run_file() and _failures(url) == 4
        (small_fs / "filler").unlink()
        assert sup.write_run_file()
        assert caplog.records[-1].getMessage() == "run.json written again after 4 failed write(s)"
        assert (small_fs / "run.json").is_file() and _failures(url) == 4
