"""Directories and files that only this user can touch: crash logs, the run root, run directories.

Another local user is a threat on a shared host.  A directory that stagecache writes is used
only when

* it was just created by us with mode 0700, or
* it already exists, is not a symlink, is a directory owned by the effective uid and is
  writable by nobody else (no group/other write bit),

and every directory above it is owned by root or by us and, where others may write it, has the
sticky bit (as ``/tmp`` has), so nobody else can rename it away and put their own in its place.
Anything else is a ``ConfigError`` (exit 2) naming the path, its owner and mode: no directory
another user made first (``/tmp/stagecache-logs-<uid>`` planted with a symlink inside) is ever
written into.  Files inside are created with ``O_CREAT | O_EXCL | O_NOFOLLOW``, so a planted
symlink is never followed.  ``$XDG_RUNTIME_DIR`` (per user, 0700, made by the login manager) is
preferred over the shared temp directory when it is set.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from .errors import ConfigError

#: Flags of every file stagecache creates inside a private directory.
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def user_state_base(name: str) -> Path:
    """Where a per-user directory ``name`` lives: ``$XDG_RUNTIME_DIR/<name>`` when that is set,
    else ``$TMPDIR/<name>-<uid>`` (the shared temp dir, where the owner check matters)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR", "").strip()
    if xdg:
        return Path(xdg) / name
    return Path(tempfile.gettempdir()) / f"{name}-{os.geteuid()}"


def check_private_dir(path: Path, what: str, fix: str = "", closed: bool = False) -> None:
    """Refuse ``path`` unless it is a real directory of ours that only we can write (``closed``:
    that nobody else can even enter, as a store of cached KV bytes must be)."""
    hint = f"; {fix}" if fix else ""
    verb = "enter" if closed else "write"
    expected = f"expected a directory owned by {_owner(os.geteuid())} that only it can {verb}{hint}"
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r}: cannot inspect: {exc.strerror or exc}; "
                          f"{expected}") from None
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"{what} {str(path)!r} is a symlink (owner {_owner(st.st_uid)}); {expected}")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {str(path)!r} is not a directory (owner {_owner(st.st_uid)}); "
                          f"{expected}")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"{what} {str(path)!r} is owned by {_owner(st.st_uid)}, not by you; "
                          f"{expected}")
    if st.st_mode & (0o077 if closed else stat.S_IWGRP | stat.S_IWOTH):
        others = "lets other users in" if closed else "is writable by others"
        raise ConfigError(f"{what} {str(path)!r} (owner {_owner(st.st_uid)}) {others} "
                          f"(mode {stat.S_IMODE(st.st_mode):04o}); {expected}")


def check_ancestors(path: Path, what: str) -> None:
    """Every directory above ``path`` (symlinks resolved) is root's or ours, and others can
    write it only when it is sticky: nobody else can rename ``path`` and plant another."""
    me = os.geteuid()
    real = Path(os.path.realpath(path.parent))
    for parent in [*reversed(real.parents), real]:
        _check_ancestor(parent, me, what, path)


def _check_ancestor(parent: Path, me: int, what: str, path: Path) -> None:
    try:
        st = os.stat(parent)
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r}: cannot inspect {str(parent)!r}: "
                          f"{exc.strerror or exc}; expected a path inside existing directories") from None
    shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if st.st_uid not in (0, me) or (shared and not st.st_mode & stat.S_ISVTX):
        raise ConfigError(
            f"{what} {str(path)!r}: its parent {str(parent)!r} (owner {_owner(st.st_uid)}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}) lets another user replace it; expected a path whose "
            "parents are yours or root's and, where others can write them, sticky (like /tmp)")


def ensure_private_dir(path: Path, what: str, fix: str = "", parents: bool = False,
                       closed: bool = False) -> Path:
    """``path`` created 0700, or checked when it exists (see the module doc); returns it."""
    if parents:
        try:
            os.makedirs(path.parent, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{what} {str(path)!r}: cannot create its parent: "
                              f"{exc.strerror or exc}; expected a writable location") from None
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r}: cannot create: {exc.strerror or exc}; "
                          "expected a writable location") from None
    check_ancestors(path, what)
    check_private_dir(path, what, fix, closed)
    return path


def create_private_file(path: Path) -> int:
    """A new file (mode 0600) opened for writing; never follows a symlink, never reuses a file."""
    return os.open(path, NEW_FILE_FLAGS, 0o600)
