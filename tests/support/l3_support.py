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
