"""Where a traceback goes when something fails that is not the user's input: a log file.

The terminal gets one line naming the error and this file; the file gets the
whole traceback, so an operator can attach it to a report without re-running.
The directory is private (``private_fs``): one that another user created first,
or that others can write, is refused (``ConfigError``) instead of written into,
and each log is a new file that is never a followed symlink.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

from .private_fs import create_private_file, ensure_private_dir, user_state_base

WHAT = "crash-log directory"
FIX = "remove it, or set STAGECACHE_LOG_DIR to a directory of yours"


def log_dir() -> Path:
    """``$STAGECACHE_LOG_DIR``, else ``$XDG_RUNTIME_DIR/stagecache-logs``, else
    ``$TMPDIR/stagecache-logs-<uid>``: created 0700, or checked to be ours and private."""
    env = os.environ.get("STAGECACHE_LOG_DIR")
    path = Path(env) if env else user_state_base("stagecache-logs")
    return ensure_private_dir(path, WHAT, FIX, parents=bool(env))


def write_crash_log(what: str, exc: BaseException) -> Path | None:
    """Write ``exc``'s traceback to a new file named after ``what``; None if it cannot be written.

    A directory that is not private raises ``ConfigError`` (the caller reports it, exit 2).
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    directory = log_dir()
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    body = f"stagecache {what}, pid {os.getpid()}, {time.ctime()}\n{text}".encode()
    for attempt in range(100):
        suffix = f"-{attempt}" if attempt else ""
        path = directory / f"{what}-{stamp}-{os.getpid()}{suffix}.log"
        try:
            fd = create_private_file(path)
        except FileExistsError:
            continue
        except OSError:
            return None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
        except OSError:
            return None
        return path
    return None
