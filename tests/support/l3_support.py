"""L3 stores for tests: the reference, a private file store, a real Mooncake master on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def mooncake_unavailable() -> str | None:
    """Why the Mooncake wheel cannot be used here (one line), or None."""
    try:
        import mooncake.store  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any load failure is a reason to skip
        return f"mooncake wheel not loadable: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    from stagecache.runtime.storage.base import StoreUnavailable
    from stagecache.runtime.storage.master import master_binary

    try:
        master_binary()
    except StoreUnavailable as exc:
        return str(exc)
    return None


def need_mooncake() -> None:
    why = mooncake_unavailable()
    if why:
        pytest.skip(why)


@contextmanager
def mooncake_master() -> Iterator[object]:
    """A real ``mooncake_master`` on 127.0.0.1, stopped by pid at the end."""
    need_mooncake()
    from stagecache.runtime.storage.master import MooncakeMaster

    master = MooncakeMaster()
    master.start()
    try:
        yield master
    finally:
        master.stop()


def corrupt_records(directory, *key_parts: str, at: int = 0) -> int:
    """Flip one payload byte (``at``, from the payload's start) of every page object in the file
    store's segments whose key contains each of ``key_parts``; how many were flipped."""
    import os
    from pathlib import Path

    from stagecache.runtime.storage.segments import SEGMENT_SUFFIX, scan

    n = 0
    for path in sorted(Path(directory).glob("*" + SEGMENT_SUFFIX)):
        fd = os.open(path, os.O_RDWR)
        try:
            records, _ = scan(fd, os.fstat(fd).st_size)
            for off, head in records:
                if all(p in head.key for p in key_parts) and head.payload > at:
                    where = off + head.head + at
                    os.pwrite(fd, bytes([os.pread(fd, 1, where)[0] ^ 0x5A]), where)
                    n += 1
        finally:
            os.close(fd)
    return n
