"""The CPU mover: pools on the CPU, synchronous -- the checked reference every mover is tested against.

A move is one call into the compiled helper (``native.py``) where it was built at install: one
``memcpy`` per page per buffer over a table of the selection's buffer addresses made once, without
the GIL, over torch's OpenMP threads from ``THREADS_FROM_BYTES`` (on 2 CPU cores 1.4-9x faster
than the per-page ``torch.copy_`` loop at every point of ``bench transfer``).  The common move is
checked and copied in that one call (``check_and_move``, on the caller's own ids): a one-page move
copies for a few us, so converting the ids, checking them and copying in three calls cost more
than the per-page loop does.  Without the helper, one numpy fancy-indexed assignment per buffer,
which is the same copy stated as plainly as it can be.
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


#: What a CPU move returns: done on return, no events.
DONE = Queued()


class CpuMover(PageMover):
    """Copies between CPU device pools and their host mirror, synchronously."""

    path = "cpu"

    def __init__(self, dp: StagePools, hp: HostPools, context: native.Context | None = None):
        """``context``: the page checker's (``PageChecker.context``), for ``check_and_move``."""
        import torch

        super().__init__(dp, hp)
        self._native = native.module()
        self._context = context.words if context is not None else None
        self._threads = max(1, torch.get_num_threads())
        # per selection, made once: the 5-word address rows, and from how many pages to use threads
        self._tables: dict[Selection, tuple[np.ndarray, int]] = {}
        self._views: dict[BufferRef, tuple[np.ndarray, np.ndarray]] = {}  # numpy views, made once

    def move(self, steps: list[Selection], ids: PageIds, d2h: bool, per_layer: bool = False) -> Queued:
        for sel in steps:
            self._copy(sel, ids, d2h)
        return DONE

    def check_and_move(self, sel: Selection, dev: object, host: object, d2h: bool) -> Queued | None:
        """Check and copy in one compiled call on the caller's ids; None when it did not (no
        compiled helper or context, ids it does not read in place, or one that fails a check:
        nothing moved, and the controller's checks name what is wrong)."""
        if self._context is None or not sel.buffers:
            return None
        table, threads_from = self._table(sel)
        if self._native.copy_checked(self._context, table, dev, host, d2h, self._threads, threads_from):
            return DONE
        return None

    def _table(self, sel: Selection) -> tuple[np.ndarray, int]:
        plan = self._tables.get(sel)
        if plan is None:
            table = np.array(buffer_addresses(sel, self.dp, self.hp), dtype=np.int64).reshape(-1)
            plan = self._tables[sel] = table, -(-THREADS_FROM_BYTES // max(1, sel.page_bytes))
        return plan

    def _copy(self, sel: Selection, ids: PageIds, d2h: bool) -> None:
        if self._native is None:
            self._copy_numpy(sel, ids, d2h)
            return
        table, threads_from = self._table(sel)
        self._native.copy_pages(table, ids.device, ids.host, d2h, self._threads if ids.count >= threads_from else 1)

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
