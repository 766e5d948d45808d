"""Run-dir ownership: a live run's lock keeps others out; a dead run's directory is swept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.serve.run_root import claim, prepare_user_run_dir, sweep_stale

HOLDER = ("import sys, time; from pathlib import Path; "
          "from stagecache.runtime.serve.run_root import claim; "
          "claim(Path(sys.argv[1])); print('locked', flush=True); time.sleep(120)")


def _hold(path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_live_owner_keeps_its_run_dir_and_a_dead_one_loses_it(tmp_path):
    live, dead = tmp_path / "run-live", tmp_path / "run-dead"
    live.mkdir()
    dead.mkdir()
    (dead / "stage-0.json").write_text("{}")
    owner, gone = _hold(live), _hold(dead)
    try:
        os.kill(gone.pid, signal.SIGKILL)  # no cleanup runs; the kernel drops its lock
        gone.wait(10)
        with pytest.raises(ConfigError, match=rf"in use by another serve process \(pid {owner.pid}\)"):
            prepare_user_run_dir(live)
        assert sweep_stale(tmp_path) == [dead]
        assert live.is_dir() and not dead.exists()
    finally:
        owner.kill()
        owner.wait(10)
    assert sweep_stale(tmp_path) == [live]  # its owner is gone now too


def test_a_fresh_unlocked_dir_is_left_alone_for_its_creator(tmp_path):
    young = tmp_path / "run-young"
    young.mkdir()  # made by mkdtemp, not locked yet
    assert sweep_stale(tmp_path) == []
    old = time.time() - 3600
    os.utime(young, (old, old))
    assert sweep_stale(tmp_path) == [young]


def test_claiming_twice_in_one_process_is_refused_too(tmp_path):
    lock = claim(tmp_path)
    try:
        with pytest.raises(ConfigError, match="in use"):
            claim(tmp_path)
    finally:
        lock.release()
    claim(tmp_path).release()
