"""Where run directories live, who owns one, and how a killed run's directory goes away.

A ``serve`` process holds an exclusive ``flock`` on ``<run dir>/.lock`` for as
long as it lives.  The kernel drops the lock when the process dies, however it
dies (SIGKILL included), so "the lock can be taken" is an exact test for "the
owner is gone" -- no pid that could have been reused, no timestamp guess.

Temporary run directories are made under one known parent per user
(``$XDG_RUNTIME_DIR/stagecache-serve``, else ``$TMPDIR/stagecache-serve-<uid>``);
every ``serve`` start first removes the ones whose owner is gone, so a run
killed with SIGKILL leaves nothing behind past the next start.  A new one is
made and locked under a staging name that sweeps leave to its age, and takes
its ``run-`` name only once locked: a ``serve`` starting beside it can never
take its lock first (between the lock file's creation and its ``flock``) and
remove it.  A ``--run-dir``
of the user's is never removed, only locked (two runs cannot share one) and
emptied of the previous run's files.

Both are private (``private_fs``): the root and a ``--run-dir`` are used only
when they are ours, not symlinks, writable by nobody else, under parents that
nobody else can rename them out of; otherwise exit 2 naming the path and its
owner.  A ``--run-dir`` is then used by its real path, so a symlink above it
that changes later cannot redirect the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..bounded_io import path_kind
from ..errors import ConfigError
from ..live.run_dir import RENDEZVOUS_FILE, RUN_FILE, SNAPSHOT_FILE, STARTUP_FILE
from ..private_fs import check_ancestors, check_private_dir, ensure_private_dir, user_state_base

LOCK_FILE = ".lock"
#: Files of a previous run that a reused ``--run-dir`` is emptied of.
RUN_FILES = (STARTUP_FILE, RUN_FILE, SNAPSHOT_FILE, RENDEZVOUS_FILE)
#: A directory without a lock file is young only while its creator is about to lock it.
UNLOCKED_GRACE_S = 60.0
#: The name of a temporary run directory until its creator holds its lock (then ``run-...``).
STAGING_PREFIX = ".new-"


def run_root() -> Path:
    """The per-user parent of temporary run directories (created 0700, or checked private)."""
    return ensure_private_dir(user_state_base("stagecache-serve"), "run root",
                              "remove it, or pass --run-dir DIR")


@dataclass
class RunDirLock:
    """The held lock of one run directory; ``release`` (or process exit) drops it."""

    path: Path
    fd: int | None
    identity: tuple[int, int] | None = None  # (device, inode) of the directory when claimed

    def replaced(self) -> str | None:
        """Why ``path`` is no longer the directory this lock claimed (None: it still is)."""
        if self.identity is None:
            return None
        try:
            st = os.lstat(self.path)
        except OSError as exc:
            return f"run dir {str(self.path)!r} is gone ({exc.strerror or exc})"
        if (st.st_dev, st.st_ino) != self.identity:
            return f"run dir {str(self.path)!r} was replaced by another directory while the run used it"
        return None

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def _try_lock(lock_path: Path) -> int | None:
    """An fd holding the exclusive lock, or None when a live process holds it."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def claim(run_dir: Path, flag: str = "--run-dir") -> RunDirLock:
    """Lock ``run_dir`` for this process; a directory another live run holds is exit 2."""
    lock_path = run_dir / LOCK_FILE
    try:
        fd = _try_lock(lock_path)
    except OSError as exc:
        raise ConfigError(f"{flag} {str(run_dir)!r}: cannot create {LOCK_FILE}: "
                          f"{exc.strerror or exc}; expected a writable directory") from None
    if fd is None:
        owner = lock_path.read_text().strip() or "?"
        raise ConfigError(f"{flag} {str(run_dir)!r} is in use by another serve process "
                          f"(pid {owner}); expected a directory no running serve uses")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    st = os.lstat(run_dir)
    return RunDirLock(run_dir, fd, (st.st_dev, st.st_ino))


def sweep_stale(root: Path) -> list[Path]:
    """Remove the run directories under ``root`` whose owner is gone; returns what was removed."""
    removed = []
    for entry in root.iterdir():
        if not entry.is_dir() or entry.is_symlink():
            continue
        lock_path = entry / LOCK_FILE
        if entry.name.startswith(STAGING_PREFIX) or not lock_path.exists():  # being claimed
            with contextlib.suppress(OSError):
                if time.time() - entry.stat().st_mtime > UNLOCKED_GRACE_S:
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
            continue
        try:
            fd = _try_lock(lock_path)
        except OSError:
            continue
        if fd is None:
            continue  # its serve process is alive
        try:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        finally:
            os.close(fd)
    return removed


def new_temp_run_dir() -> tuple[Path, RunDirLock, list[Path]]:
    """Sweep stale directories, then make and lock a fresh one: (dir, lock, removed)."""
    root = run_root()
    removed = sweep_stale(root)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
    lock = claim(staging, flag="run dir")
    lock.path = root / ("run-" + staging.name.removeprefix(STAGING_PREFIX))
    staging.rename(lock.path)  # the same directory (inode), locked, under its own name
    return lock.path, lock, removed


def prepare_user_run_dir(run_dir: Path) -> RunDirLock:
    """Create (0700) or check a ``--run-dir``, lock it and remove the previous run's files."""
    ensure_private_dir(run_dir, "--run-dir")
    lock = claim(run_dir)
    for stale in [*run_dir.glob("stage-*.json"), *run_dir.glob("rendezvous-*.store"),
                  *(run_dir / name for name in RUN_FILES)]:
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    return lock


def check_run_dir_flag(value: str) -> Path:
    """``--run-dir``: an existing directory, or a path whose parent is one (exit 2 otherwise)."""
    path = Path(value)
    kind = path_kind(path, f"--run-dir {value!r}")
    if kind is not None and kind != "dir":
        raise ConfigError(f"--run-dir {value!r} is not a directory; expected a directory "
                          "(created if missing) for the run's files")
    if kind is None:
        parent = path.parent if str(path.parent) else Path(".")
        if path_kind(parent, f"--run-dir {value!r}") != "dir":
            raise ConfigError(f"--run-dir {value!r}: parent {str(parent)!r} is not a directory; "
                              "expected a path inside an existing directory")
    probe = path if kind else path.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--run-dir {value!r}: {str(probe)!r} is not writable; expected a "
                          "writable directory")
    check_ancestors(path, "--run-dir")
    if os.path.lexists(path):
        check_private_dir(path, "--run-dir")
        return Path(os.path.realpath(path))
    return Path(os.path.realpath(path.parent)) / path.name
