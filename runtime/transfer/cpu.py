"""The CPU mover: pools on the CPU, synchronous -- the checked reference every mover is tested against.

A move is one call into the compiled helper (``native.py``) where it was built at install: one
``memcpy`` per page per buffer over a table of the selection's buffer addresses made once, without
the GIL, over torch's OpenMP threads from ``THREADS_FROM_BYTES`` (on 2 CPU cores 1.4-9x faster
than the per-page ``torch.copy_`` loop at every point of ``bench transfer``).  Without it, one
numpy fancy-indexed assignment per buffer, which is the same copy stated as plainly as it can be.
"""

from __future__ import annotations

import numpy as np

from ..memory.host_pools import HostPools
from ..memory.pools import StagePools
from . import native
from .mover import PageMover, Queued
from .pages import PageIds
from .selection import BufferRef, Selection, buffer_addresses, buffer_pair

#: Moves from this size are split over torch's intra-op thread count in the compiled copy, on
#: torch's own OpenMP threads (``native.c``, ``copy_parallel``): a parallel region costs a few us
#: there, so on 2 cores SWA at 4 MiB went from 0.8-0.9x the per-page loop to 1.4-2.3x.
THREADS_FROM_BYTES = 256 << 10


class CpuMover(PageMover):
    """Copies between CPU device pools and their host mirror, synchronously."""

    path = "cpu"

    def __init__(self, dp: StagePools, hp: HostPools):
        import torch

        super().__init__(dp, hp)
        self._native = native.module()
        self._threads = max(1, torch.get_num_threads())
        self._tables: dict[Selection, np.ndarray] = {}  # per selection: 5-word address rows, made once
        self._views: dict[BufferRef, tuple[np.ndarray, np.ndarray]] = {}  # numpy views, made once

    def move(self, steps: list[Selection], ids: PageIds, d2h: bool, per_layer: bool = False) -> Queued:
        for sel in steps:
            self._copy(sel, ids, d2h)
        return Queued()

    def _copy(self, sel: Selection, ids: PageIds, d2h: bool) -> None:
        if self._native is None:
            self._copy_numpy(sel, ids, d2h)
            return
        table = self._tables.get(sel)
        if table is None:
            table = self._tables[sel] = np.array(buffer_addresses(sel, self.dp, self.hp), dtype=np.int64).reshape(-1)
        threads = self._threads if ids.count * sel.page_bytes >= THREADS_FROM_BYTES else 1
        self._native.copy_pages(table, ids.device, ids.host, d2h, threads)

    def _copy_numpy(self, sel: Selection, ids: PageIds, d2h: bool) -> None:
        for ref in sel.buffers:
            views = self._views.get(ref)
            if views is None:
                d_t, h_t = buffer_pair(ref, self.dp, self.hp)
                views = self._views[ref] = (d_t.numpy(), h_t.numpy())
            d, h = views
            if d2h:
                h[ids.host] = d[ids.device]
            else:
                d[ids.device] = h[ids.host]
