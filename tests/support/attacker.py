"""Another local user for the security tests: code run as uid/gid 65534 (nobody) in a forked child.

The suite runs as root, where ownership checks are moot for our own files; the attacker's
state (a directory planted first, a symlink to a victim) is made by a real second uid.
``shared_tmp`` is a world-writable sticky directory like ``/tmp`` that both can reach.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

NOBODY = 65534


def as_nobody(fn: Callable[[], None]) -> None:
    """Run ``fn`` as uid/gid 65534 in a child process; raise if it failed."""
    if os.geteuid() != 0:
        import pytest

        pytest.skip("needs root to act as a second user (uid 65534)")
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, do the attack, report by exit code
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported through the exit code
            os.write(2, f"attacker failed: {exc!r}\n".encode())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the attacker's set-up failed"


@contextmanager
def shared_tmp() -> Iterator[Path]:
    """A fresh ``/tmp``-like directory (mode 1777) that uid 65534 can reach; removed after."""
    top = Path(tempfile.mkdtemp(prefix="stagecache-shared-", dir="/tmp"))
    try:
        top.chmod(0o711)
        shared = top / "tmp"
        shared.mkdir()
        shared.chmod(0o1777)
        yield shared
    finally:
        shutil.rmtree(top, ignore_errors=True)
