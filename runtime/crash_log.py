"""Where a traceback goes when something fails that is not the user's input: a log file.

The terminal gets one line naming the error and this file; the file gets the
whole traceback, so an operator can attach it to a report without re-running.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from pathlib import Path


def log_dir() -> Path:
    """``$STAGECACHE_LOG_DIR``, else ``$TMPDIR/stagecache-logs-<uid>`` (created 0700)."""
    env = os.environ.get("STAGECACHE_LOG_DIR")
    path = Path(env) if env else Path(tempfile.gettempdir()) / f"stagecache-logs-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def write_crash_log(what: str, exc: BaseException) -> Path | None:
    """Write ``exc``'s traceback to a new file named after ``what``; None if it cannot be written."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        path = log_dir() / f"{what}-{stamp}-{os.getpid()}.log"
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        path.write_text(f"stagecache {what}, pid {os.getpid()}, {time.ctime()}\n{text}")
    except OSError:
        return None
    return path
