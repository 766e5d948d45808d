"""The techniques ``bench transfer`` measures stagecache against, on the same pages and buffers.

* ``ceiling``     -- one contiguous copy of the same total bytes between a device
  tensor and a (pinned on CUDA) host tensor: what the link does at all.
* ``page_loop``   -- one copy per page per buffer.  On CUDA one ``cudaMemcpyAsync``
  per page through the CUDA runtime (vLLM's ``swap_blocks`` technique, issued from
  a loop over precomputed addresses: no torch dispatch per copy); on CPU one
  ``torch.Tensor.copy_`` per page over precomputed row views.
* ``warp_kernel`` -- CUDA only: one warp per (layer, page) item moving 8-byte words
  with non-caching loads and streaming stores, a device table of layer base
  pointers, every layer of a pool kind in one launch (the technique of sglang's
  kernel IO backend); page ids are uploaded before timing.

Each technique is a ``Technique``: ``run(d2h)`` queues one transfer, nothing else.
Address lists, views and id uploads are prepared outside the timed call, which
gives the peers their best case.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..transfer.cudart import MEMCPY_DEFAULT, runtime

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the warp peer needs triton
    triton = None
    tl = None


@dataclass(frozen=True)
class Technique:
    """A named way to move the case's pages; ``run(d2h)`` queues one transfer."""

    key: str
    run: Callable[[bool], Any]
    note: str


if triton is not None:

    @triton.jit
    def _warp_item_kernel(src_table, dst_table, src_idx, dst_idx, n_pages, src_stride, dst_stride, words):
        """One program = one warp = one (layer, page) item, 32 lanes x 8 bytes per step."""
        pid = tl.program_id(0)
        layer = pid // n_pages
        slot = pid - layer * n_pages
        src = tl.load(src_table + layer).to(tl.pointer_type(tl.int64)) + tl.load(src_idx + slot) * src_stride
        dst = tl.load(dst_table + layer).to(tl.pointer_type(tl.int64)) + tl.load(dst_idx + slot) * dst_stride
        lanes = tl.arange(0, 32)
        for w in range(0, words, 32):
            mask = w + lanes < words
            vals = tl.load(src + w + lanes, mask=mask, cache_modifier=".cg")
            tl.store(dst + w + lanes, vals, mask=mask, cache_modifier=".cs")


def ceiling(dev_flat: Any, host_flat: Any) -> Technique:
    def run(d2h: bool) -> None:
        if d2h:
            host_flat.copy_(dev_flat, non_blocking=True)
        else:
            dev_flat.copy_(host_flat, non_blocking=True)

    return Technique("ceiling", run, "one contiguous copy of the same bytes (pinned host memory on CUDA)")


def page_loop(pairs: list[tuple[Any, Any, int]], cuda: bool) -> Technique:
    """``pairs`` = (device row, host row, bytes) per page per buffer: tensors (rows) on CPU."""
    if cuda:
        rt = runtime()
        if rt is not None:
            import torch

            addrs = [(d.data_ptr(), h.data_ptr(), nbytes) for d, h, nbytes in pairs]
            memcpy = rt.memcpy_async

            def run_cuda(d2h: bool) -> None:
                stream = torch.cuda.current_stream().cuda_stream
                bad = 0
                if d2h:
                    for d, h, nbytes in addrs:
                        bad |= memcpy(h, d, nbytes, MEMCPY_DEFAULT, stream)
                else:
                    for d, h, nbytes in addrs:
                        bad |= memcpy(d, h, nbytes, MEMCPY_DEFAULT, stream)
                if bad:
                    raise RuntimeError("cudaMemcpyAsync failed in the page_loop peer")

            return Technique("page_loop", run_cuda, "one cudaMemcpyAsync per page per buffer (CUDA runtime)")

    def run(d2h: bool) -> None:
        if d2h:
            for d, h, _ in pairs:
                h.copy_(d, non_blocking=True)
        else:
            for d, h, _ in pairs:
                d.copy_(h, non_blocking=True)

    return Technique("page_loop", run, "one torch copy_ per page per buffer")


def warp_kernel(groups: list[tuple[list[Any], list[Any], int]], dev_ids: Any, host_ids: Any) -> Technique | None:
    """``groups`` = (device buffers, host buffers, page bytes) per pool kind; None if not applicable."""
    import torch

    if triton is None or not groups or any(pb % 8 for _, _, pb in groups):
        return None
    device = groups[0][0][0].device
    launches = []
    for dbufs, hbufs, pb in groups:
        d_tab = torch.tensor([b.data_ptr() for b in dbufs], dtype=torch.int64, device=device)
        h_tab = torch.tensor([b.data_ptr() for b in hbufs], dtype=torch.int64, device=device)
        launches.append((d_tab, h_tab, dbufs[0].stride(0) // 8, hbufs[0].stride(0) // 8, pb // 8, len(dbufs)))
    d_idx, h_idx = dev_ids.to(device), host_ids.to(device)
    n = int(d_idx.numel())

    def run(d2h: bool) -> None:
        for d_tab, h_tab, d_stride, h_stride, words, layers in launches:
            if d2h:
                args = (d_tab, h_tab, d_idx, h_idx, n, d_stride, h_stride, words)
            else:
                args = (h_tab, d_tab, h_idx, d_idx, n, h_stride, d_stride, words)
            _warp_item_kernel[(layers * n,)](*args, num_warps=1)

    return Technique("warp_kernel", run, "one warp per (layer, page), 8-byte words, one launch per pool kind")
