"""Every backend against the reference store: the same calls give the same outcomes and bytes.

The reference (``MemoryStore``) is a dict; the file store and a real Mooncake client (a real
``mooncake_master`` on 127.0.0.1) must agree with it on hits, misses, zero-copy reads into
several segments, and small objects.
"""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
from l3_support import mooncake_master
from memory_store import MemoryStore
from stagecache.runtime.storage.base import Outcome
from stagecache.runtime.storage.file import FileStore

KEYS = [f"sc1.0123456789abcdef.t0.p0.L0-2.swa.{i:016x}" for i in range(6)]


def _open(kind: str, tmp_path, stack: ExitStack):
    if kind == "memory":
        return MemoryStore()
    if kind == "file":
        return FileStore(tmp_path / "l3")
    master = stack.enter_context(mooncake_master())
    from stagecache.runtime.storage.mooncake import MooncakeStore

    return stack.enter_context(MooncakeStore(master.address, 64 << 20))


def _pages(n: int, nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), generator=g, dtype=torch.uint8)


def _script(store) -> list:
    """One fixed sequence of calls; what it saw, for comparison across backends."""
    src, dst = _pages(6, 3000, 1), torch.zeros(6, 3000, dtype=torch.uint8)
    store.register([src, dst])
    seen = []
    # two segments per object (layer_first pages: one per buffer)
    seen.append(store.batch_set_from(KEYS[:4], [[p[:1000], p[1000:]] for p in src[:4]]))
    seen.append(store.batch_exists(KEYS))
    seen.append(store.batch_exists(KEYS[:3]))
    got = store.batch_get_into(KEYS[2:6], [[p[:1000], p[1000:]] for p in dst[2:6]])
    seen.append(got)
    seen.append(torch.equal(dst[2:4], src[2:4]) and not dst[4:].any())
    # a read into another segment split of the same bytes is the same object
    seen.append(store.batch_get_into(KEYS[:1], [[dst[0][:3000]]]))
    seen.append(torch.equal(dst[0], src[0]))
    seen.append(store.set("sc1.manifest", b'{"x": 1}'))
    seen.append(store.get("sc1.manifest"))
    seen.append(store.get("sc1.absent"))
    store.remove(KEYS[:1])
    seen.append(store.batch_exists(KEYS[:2]))
    return seen


@pytest.mark.parametrize("kind", ["file", "mooncake"])
def test_backend_matches_the_reference(kind, tmp_path):
    with ExitStack() as stack:
        store = _open(kind, tmp_path, stack)
        got = _script(store)
    want = _script(MemoryStore())
    assert got == want
    assert want[0] == [Outcome.OK] * 4 and want[1] == 4
    assert want[3] == [Outcome.OK, Outcome.OK, Outcome.MISSING, Outcome.MISSING]


@pytest.mark.parametrize("kind", ["memory", "file", "mooncake"])
def test_counters_count_bytes_hits_and_misses(kind, tmp_path):
    with ExitStack() as stack:
        store = _open(kind, tmp_path, stack)
        src = _pages(2, 4096, 2)
        store.register([src])
        store.batch_set_from(KEYS[:2], [[p] for p in src])
        store.batch_get_into(KEYS[:3], [[p] for p in src] + [[src[0]]])
        s = store.stats
        assert (s.writes, s.write_bytes, s.reads, s.read_bytes, s.misses) == (2, 8192, 2, 8192, 1)
        assert s.error_count == 0 and s.read_seconds > 0 and s.write_seconds > 0
