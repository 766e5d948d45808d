"""Host-tier pages as L3 objects: which bytes of the host pools one (page, pool kind) object is.

An L3 object is one token page of one pool kind of one stage: that page's row in every buffer of
the kind, in buffer (local layer) order.  In the ``layer_first`` host layout those rows are one
segment per buffer; in ``page_first`` they are one contiguous block.  The views are built from
the host pools' own tensors (no copy), so a backend reads and writes the host tier in place, and
``tensors()`` lists what a zero-copy backend must register.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..memory.host_pools import HostPools
from .base import Segments


class HostPageViews:
    """Per host-cached pool kind of one stage, the segments of a host page."""

    def __init__(self, host: HostPools):
        self.host = host
        self.kinds: tuple[str, ...] = tuple(host.kinds)
        self.page_bytes = {k: sum(host.mirrored[k]) * host.page_bytes(k) for k in self.kinds}

    def segments(self, kind: str, page: int) -> Segments:
        h = self.host
        if h.layout == "page_first":
            return [h.pool_tensors[kind][page].view(-1)]
        return [b[page] for b in h.buffers[kind] if b is not None]

    def views(self, kind: str, pages: Sequence[int]) -> list[Segments]:
        return [self.segments(kind, p) for p in pages]

    def tensors(self) -> list[torch.Tensor]:
        """The host tensors a zero-copy backend registers (each once)."""
        h = self.host
        if h.layout == "page_first":
            return [h.pool_tensors[k] for k in self.kinds]
        return [b for k in self.kinds for b in h.buffers[k] if b is not None]

    @property
    def token_page_bytes(self) -> int:
        return sum(self.page_bytes.values())
