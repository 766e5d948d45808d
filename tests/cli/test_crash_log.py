"""The crash-log directory cannot be hijacked by another local user.

Another user (uid 65534) creates ``$TMPDIR/stagecache-logs-<uid>`` first and plants symlinks
to a victim file in it; or the directory is ours but others can write it; or it is a symlink.
An internal error then exits 2 naming the directory and its owner, and the victim is unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from attacker import NOBODY, as_nobody, shared_tmp
from stagecache.runtime import crash_log
from stagecache.runtime.errors import ConfigError

#: A ``check`` run with a planted bug: an internal error, whose traceback goes to a crash log.
BUGGY = ("import sys; import stagecache.runtime.cli.check as c\n"
         "def boom(args): raise RuntimeError('planted bug')\n"
         "c.run = boom\n"
         "from stagecache.runtime.cli.main import main\n"
         "sys.exit(main(['check', '--model', 'tiny-v4']))\n")
VICTIM_TEXT = "the victim's own data\n"


def _crash(tmpdir, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("STAGECACHE_LOG_DIR", "XDG_RUNTIME_DIR")}
    return subprocess.run([sys.executable, "-c", BUGGY], capture_output=True, text=True, timeout=60,
                          env={**clean, "TMPDIR": str(tmpdir), **env})


def _one_line(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.strip().splitlines()
    return line


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text(VICTIM_TEXT)
    return path


def test_a_directory_another_user_made_first_is_refused_and_the_victim_kept(victim):
    with shared_tmp() as tmp:
        logs = tmp / f"stagecache-logs-{os.geteuid()}"

        def plant() -> None:
            logs.mkdir(mode=0o777)
            logs.chmod(0o777)
            for i in range(50):  # whatever name the log would get: a symlink to the victim
                (logs / f"check-{i}.log").symlink_to(victim)

        as_nobody(plant)
        r = _crash(tmp)
        assert r.returncode == 2, r.stderr
        line = _one_line(r)
        assert f"crash-log directory '{logs}' is owned by uid {NOBODY}" in line
        assert "RuntimeError: planted bug was not logged" in line
        assert sorted(p.name for p in logs.iterdir()) == sorted(f"check-{i}.log" for i in range(50))
    assert victim.read_text() == VICTIM_TEXT


def test_our_own_directory_that_others_can_write_is_refused(victim):
    with shared_tmp() as tmp:
        logs = tmp / f"stagecache-logs-{os.geteuid()}"
        logs.mkdir()
        logs.chmod(0o777)  # root owns it: the mode is what makes it unsafe
        r = _crash(tmp)
        assert r.returncode == 2
        assert f"'{logs}' (owner uid 0 (root)) is writable by others (mode 0777)" in _one_line(r)
        assert list(logs.iterdir()) == []


def test_a_symlinked_log_dir_is_refused(tmp_path, victim):
    link = tmp_path / "logs"
    link.symlink_to(tmp_path)
    r = _crash(tmp_path, STAGECACHE_LOG_DIR=str(link))
    assert r.returncode == 2
    assert f"crash-log directory '{link}' is a symlink" in _one_line(r)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "victim.txt"]


def test_a_fresh_directory_is_made_0700_and_the_log_written(tmp_path):
    r = _crash(tmp_path)
    assert r.returncode == 3, r.stderr
    logs = tmp_path / f"stagecache-logs-{os.geteuid()}"
    assert logs.stat().st_mode & 0o777 == 0o700
    [log] = list(logs.iterdir())
    assert log.stat().st_mode & 0o777 == 0o600 and "planted bug" in log.read_text()
    assert f"traceback in {log}" in _one_line(r)


def test_xdg_runtime_dir_is_preferred(tmp_path):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    r = _crash(tmp_path / "unused", XDG_RUNTIME_DIR=str(xdg))
    assert r.returncode == 3, r.stderr
    [log] = list((xdg / "stagecache-logs").iterdir())
    assert f"traceback in {log}" in _one_line(r)


def test_a_planted_symlink_at_the_log_name_is_never_followed(tmp_path, victim, monkeypatch):
    """Inside our own directory too: the file is created O_EXCL | O_NOFOLLOW, under a new name."""
    logs = tmp_path / "logs"
    monkeypatch.setenv("STAGECACHE_LOG_DIR", str(logs))
    monkeypatch.setattr(crash_log.time, "strftime", lambda _fmt: "STAMP")
    logs.mkdir(mode=0o700)
    (logs / f"what-STAMP-{os.getpid()}.log").symlink_to(victim)
    path = crash_log.write_crash_log("what", RuntimeError("boom"))
    assert path == logs / f"what-STAMP-{os.getpid()}-1.log" and "boom" in path.read_text()
    assert victim.read_text() == VICTIM_TEXT


def test_the_library_call_raises_a_config_error_naming_the_owner(monkeypatch):
    with shared_tmp() as tmp:
        logs = tmp / "logs"
        as_nobody(lambda: logs.mkdir(mode=0o700))
        monkeypatch.setenv("STAGECACHE_LOG_DIR", str(logs))
        with pytest.raises(ConfigError, match=rf"is owned by uid {NOBODY} \(nobody\), not by you"):
            crash_log.write_crash_log("what", RuntimeError("boom"))
