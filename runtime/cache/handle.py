"""What ``HiCache`` hands out and raises: request handles, prefix matches, out-of-pages errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import StageCacheError
from ..memory.allocator import OutOfPagesError
from .pages import PageView


class CacheOutOfPagesError(OutOfPagesError):
    """No free device page and nothing evictable: every page is held by a running request."""

    def __init__(self, stage: int, asked: int, free: int, total: int, cached: int, locked: int,
                 in_flight: int):
        self.stage, self.asked, self.free, self.total = stage, asked, free, total
        self.cached, self.locked, self.in_flight = cached, locked, in_flight
        self.name = f"stage {stage} device"
        if asked > total:
            why = f"more than the stage's {total} device pages: this request can never fit"
        else:
            why = (f"{cached} cached pages of which {locked} are locked by running requests, "
                   f"{in_flight} pages being computed by running requests; nothing left to evict")
        StageCacheError.__init__(
            self, f"stage {stage} device: out of pages: asked for {asked}, {free} of {total} free; {why}")


class HandleError(StageCacheError, RuntimeError):
    """A handle used twice (finish after finish/abort) or with the wrong cache."""


@dataclass(eq=False)
class Handle:
    """A running request on one stage: its pages, and what was reused."""

    request: Any
    view: PageView
    keys: list[int]
    path: list[int]  # nodes of the matched prefix (locked while running)
    device_hit_pages: int
    host_hit_pages: int
    prefix_pages: list[int]  # device page ids of the reused prefix (tree-owned, locked)
    new_pages: list[int]  # device page ids for pages matched_pages.. (request-owned)
    storage_hit_pages: int = 0  # pages read from L3 (after the host ones, before new_pages)
    fallback_pages: int = 0  # pages taken as L3's that this stage rewrote (refill), after those
    done: bool = field(default=False)
    sampled: bool = field(default=False)  # the insight watches what this request caches
    misses: Any = field(default=None)  # its MissRecord when the insight defers accounting

    @property
    def matched_pages(self) -> int:
        return self.device_hit_pages + self.host_hit_pages + self.storage_pages

    @property
    def storage_pages(self) -> int:
        """Pages the L3 step added to the prefix: read back, or rewritten (fallback)."""
        return self.storage_hit_pages + self.fallback_pages

    @property
    def last_node(self) -> int:
        return self.path[-1] if self.path else -1

    @property
    def input_len(self) -> int:
        return self.view.input_len

    @property
    def pages(self) -> list[int]:
        return self.prefix_pages + self.new_pages

    @property
    def hashes(self) -> np.ndarray:
        """One key per page: what the KV writer seeds each page's bytes with."""
        return self.view.keys

    @property
    def new_hashes(self) -> np.ndarray:
        return self.view.keys[self.matched_pages:]

    @property
    def prefix_hashes(self) -> np.ndarray:
        return self.view.keys[:self.matched_pages]

    @property
    def tokens(self) -> np.ndarray:
        """Prompt + answer token ids (synthesised for a block request, on demand)."""
        return self.view.tokens if self.view.tokens is not None else self.request.tokens()
