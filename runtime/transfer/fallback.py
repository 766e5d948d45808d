"""The engines for where the Triton kernel cannot run: CPU pools, and CUDA without Triton or pinning.

* ``CpuEngine`` (path ``cpu``): pools on the CPU.  Where the compiled module
  (``native.py``) is built, a whole move is one call into C: one ``memcpy`` per
  page per buffer over a table of the sel's buffer addresses made once, without
  the GIL, over torch's OpenMP threads from ``THREADS_FROM_BYTES`` -- on 2 CPU
  cores 1.4-2.4x faster than the per-page ``torch.copy_`` loop at every point of
  ``bench transfer``, 6-13x for C128 (whose small pages cost the loop a dispatch
  each).  Elsewhere numpy views of every
  buffer are taken once; small pages move by one fancy-indexed assignment per
  buffer, large pages by one row assignment per page (a single ``memcpy`` each,
  no temporary) or torch's threaded ``copy_`` from 128 KiB.
* ``TorchEngine`` (path ``torch``): CUDA pools with pageable host memory (the
  kernel cannot address it) or without Triton.  Device-side ``index_select`` /
  ``index_copy_`` plus one host copy per buffer; synchronous, a fallback for
  correctness rather than speed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..memory.host_pools import HostPools
from ..memory.pools import StagePools
from . import native
from .pages import PageIds
from .selection import BufferRef, Selection, buffer_addresses, buffer_pair

#: Pages smaller than this move by one fancy-indexed assignment per buffer (when more than
#: ``ROW_LOOP_MAX_PAGES`` move); measured on CPU: per-row numpy assignment wins from ~16 KiB.
FANCY_BELOW_BYTES = 16384
ROW_LOOP_MAX_PAGES = 2
#: Pages from this size move by ``torch.Tensor.copy_`` per row: torch splits a copy this big
#: over its intra-op threads (45 against 32 GB/s for 512 KiB rows on 2 cores), which pays
#: for its dispatch; below it numpy's single-threaded row copy is cheaper per call.
TORCH_FROM_BYTES = 128 << 10
#: Moves from this size are split over torch's intra-op thread count in the compiled copy, on
#: torch's own OpenMP threads (``native.c``, ``copy_parallel``): a parallel region costs a few us
#: there, so on 2 cores SWA at 4 MiB went from 0.8-0.9x the per-page loop to 1.4-2.3x.
THREADS_FROM_BYTES = 256 << 10


def _copy_threads() -> int:
    import torch

    return max(1, torch.get_num_threads())


class CpuEngine:
    """Synchronous copies between CPU device pools and their host mirror, through numpy views."""

    path = "cpu"

    def __init__(self, dp: StagePools, hp: HostPools):
        self.dp, self.hp = dp, hp
        self._views: dict[BufferRef, tuple[np.ndarray, np.ndarray]] = {}  # numpy views, made once
        self._rows: dict[tuple[str, int], tuple[Any, Any]] = {}  # row views of buffers with big pages
        self._native = native.module()
        self._threads = _copy_threads()
        self._tables: dict[Selection, np.ndarray] = {}  # per sel: (dev base, host base, strides, page bytes) rows

    def run(self, sel: Selection, ids: PageIds, d2h: bool) -> None:
        """Copy the (checked) pages of every buffer of ``sel``."""
        if self._native is not None:
            table = self._tables.get(sel)
            if table is None:
                table = self._tables[sel] = self._table(sel)
            threads = self._threads if ids.count * sel.page_bytes >= THREADS_FROM_BYTES else 1
            self._native.copy_pages(table, ids.device, ids.host, d2h, threads)
            return
        self._run_numpy(sel, ids, d2h)

    def _table(self, sel: Selection) -> np.ndarray:
        return np.array(buffer_addresses(sel, self.dp, self.hp), dtype=np.int64).reshape(-1)

    def _run_numpy(self, sel: Selection, ids: PageIds, d2h: bool) -> None:
        n = ids.count
        lists: tuple[list[int], list[int]] | None = None
        for ref in sel.buffers:
            views = self._views.get(ref)
            if views is None:
                d_t, h_t = buffer_pair(ref, self.dp, self.hp)
                views = self._views[ref] = (d_t.numpy(), h_t.numpy())
            d, h = views
            if ref.page_bytes < FANCY_BELOW_BYTES and n > ROW_LOOP_MAX_PAGES:
                if d2h:
                    h[ids.host] = d[ids.device]
                else:
                    d[ids.device] = h[ids.host]
                continue
            if lists is None:
                lists = (ids.device.tolist(), ids.host.tolist())
            if ref.page_bytes >= TORCH_FROM_BYTES:
                self._torch_rows(ref, lists, d2h)
                continue
            if d2h:
                for a, b in zip(*lists, strict=True):
                    h[b] = d[a]
            else:
                for a, b in zip(*lists, strict=True):
                    d[a] = h[b]


    def _torch_rows(self, ref: BufferRef, lists: tuple[list[int], list[int]], d2h: bool) -> None:
        rows = self._rows.get((ref.pool, ref.index))
        if rows is None:  # every page's row view, made once in one C call (indexing costs ~2 us a row)
            d, h = buffer_pair(ref, self.dp, self.hp)
            rows = self._rows[(ref.pool, ref.index)] = (d.unbind(0), h.unbind(0))
        d_rows, h_rows = rows
        if d2h:
            for a, b in zip(*lists, strict=True):
                h_rows[b].copy_(d_rows[a])
        else:
            for a, b in zip(*lists, strict=True):
                d_rows[a].copy_(h_rows[b])


class TorchEngine:
    """CUDA pools through torch indexing; returns when the host side is written (d2h) or queued (h2d)."""

    path = "torch"

    def __init__(self, dp: StagePools, hp: HostPools):
        self.dp, self.hp = dp, hp

    def run(self, sel: Selection, ids: PageIds, d2h: bool) -> None:
        import torch

        dev_idx = torch.from_numpy(ids.device).to(self.dp.device)
        for ref in sel.buffers:
            d, h = buffer_pair(ref, self.dp, self.hp)
            if d2h:  # .cpu() waits for the caller's stream: the pages are what it last wrote
                h.numpy()[ids.host] = d.index_select(0, dev_idx).cpu().numpy()
            else:  # queued on the caller's stream, so its later work sees the pages
                d.index_copy_(0, dev_idx, torch.from_numpy(h.numpy()[ids.host]).to(self.dp.device))
