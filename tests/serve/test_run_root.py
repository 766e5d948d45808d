"""Run-dir ownership: a live run's lock keeps others out; a dead run's directory is swept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.serve.run_root import (
    check_run_dir_flag,
    claim,
    new_temp_run_dir,
    prepare_user_run_dir,
    run_root,
    sweep_stale,
)

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


def test_a_dir_being_claimed_is_left_to_its_age_even_with_its_lock_file_made(tmp_path):
    """Between the lock file's creation and its ``flock`` a sweep could take the lock and remove
    the directory; a new one keeps its staging name until locked, and a sweep leaves those to age."""
    from stagecache.runtime.serve.run_root import LOCK_FILE, STAGING_PREFIX

    claiming = tmp_path / f"{STAGING_PREFIX}abc"
    claiming.mkdir()
    (claiming / LOCK_FILE).write_text("")  # created, not locked yet
    assert sweep_stale(tmp_path) == []
    old = time.time() - 3600
    os.utime(claiming, (old, old))
    assert sweep_stale(tmp_path) == [claiming]  # its creator died before locking it


RACER = """
import sys
from stagecache.runtime.serve.run_root import new_temp_run_dir
lost = []
for _ in range(int(sys.argv[1])):
    try:
        path, lock, _ = new_temp_run_dir()
        (path / "probe").write_text("x")
        if lock.replaced():
            lost.append(lock.replaced())
        lock.release()
    except OSError as exc:
        lost.append(repr(exc))
print(len(lost), lost[:2])
"""


def test_serve_starts_at_the_same_moment_never_remove_each_others_run_dir(tmp_path):
    """Six processes making and sweeping run dirs in one root as fast as they can (each start
    sweeps the others' released ones): none loses the directory it just made.  Before the
    staging name, about one start in 400 found its directory gone."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", RACER, "200"], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(6)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and all(out.startswith("0 ") for out in outs), outs


def test_claiming_twice_in_one_process_is_refused_too(tmp_path):
    lock = claim(tmp_path)
    try:
        with pytest.raises(ConfigError, match="in use"):
            claim(tmp_path)
    finally:
        lock.release()
    claim(tmp_path).release()


# -- private state: another local user cannot plant or swap the run's directories -------------

VICTIM_TEXT = "the victim's own data\n"


@pytest.fixture
def shared(monkeypatch):
    """``$TMPDIR`` is a fresh /tmp-like directory (1777) that uid 65534 can write too."""
    from attacker import shared_tmp

    with shared_tmp() as tmp:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        yield tmp


def test_a_run_root_another_user_made_first_is_refused(shared, tmp_path):
    from attacker import NOBODY, as_nobody

    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    root = shared / f"stagecache-serve-{os.geteuid()}"

    def plant() -> None:
        root.mkdir(mode=0o777)
        root.chmod(0o777)
        (root / "run-planted").symlink_to(victim)

    as_nobody(plant)
    with pytest.raises(ConfigError, match=rf"run root '{root}' is owned by uid {NOBODY} \(nobody\)"):
        new_temp_run_dir()
    assert victim.read_text() == VICTIM_TEXT and [p.name for p in root.iterdir()] == ["run-planted"]


def test_a_run_root_that_is_a_symlink_or_others_can_write_is_refused(shared, tmp_path):
    root = shared / f"stagecache-serve-{os.geteuid()}"
    root.symlink_to(tmp_path)
    with pytest.raises(ConfigError, match=f"run root '{root}' is a symlink"):
        run_root()
    root.unlink()
    root.mkdir()
    root.chmod(0o770)
    with pytest.raises(ConfigError, match=r"is writable by others \(mode 0770\)"):
        run_root()
    assert list(tmp_path.iterdir()) == []


def test_a_fresh_run_root_is_0700_and_xdg_runtime_dir_is_preferred(shared, tmp_path, monkeypatch):
    path, lock, _ = new_temp_run_dir()
    lock.release()
    assert path.parent == shared / f"stagecache-serve-{os.geteuid()}"
    assert path.parent.stat().st_mode & 0o777 == 0o700 and path.stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert run_root() == tmp_path / "stagecache-serve"


def test_a_run_dir_others_could_swap_or_write_is_refused(shared, tmp_path):
    from attacker import as_nobody

    open_parent = shared / "open"  # writable by everyone and not sticky: anyone can rename in it
    open_parent.mkdir()
    open_parent.chmod(0o777)
    with pytest.raises(ConfigError, match=rf"its parent '{open_parent}' \(owner uid 0 \(root\), mode "
                       r"0777\) lets another user replace it"):
        check_run_dir_flag(str(open_parent / "run"))
    wide = tmp_path / "wide"
    wide.mkdir()
    wide.chmod(0o777)
    with pytest.raises(ConfigError, match=r"--run-dir '.*wide' \(owner uid 0 \(root\)\) is writable by others"):
        check_run_dir_flag(str(wide))
    link = tmp_path / "link"
    link.symlink_to(wide)
    with pytest.raises(ConfigError, match=r"--run-dir '.*link' is a symlink"):
        check_run_dir_flag(str(link))
    planted = shared / "planted"
    as_nobody(lambda: planted.mkdir(mode=0o700))
    with pytest.raises(ConfigError, match=r"--run-dir '.*planted' is owned by uid 65534"):
        check_run_dir_flag(str(planted))


def test_a_run_dir_is_used_by_its_real_path_and_created_0700(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "via").symlink_to(real)
    path = check_run_dir_flag(str(tmp_path / "via" / "run"))
    assert path == real / "run"  # a later change of the symlink cannot redirect the run
    lock = prepare_user_run_dir(path)
    try:
        assert path.stat().st_mode & 0o777 == 0o700
    finally:
        lock.release()


def test_a_swapped_run_dir_is_noticed(tmp_path):
    run = tmp_path / "run"
    lock = prepare_user_run_dir(run)
    try:
        assert lock.replaced() is None
        run.rename(tmp_path / "moved")
        run.mkdir(mode=0o700)  # another directory under the same name
        assert lock.replaced() == (f"run dir '{run}' was replaced by another directory while the "
                                   "run used it")
        run.rmdir()
        assert "is gone" in lock.replaced()
    finally:
        lock.release()


def test_the_lock_file_is_never_a_followed_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / ".lock").symlink_to(victim)
    with pytest.raises(ConfigError, match="cannot create .lock"):
        prepare_user_run_dir(run)
    assert victim.read_text() == VICTIM_TEXT


def test_serve_exits_2_with_one_line_on_a_hijacked_run_root(shared):
    from attacker import as_nobody

    root = shared / f"stagecache-serve-{os.geteuid()}"
    as_nobody(lambda: root.mkdir(mode=0o700))
    env = {**os.environ, "TMPDIR": str(shared), "XDG_RUNTIME_DIR": ""}
    r = subprocess.run([sys.executable, "-m", "stagecache.runtime", "serve", "--no-dashboard",
                        "--exit-after-run", "--rate", "0", "--requests", "4"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"stagecache serve: error: run root '{root}' is owned by uid 65534")
    assert "remove it, or pass --run-dir DIR" in line
