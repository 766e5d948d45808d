"""The reference store: a dict in this process, the behaviour every backend is tested against.

It keeps the same contract as the real backends (outcomes, LRU eviction under a byte bound,
segment sizes checked on read) with nothing that can fail underneath, so a test can replay the
same operations against it and a backend and require the same outcomes and bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from stagecache.runtime.storage.base import L3Store, Outcome, Segments, segments_bytes


class MemoryStore(L3Store):
    """A byte-bounded LRU dict of objects (``capacity_bytes`` 0: unbounded)."""

    backend = "memory"

    def __init__(self, capacity_bytes: int = 0):
        super().__init__()
        self.stats.capacity_bytes = capacity_bytes
        self._objects: OrderedDict[str, bytes] = OrderedDict()

    def _room(self, need: int) -> bool:
        cap = self.stats.capacity_bytes
        if cap and need > cap:
            return False
        while cap and self.stats.used_bytes + need > cap and self._objects:
            _, old = self._objects.popitem(last=False)
            self.stats.used_bytes -= len(old)
            self.stats.evictions += 1
        return True

    def _put(self, key: str, data: bytes) -> Outcome:
        if key in self._objects:
            self._objects.move_to_end(key)
            return Outcome.OK
        if not self._room(len(data)):
            return Outcome.NO_SPACE
        self._objects[key] = data
        self.stats.used_bytes += len(data)
        return Outcome.OK

    def _get_into(self, keys: Sequence[str], views: Sequence[Segments]) -> list[Outcome]:
        out = []
        for key, segs in zip(keys, views, strict=True):
            data = self._objects.get(key)
            if data is None:
                out.append(Outcome.MISSING)
                continue
            if len(data) != segments_bytes(segs):
                out.append(Outcome.CORRUPT)
                continue
            pos = 0
            for t in segs:
                n = int(t.numel())
                t.copy_(torch.frombuffer(bytearray(data[pos:pos + n]), dtype=torch.uint8))
                pos += n
            self._objects.move_to_end(key)
            out.append(Outcome.OK)
        return out

    def _set_from(self, keys: Sequence[str], views: Sequence[Segments]) -> list[Outcome]:
        return [self._put(k, b"".join(t.numpy().tobytes() for t in segs))
                for k, segs in zip(keys, views, strict=True)]

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self._objects for k in keys]

    def get(self, key: str) -> bytes | None:
        return self._objects.get(key)

    def set(self, key: str, data: bytes) -> Outcome:
        old = self._objects.pop(key, None)
        if old is not None:
            self.stats.used_bytes -= len(old)
        return self._put(key, bytes(data))

    def remove(self, keys: Sequence[str]) -> None:
        for k in keys:
            old = self._objects.pop(k, None)
            if old is not None:
                self.stats.used_bytes -= len(old)

    def reset(self) -> int:
        n = len(self._objects)
        self._objects.clear()
        self.stats.used_bytes = 0
        return n

    def corrupt(self, key: str) -> None:
        """Flip one byte of a stored object (tests of the corruption path)."""
        data = bytearray(self._objects[key])
        data[len(data) // 2] ^= 0xFF
        self._objects[key] = bytes(data)
