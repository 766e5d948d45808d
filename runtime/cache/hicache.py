"""HiCache for one PP stage: a radix prefix cache over the stage's device pools plus a host tier.

The request flow the PP runtime calls, once per request per stage::

    h = cache.begin(request)    # match; load host hits to device; allocate the rest; lock
    ... forward pass writes KV for h.new_pages (token pages h.matched_pages ..) ...
    cache.finish(h)             # insert prompt+answer pages into the tree; unlock

Between the two the request's pages are its own: the matched prefix is locked
in the tree (never evicted), the new pages are not in the tree at all.  A
reused prefix is restored *whole*: a page id addresses every pool of the stage
(SWA window, C4/C128 KV, both compress states, the indexer, every local
layer), so loading host page ``h`` into device page ``d`` brings all of them back.

Tiers and policies (sglang's ``--hicache-write-policy``):

* ``write_back``: a device page is copied to host only when it is evicted;
* ``write_through``: every inserted page is copied to host at ``finish`` (if host
  room can be made; otherwise it falls back to write-back for that node);
* ``write_through_selective``: copied to host once its node was hit
  ``selective_threshold`` times, else on eviction.

Eviction is LRU at node granularity: device leaves go to host (backed up first
if they have no host copy), host leaves go out.  If host has no room for a
backup, the device node and its host-only descendants are dropped (counted in
``dropped_pages``).  When nothing can be evicted and no page is free,
``begin`` raises ``CacheOutOfPagesError`` with the counts and leaves the cache
exactly as valid as before (locks released, pages returned).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError, StageCacheError
from ..memory.allocator import OutOfPagesError
from .kv_writer import page_hashes
from .radix import Match, Node, RadixTree
from .stats import CacheStats

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")


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


@dataclass(frozen=True, eq=False)
class PrefixMatch:
    """``match_prefix`` result: tokens hit per tier and the device pages now holding them."""

    device_tokens: int  # already on device
    host_tokens: int  # were on host only, loaded to device by this call
    pages: tuple[int, ...]  # device page ids of the whole matched prefix, in order
    last_node: Node | None
    locked: bool

    @property
    def tokens(self) -> int:
        return self.device_tokens + self.host_tokens


@dataclass(eq=False)
class Handle:
    """A running request on one stage: its pages, and what was reused."""

    request: Any
    tokens: list[int]
    hashes: np.ndarray  # one per token page (partial last page included)
    input_len: int
    device_hit_pages: int
    host_hit_pages: int
    prefix_pages: list[int]  # device page ids of the reused prefix (tree-owned, locked)
    new_pages: list[int]  # device page ids for token pages matched_pages.. (request-owned)
    last_node: Node | None
    done: bool = field(default=False)

    @property
    def matched_pages(self) -> int:
        return self.device_hit_pages + self.host_hit_pages

    @property
    def pages(self) -> list[int]:
        return self.prefix_pages + self.new_pages

    @property
    def new_hashes(self) -> np.ndarray:
        return self.hashes[self.matched_pages:]

    @property
    def prefix_hashes(self) -> np.ndarray:
        return self.hashes[:self.matched_pages]


class HiCache:
    """Prefix cache of one stage's device pools, with an optional host tier."""

    def __init__(self, pools: Any, host_pools: Any | None = None, controller: Any | None = None,
                 write_policy: str = "write_back", stats: CacheStats | None = None,
                 selective_threshold: int = 2, hash_salt: int = 0):
        if write_policy not in WRITE_POLICIES:
            raise ConfigError(f"unknown --hicache-write-policy {write_policy!r}; "
                              f"policies are {', '.join(WRITE_POLICIES)}")
        if host_pools is not None and controller is None:
            raise ConfigError("a host tier needs a transfer controller (device<->host copies)")
        if host_pools is not None and host_pools.page_size != pools.page_size:
            raise ConfigError(f"host pools page size {host_pools.page_size} != device pools "
                              f"page size {pools.page_size}")
        self.pools = pools
        self.host_pools = host_pools
        self.controller = controller
        self.write_policy = write_policy
        self.selective_threshold = selective_threshold
        self.page_size = pools.page_size
        self.stage = pools.stage_map.stage
        self.hash_salt = hash_salt
        self.tree = RadixTree(self.page_size)
        self.dev_alloc = pools.allocator
        self.host_alloc = host_pools.allocator if host_pools is not None else None
        transfer = getattr(controller, "stats", None)
        self.stats = stats if stats is not None else CacheStats(self.stage, self.page_size, transfer=transfer)
        self._in_flight: dict[int, Handle] = {}

    # -- request flow -----------------------------------------------------------------------
    def begin(self, request: Any) -> Handle:
        """Match the prompt, load host hits to device, allocate the rest, lock the prefix.

        ``request`` has ``input_ids`` and ``output_ids`` (``workload.Request``), or
        just ``tokens`` (all prompt).  At least the prompt's last token is always
        computed (as in sglang), so at most ``(input_len - 1) // page_size`` pages hit.
        """
        prompt = getattr(request, "input_ids", None)
        if prompt is None:  # a plain ``tokens`` request: all prompt, no answer
            prompt = request.tokens
        input_ids = np.asarray(prompt, dtype=np.int64)
        output_ids = np.asarray(getattr(request, "output_ids", ()), dtype=np.int64)
        if len(input_ids) == 0:
            raise ConfigError(f"stage {self.stage}: a request needs at least one prompt token")
        tokens = np.concatenate([input_ids, output_ids]).tolist()
        ps = self.page_size
        total_pages = -(-len(tokens) // ps)
        match = self._match_and_load(tokens, (len(input_ids) - 1) // ps)  # locked from here
        try:
            new_pages = self._alloc_device(total_pages - match.pages)
        except OutOfPagesError:
            self.tree.unlock(match.last_node)
            self.stats.out_of_pages_errors += 1
            raise
        prefix = [p for n in match.nodes for p in n.device]
        hit_dev, hit_host = match.device_pages * ps, match.host_pages * ps
        self.stats.record_lookup(hit_dev, hit_host, len(input_ids) - hit_dev - hit_host)
        handle = Handle(request, tokens, page_hashes(tokens, ps, self.hash_salt), len(input_ids),
                        match.device_pages, match.host_pages, prefix, new_pages, match.last_node)
        self._in_flight[id(handle)] = handle
        return handle

    def match_prefix(self, tokens: Sequence[int], max_pages: int | None = None,
                     lock: bool = False) -> PrefixMatch:
        """Longest cached prefix of ``tokens``; host hits are loaded to device before returning.

        The returned pages are only guaranteed to stay on device while locked:
        pass ``lock=True`` and call ``release(match)`` when done (``begin`` does
        all of this for a request, plus the allocation of the rest).  Not counted
        in ``stats``: the hit accounting is per request, in ``begin``.
        """
        tokens = list(tokens)
        m = self._match_and_load(tokens, max_pages)
        if not lock:
            self.tree.unlock(m.last_node)
        return PrefixMatch(m.device_pages * self.page_size, m.host_pages * self.page_size,
                           tuple(p for n in m.nodes for p in n.device), m.last_node, lock)

    def release(self, match: PrefixMatch) -> None:
        """Unlock a ``match_prefix(..., lock=True)`` result."""
        if match.locked:
            self.tree.unlock(match.last_node)

    def _match_and_load(self, tokens: list[int], max_pages: int | None) -> Match:
        """Match, lock the path, load its host run to device; unlocked again on failure."""
        match = self.tree.match(tokens, max_pages)
        self.tree.lock(match.last_node)
        try:
            for node in match.host_nodes:
                pages = self._alloc_device(len(node.host))
                _ordered(self.controller.load(list(node.host), pages))
                self.tree.set_device(node, pages)
                self.stats.load_pages += len(pages)
            if self.write_policy == "write_through_selective" and self.host_pools is not None:
                for node in match.nodes:
                    if node.host is None and node.hit_count >= self.selective_threshold:
                        self._backup(node)
        except OutOfPagesError:
            self.tree.unlock(match.last_node)
            self.stats.out_of_pages_errors += 1
            raise
        return match

    def finish(self, handle: Handle) -> None:
        """Cache the request's whole pages (prompt + answer) and release its locks."""
        self._take(handle)
        ps = self.page_size
        full = len(handle.tokens) // ps
        pages = handle.pages
        created, duplicates = self.tree.insert(handle.tokens[:full * ps], pages[:full])
        to_free = duplicates + pages[full:]  # the partial last page is never cached
        if to_free:
            self.dev_alloc.free(to_free)
        self.stats.computed_tokens += len(handle.tokens) - handle.matched_pages * ps
        if self.write_policy == "write_through" and self.host_pools is not None:
            for node in created:  # not host-eviction candidates themselves (no host copy yet)
                if node.host is None and not self._backup(node):
                    self.stats.backup_skipped_pages += len(node.device)
        self.tree.unlock(handle.last_node)

    def abort(self, handle: Handle) -> None:
        """Give back a request's pages without caching anything (a failed forward pass)."""
        self._take(handle)
        if handle.new_pages:
            self.dev_alloc.free(handle.new_pages)
        self.tree.unlock(handle.last_node)

    def _take(self, handle: Handle) -> None:
        if handle.done or self._in_flight.pop(id(handle), None) is not handle:
            raise HandleError(f"stage {self.stage}: handle already finished/aborted, or not from "
                              "this cache")
        handle.done = True

    # -- tiers ------------------------------------------------------------------------------
    def _alloc_device(self, n: int) -> list[int]:
        while self.dev_alloc.num_free < n:
            victim = self.tree.pop_device_lru()
            if victim is None:
                raise CacheOutOfPagesError(
                    self.stage, n, self.dev_alloc.num_free, self.dev_alloc.num_pages,
                    self.tree.device_pages, self.tree.locked_pages(), self.in_flight_pages())
            self._evict_device(victim)
        return self.dev_alloc.alloc(n)

    def _alloc_host(self, n: int) -> list[int] | None:
        if self.host_alloc is None or n > self.host_alloc.num_pages:
            return None
        while self.host_alloc.num_free < n:
            victim = self.tree.pop_host_lru()
            if victim is None:
                return None
            self._evict_host(victim)
        return self.host_alloc.alloc(n)

    def _backup(self, node: Node) -> bool:
        """Copy a device node to host; False when no host room can be made."""
        assert node.device is not None and node.host is None
        host = self._alloc_host(len(node.device))
        if host is None:
            return False
        _ordered(self.controller.backup(list(node.device), host))
        self.tree.set_host(node, host)
        self.stats.backup_pages += len(host)
        return True

    def _evict_device(self, node: Node) -> None:
        n = len(node.device)
        if node.host is None and self.host_pools is not None:
            self._backup(node)
        self.dev_alloc.free(node.device)
        self.stats.device_evicted_pages += n
        if node.host is not None:
            self.tree.set_device(node, None)
            return
        # no host copy possible: the node and whatever hangs below it (host-only) is lost
        self.stats.dropped_pages += n
        self.tree.set_device(node, None)
        self._drop_subtree(node)

    def _drop_subtree(self, node: Node) -> None:
        stack, order = [node], []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):  # children before parents
            if n.host is not None:
                self.host_alloc.free(n.host)
                self.stats.host_evicted_pages += len(n.host)
                self.tree.set_host(n, None)
            self.tree.remove_leaf(n)

    def _evict_host(self, node: Node) -> None:
        self.host_alloc.free(node.host)
        self.stats.host_evicted_pages += len(node.host)
        self.tree.set_host(node, None)
        if node.device is None:
            self.tree.remove_leaf(node)

    # -- inspection -------------------------------------------------------------------------
    def in_flight(self) -> list[Handle]:
        return list(self._in_flight.values())

    def in_flight_pages(self) -> int:
        return sum(len(h.new_pages) for h in self._in_flight.values())

    def check(self) -> None:
        """Tree invariants plus page accounting against both allocators (tests, --verify)."""
        self.tree.check()
        dev, host = self.tree.page_ids()
        owned = dev + [p for h in self._in_flight.values() for p in h.new_pages]
        assert len(set(owned)) == len(owned), f"stage {self.stage}: a device page is owned twice"
        assert len(owned) == self.dev_alloc.num_used, (
            f"stage {self.stage}: {len(owned)} device pages owned (tree + running requests) but "
            f"{self.dev_alloc.num_used} allocated")
        self.dev_alloc.check_allocated(owned, "cached device page")
        if self.host_alloc is not None:
            assert len(set(host)) == len(host), f"stage {self.stage}: a host page is owned twice"
            assert len(host) == self.host_alloc.num_used, (
                f"stage {self.stage}: {len(host)} host pages in the tree but "
                f"{self.host_alloc.num_used} allocated")
            self.host_alloc.check_allocated(host, "cached host page")
        else:
            assert not host

    def snapshot(self) -> dict[str, Any]:
        """The cache and pool part of the live stage dict (``exporters/snapshot.py``)."""
        out = self.stats.snapshot()
        used, free = self.dev_alloc.num_used, self.dev_alloc.num_free
        dev_bytes = self.pools.pool_bytes()
        host_bytes = self.host_pools.pool_bytes() if self.host_pools is not None else {}
        out["pool_pages"] = {p: {"used": used, "free": free} for p in dev_bytes}
        out["pool_bytes"] = {p: {"device": int(b), "host": int(host_bytes.get(p, 0))}
                             for p, b in dev_bytes.items()}
        return out


def _ordered(result: Any) -> None:
    """Order later work on the caller's stream after a transfer (no-op on CPU).

    After a backup the device pages may be freed and rewritten by the next
    forward pass; after a load the forward pass reads them: both must wait.
    """
    wait = getattr(result, "wait", None)
    if wait is not None:
        wait()


def pages_needed(requests: Sequence[Any], page_size: int) -> int:
    """Device pages the largest request needs on its own (a lower bound for --device-pages)."""
    return max((-(-(len(r.input_ids) + len(r.output_ids)) // page_size) for r in requests), default=0)
