"""Page allocator for one page-id space (a stage's device pools, or its host mirror).

Every refused call changes nothing: ids are checked as a whole before any is
taken or returned, so a caller that catches the error can trust the free count.
Errors name the allocator (``"stage 2 device"``), what was asked and what was
free, because "out of pages" without the stage is useless under PP.
A lock makes it safe to share between the scheduler thread and a HiCache
write-back thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np

from ..errors import StageCacheError


class AllocatorError(StageCacheError):
    """Base of every page-allocator refusal."""


class OutOfPagesError(AllocatorError, MemoryError):
    """More pages asked for than are free."""

    def __init__(self, name: str, asked: int, free: int, total: int):
        self.name, self.asked, self.free, self.total = name, asked, free, total
        super().__init__(f"{name}: out of pages: asked for {asked}, {free} of {total} free")


class DoubleFreeError(AllocatorError, ValueError):
    """A page freed that is not allocated (already freed, or listed twice in one call)."""


class ForeignPageError(AllocatorError, ValueError):
    """A page id this allocator never hands out (out of range or not an integer)."""


class PageAllocator:
    """Hands out page ids ``0..num_pages-1``; lowest ids first on a fresh allocator.

    ``alloc`` returns its ids ascending: a fresh (or freshly freed) range comes back as one
    contiguous run, which the transfer controller turns into one large DMA per run.
    """

    def __init__(self, num_pages: int, name: str = "pool"):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise AllocatorError(f"{name}: num_pages must be a positive integer, got {num_pages!r}")
        self.name = name
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives 0, 1, 2, ...
        self._used = bytearray(num_pages)
        #: The same bytes as a numpy array (shared memory, never resized): vectorised checks.
        self._used_np = np.frombuffer(self._used, dtype=np.uint8)
        self._lock = threading.Lock()
        #: The most pages ever in use at once (occupancy's high-water mark).
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def used_below(self, limit: int) -> int:
        """Allocated ids among ``0..limit-1``: the use of a pool whose own page space is
        the first ``limit`` ids of this one (a kind sized by a smaller budget)."""
        return int(self._used_np[:max(0, limit)].sum(dtype=np.int64))

    def alloc(self, n: int) -> list[int]:
        """``n`` free page ids, or ``OutOfPagesError`` with nothing taken."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise AllocatorError(f"{self.name}: alloc(n) needs an integer n >= 0, got {n!r}")
        with self._lock:
            if n > len(self._free):
                raise OutOfPagesError(self.name, n, len(self._free), self.num_pages)
            ids = sorted(self._free.pop() for _ in range(n))  # ascending: host runs -> few DMAs
            for i in ids:
                self._used[i] = 1
            self.peak_used = max(self.peak_used, self.num_pages - len(self._free))
            return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return pages; every id is checked first, so a refused call frees none."""
        ids = _as_list(ids)
        with self._lock:
            seen: set[int] = set()
            for i in ids:
                if not _is_id(i) or not 0 <= i < self.num_pages:
                    raise ForeignPageError(
                        f"{self.name}: page id {i!r} is not one of this allocator's ids "
                        f"0..{self.num_pages - 1}"
                    )
                if i in seen:
                    raise DoubleFreeError(f"{self.name}: page {i} is listed twice in one free() call")
                if not self._used[i]:
                    raise DoubleFreeError(f"{self.name}: page {i} is not allocated (double free?)")
                seen.add(i)
            for i in ids:
                self._used[i] = 0
            self._free.extend(reversed(ids))

    def check_allocated(self, ids: Iterable[int], what: str = "page") -> None:
        """Raise unless every id is currently allocated (used by transfers at their boundary)."""
        for i in _as_list(ids):
            if not _is_id(i) or not 0 <= i < self.num_pages:
                raise ForeignPageError(
                    f"{self.name}: {what} id {i!r} is out of range 0..{self.num_pages - 1}"
                )
            if not self._used[i]:
                raise AllocatorError(f"{self.name}: {what} {i} is not allocated")

    def used_address(self) -> int:
        """Address of the one-byte-per-page "in use" map (``transfer/native.py`` reads it in C;
        the bytes never move: the numpy view keeps the bytearray from resizing)."""
        return int(self._used_np.ctypes.data)

    def all_allocated(self, ids: np.ndarray) -> bool:
        """Whether every id of an int64 array (already in range) is allocated now (see ``unallocated``)."""
        return bool(self._used_np[ids].all())

    def unallocated(self, ids: np.ndarray) -> np.ndarray:
        """The ids of an int64 array (already in range) that are not allocated now, vectorised.

        Transfers call this at their boundary on every move, so it is one gather and
        one comparison, with no Python loop over the ids and no lock: the pages a caller
        passes are its own, so a concurrent alloc/free of other pages cannot change the answer.
        """
        return ids[self._used_np[ids] == 0]

    def __repr__(self) -> str:
        return f"PageAllocator({self.name!r}, used={self.num_used}/{self.num_pages})"


def _is_id(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


def _as_list(ids: Iterable[int]) -> list[int]:
    if hasattr(ids, "tolist"):  # torch tensors / numpy arrays of ids
        ids = ids.tolist()
    return [int(i) if type(i).__name__.startswith(("int", "uint")) and not isinstance(i, bool) else i
            for i in ids]
