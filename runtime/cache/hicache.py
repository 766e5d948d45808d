"""One stage's hierarchical prefix cache: a device tier, an optional host tier, one radix tree.

Pages are keyed by 64-bit chained page keys (``pages.py``), so the same cache replays token
traces and Mooncake block traces.  The tiers hold real pools (payload: copies go through the
transfer controller and reused pages can be verified, ``kv_writer``) or only page ids
(``HiCache.metadata_only``: copies are counted, not made); both modes run the very same code, so
they make the same decisions.  Tier rules, write policies and the L3 tier follow sglang's
HiCache (docs/hicache.md).  A follower stage that cannot read some L3 pages the head stage took
rewrites them (``refill``), so the stages' decisions never depend on one stage's L3.  Given the
stage's ``mirror``, every backup and load is held against the plan (``plan.mirror``); one that
misses a kind is kept in ``incomplete`` for the live numbers and the cache goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import defaults
from ..errors import ConfigError
from ..memory.allocator import OutOfPagesError, PageAllocator
from ..plan.mirror import transfer_gap
from .eviction import DEFAULT_POLICY, make_policy
from .handle import CacheOutOfPagesError, Handle, HandleError
from .insight import DEFAULT_INSIGHT, DROPPED, FROM_HOST, WRITEBACK, CacheInsight, InsightConfig
from .pages import page_view
from .radix import DEVICE, HOST, Match, RadixTree
from .stats import CacheStats
from .storage_tier import StorageTier

#: ``refill(page keys, host pages)``: write the bytes of pages L3 could not give back.
Refill = Callable[[Sequence[int], Sequence[int]], None]

__all__ = ["CacheOutOfPagesError", "Handle", "HandleError", "HiCache", "IncompleteCopy"]

#: Incomplete transfers a cache keeps (the first is kept apart: it is the one named).
KEPT_INCOMPLETE = 50


@dataclass(frozen=True)
class IncompleteCopy:
    """A backup (d2h) or load (h2d) that did not move every pool kind the stage mirrors, in the
    plan's bytes: its first host page, how many pages, the kinds it lacked, the bytes."""

    direction: str
    page: int
    pages: int
    missing: tuple[str, ...]
    expected_bytes: int
    got_bytes: int


class HiCache:
    """Prefix cache of one stage's device pages, with an optional host tier."""

    def __init__(self, pools: Any, host_pools: Any | None = None, controller: Any | None = None,
                 write_policy: str = "write_back", stats: CacheStats | None = None,
                 selective_threshold: int = 2, hash_salt: int = 0,
                 eviction_policy: str = DEFAULT_POLICY, insight: InsightConfig | None = DEFAULT_INSIGHT,
                 storage: StorageTier | None = None, mirror: Mapping[str, int] | None = None,
                 backup_pools: Sequence[str] | None = None):
        if storage is not None and host_pools is None:
            raise ConfigError("an L3 tier needs a host tier (L3 pages are read into host pages)")
        if host_pools is not None and controller is None:
            raise ConfigError("a host tier needs a transfer controller (device<->host copies)")
        if host_pools is not None and host_pools.page_size != pools.page_size:
            raise ConfigError(f"host pools page size {host_pools.page_size} != device pools "
                              f"page size {pools.page_size}")
        self.pools, self.host_pools, self.controller = pools, host_pools, controller
        transfer = getattr(controller, "stats", None)
        stage = pools.stage_map.stage
        stats = stats if stats is not None else CacheStats(stage, pools.page_size, transfer=transfer)
        self._setup(pools.page_size, stage, pools.allocator,
                    host_pools.allocator if host_pools is not None else None,
                    write_policy, stats, selective_threshold, hash_salt, eviction_policy, insight)
        self.storage = storage
        #: kind -> bytes per page every transfer must move (None: transfers are not checked)
        self.mirror = dict(mirror) if mirror else None
        self.backup_pools = tuple(backup_pools) if backup_pools is not None else None

    @classmethod
    def metadata_only(cls, page_size: int, device_pages: int, host_pages: int = 0, stage: int = 0,
                      write_policy: str = "write_back", eviction_policy: str = DEFAULT_POLICY,
                      selective_threshold: int = 2, hash_salt: int = 0,
                      insight: InsightConfig | None = DEFAULT_INSIGHT) -> HiCache:
        """The same cache without tensors: page ids, tree, tiers and counted copies only."""
        self = cls.__new__(cls)
        self.pools = self.host_pools = self.controller = None
        dev = PageAllocator(device_pages, f"stage {stage} device")
        host = PageAllocator(host_pages, f"stage {stage} host") if host_pages else None
        self._setup(page_size, stage, dev, host, write_policy, CacheStats(stage, page_size),
                    selective_threshold, hash_salt, eviction_policy, insight)
        return self

    def _setup(self, page_size: int, stage: int, dev_alloc: Any, host_alloc: Any | None,
               write_policy: str, stats: CacheStats, selective_threshold: int, hash_salt: int,
               eviction_policy: str, insight: InsightConfig | None) -> None:
        if write_policy not in defaults.WRITE_POLICIES:
            raise ConfigError(f"unknown --hicache-write-policy {write_policy!r}; "
                              f"policies are {', '.join(defaults.WRITE_POLICIES)}")
        self.page_size, self.stage = page_size, stage
        self.dev_alloc, self.host_alloc = dev_alloc, host_alloc
        self.write_policy, self.selective_threshold = write_policy, selective_threshold
        self.hash_salt = hash_salt
        self.stats = stats
        self.tree = RadixTree(make_policy(eviction_policy),
                              ghosts=insight.seen_keys if insight is not None else 0)
        self.eviction_policy = eviction_policy
        self._in_flight: dict[int, Handle] = {}
        self._pending: dict[int, int] = {}  # host page -> device page: write-back copies not yet made
        self._pending_keys: dict[int, int] = {}  # host page -> its page key (for the L3 copy)
        self.storage: StorageTier | None = None
        self.mirror: dict[str, int] | None = None
        self.backup_pools: tuple[str, ...] | None = None
        self.checked_transfers = 0
        self.incomplete: list[IncompleteCopy] = []  # the first, then the latest KEPT_INCOMPLETE
        self.incomplete_count = 0
        self.incomplete_kinds: dict[str, int] = {}
        #: miss reasons and sampled lifetimes (``insight.py``); None: not kept
        self.insight = None if insight is None else CacheInsight(insight, stats, self.tree._node)

    @property
    def insight(self) -> CacheInsight | None:
        """Miss reasons and sampled lifetimes (``insight.py``); None: not kept."""
        return self._insight

    @insight.setter
    def insight(self, value: CacheInsight | None) -> None:
        self._insight = value
        #: per tier, the watched nodes (empty without an insight): the one test an evicted page costs
        self._watch = value.watch if value is not None else ({}, {})

    # -- request flow -----------------------------------------------------------------------
    def begin(self, request: Any, follow: tuple[int, int] | None = None,
              refill: Refill | None = None) -> Handle:
        """Match the prompt, fetch L3 hits to host, load host hits to device, allocate the rest,
        lock the prefix.

        ``request``: a ``Request`` (token ids), a ``BlockRequest`` (Mooncake), a
        ``PageView`` of either, or anything with ``tokens`` (all prompt).  ``follow``: the
        (device + host, L3) pages the pipeline's head stage matched: this stage takes the same
        L3 pages when its own tree matched the same, rewriting with ``refill`` what L3 cannot
        give back (see the module docstring).
        """
        view = page_view(request, self.page_size, self.hash_salt)
        keys = view.keys.tolist()
        ins = self.insight
        before = [] if ins is not None and ins.sampled else None
        match, l3 = self._match_and_load(keys, view.max_hit, before, follow, refill)  # locked
        try:
            new_pages = self._alloc_device(len(keys) - match.pages)
        except OutOfPagesError:
            self.tree.unlock_path(match.last)
            self.stats.out_of_pages_errors += 1
            raise
        dev = self.tree.dev
        read = match.pages - l3[1]  # the fallback pages come last: they were computed, not read
        hit, hit_dev = view.hit_tokens(read), view.hit_tokens(match.device)
        hit_host = view.hit_tokens(match.pages - l3[0]) - hit_dev
        self.stats.record_lookup(hit_dev, hit_host, view.input_len - hit, hit - hit_dev - hit_host)
        handle = Handle(request, view, keys, match.path, match.device, match.host - l3[0],
                        [dev[s] for s in match.path], new_pages, storage_hit_pages=l3[0] - l3[1],
                        fallback_pages=l3[1])
        if ins is not None:
            if before is not None:
                handle.sampled = True
            limit = view.max_hit
            handle.misses = ins.lookup(keys, match, limit, view.hit_tokens(limit), view.input_len,
                                       self.tree.clock, before)
        self._in_flight[id(handle)] = handle
        return handle

    def _match_and_load(self, keys: list[int], limit: int, before: list[int] | None = None,
                        follow: tuple[int, int] | None = None, refill: Refill | None = None
                        ) -> tuple[Any, tuple[int, int]]:
        """Match, lock the path, extend it from L3, load its host run to device; unlocked again
        on failure.  Returns the match and (L3 pages, of them rewritten by ``refill``).

        ``before`` (a sampled lookup): gets the path's old stamps; what it loads is watched.
        """
        tree = self.tree
        match = tree.match(keys, limit, offer=False, before=before)
        tree.lock_path(match.last)
        l3 = (0, 0)
        try:
            if self.storage is not None and match.pages < limit:
                match, l3 = self._prefetch(keys, match, limit, follow, refill)
            if match.host:
                self._load(match.path[match.device:], before is not None)
            if self.write_policy == "write_through_selective" and self.host_alloc is not None:
                host, hits, limit_hits = tree.host, tree.hits, self.selective_threshold
                hot = [s for s in match.path if host[s] < 0 and hits[s] >= limit_hits]
                if hot:
                    self._backup(hot, before is not None)
        except OutOfPagesError:
            tree.unlock_path(match.last)
            self.stats.out_of_pages_errors += 1
            raise
        return match, l3

    def _prefetch(self, keys: list[int], match: Any, limit: int, follow: tuple[int, int] | None,
                  refill: Refill | None) -> tuple[Any, tuple[int, int]]:
        """Extend the locked ``match`` with the L3 pages that follow it, read into host pages."""
        m = match.pages
        if follow is None:
            want = self.storage.exists(keys[m:limit])
        else:  # the head stage's L3 pages, if this stage's tree matched what the head's did
            want = min(follow[1], limit - m) if m == follow[0] else 0
        hosts: list[int] = []
        while len(hosts) < want:
            page = self._host_page()
            if page < 0:
                break
            hosts.append(page)
        if not hosts:
            return match, (0, 0)
        got = self.storage.fetch(keys[m:m + len(hosts)], hosts)
        fallback = 0
        if follow is not None and got < len(hosts) and refill is not None:
            refill(keys[m + got:m + len(hosts)], hosts[got:])
            fallback = len(hosts) - got
            self.storage.counters.fallback_pages += fallback
            got = len(hosts)
        if got < len(hosts):
            self.host_alloc.free(hosts[got:])
        if not got:
            return match, (0, 0)
        nodes = self.tree.insert_host(match.last, keys[m:m + got], hosts[:got])
        self.tree.lock_path(nodes[-1])
        self.tree.unlock_path(match.last)
        return Match(match.path + nodes, match.device, match.miss), (got, fallback)

    def finish(self, handle: Handle) -> int:
        """Cache the request's keepable pages, free the rest, back up (write-through), unlock;
        returns how many pages it newly cached."""
        self._take(handle)
        view, m = handle.view, handle.matched_pages
        keep = view.cacheable
        pages = handle.pages
        created, duplicates = self.tree.insert(handle.last_node, handle.keys[m:keep], pages[m:keep],
                                               handle.path)
        to_free = duplicates + pages[keep:]
        if to_free:
            self.dev_alloc.free(to_free)
        self.stats.computed_tokens += view.input_len + view.output_len - view.hit_tokens(m)
        if handle.sampled and created and self.insight is not None:
            self.insight.born(0, created)
        if self.write_policy == "write_through" and self.host_alloc is not None and created:
            host = self.tree.host
            todo = [s for s in created if host[s] < 0]
            self.stats.backup_skipped_pages += len(todo) - self._backup(todo, handle.sampled)
        self.tree.unlock_path(handle.last_node)
        return len(created)

    def abort(self, handle: Handle) -> None:
        """Give back a request's pages without caching anything (a failed forward pass)."""
        self._take(handle)
        if handle.new_pages:
            self.dev_alloc.free(handle.new_pages)
        self.tree.unlock_path(handle.last_node)

    def _take(self, handle: Handle) -> None:
        if handle.done or self._in_flight.pop(id(handle), None) is not handle:
            raise HandleError(f"stage {self.stage}: handle already finished/aborted, or not from "
                              "this cache")
        handle.done = True

    # -- tiers ------------------------------------------------------------------------------
    def _copy(self, direction: str, src: list[int], dst: list[int]) -> None:
        """One batched transfer (payload mode); metadata mode only counts pages (callers do)."""
        if self.controller is None:
            return
        if direction == "d2h":
            result = self.controller.backup(src, dst, pools=self.backup_pools)
        else:
            result = self.controller.load(src, dst)
        _ordered(result)
        if self.mirror is not None:
            self._check_copy(direction, dst if direction == "d2h" else src, result)

    def _check_copy(self, direction: str, host_pages: list[int], result: Any) -> None:
        """One transfer against the stage's plan (``plan.mirror``); an incomplete one is kept."""
        self.checked_transfers += 1
        pages = int(result.pages)
        kinds = result.kinds
        moved = {kind: pages for kind, _ in kinds}
        per_page = dict(kinds)
        # a kind moved in other bytes per page than the plan says is wrong too: the mirrored kinds'
        # bytes against the plan's (kinds the plan does not mirror are not the check's)
        gap = transfer_gap(self.mirror, moved, pages, pages * sum(per_page.get(k, 0) for k in self.mirror))
        if gap is None:
            return
        missing, expected = gap
        self.incomplete_count += 1
        for kind in missing or ["bytes"]:
            self.incomplete_kinds[kind] = self.incomplete_kinds.get(kind, 0) + 1
        found = IncompleteCopy(direction, int(host_pages[0]) if len(host_pages) else -1, pages,
                               tuple(missing), expected, int(result.nbytes))
        if len(self.incomplete) > KEPT_INCOMPLETE:
            del self.incomplete[1]  # the first stays: it is the one named
        self.incomplete.append(found)

    def _load(self, nodes: list[int], watch: bool = False) -> None:
        host = self.tree.host
        src = [host[s] for s in nodes]
        pages = self._alloc_device(len(nodes))
        self._copy("h2d", src, pages)
        for s, p in zip(nodes, pages, strict=True):
            self.tree.set_device(s, p)
        self.stats.load_pages += len(nodes)
        if watch and self.insight is not None:
            self.insight.born(0, nodes)

    def _alloc_device(self, n: int) -> list[int]:
        """``n`` device pages: free ones first, then the pages of evicted nodes (handed over as is)."""
        alloc = self.dev_alloc
        free = alloc.num_free
        if free >= n:
            return alloc.alloc(n)
        taken: list[int] = []
        try:
            while free + len(taken) < n:
                victim = self.tree.pop(DEVICE)
                if victim < 0:
                    break
                taken.append(self._evict_device(victim))
        finally:
            self._flush()
        if free + len(taken) < n:
            if taken:
                alloc.free(taken)
            raise CacheOutOfPagesError(self.stage, n, alloc.num_free, alloc.num_pages,
                                       self.tree.device_pages, self.tree.locked_pages(),
                                       self.in_flight_pages())
        return sorted(alloc.alloc(free) + taken) if free else sorted(taken)

    def _flush(self) -> None:
        """Make this round's write-back copies, one transfer, before their device pages are reused."""
        if self._pending:
            hosts = list(self._pending)
            self._copy("d2h", [self._pending[h] for h in hosts], hosts)
            self.stats.backup_pages += len(hosts)
            self._to_storage([self._pending_keys[h] for h in hosts], hosts)
            self._pending = {}
            self._pending_keys = {}

    def _evict_device(self, node: int) -> int:
        """Take ``node`` off the device (backing it up or dropping it); returns its device page."""
        tree = self.tree
        page = tree.dev[node]
        self.stats.device_evicted_pages += 1
        written_back = False
        if tree.host[node] < 0 and self.host_alloc is not None:
            host_page = self._host_page()
            if host_page >= 0:
                tree.set_host(node, host_page)
                self._pending[host_page] = page
                self._pending_keys[host_page] = tree.key[node]
                written_back = True
        if node in self._watch[0]:
            self._insight.left_device(node, written_back, tree.stamp)
        tree.set_device(node, -1)
        if tree.host[node] < 0:
            # Lost.  It has no children: a child would be host-only and unlocked, so the host
            # tier could have evicted one (or its own leaf) to make room for this copy.
            self.stats.dropped_pages += 1
            tree.remove(node, DROPPED)
        return page

    def _host_page(self) -> int:
        """One host page for the caller: a free one, else an evicted node's; -1 when none can be made."""
        alloc = self.host_alloc
        if alloc.num_free:
            return alloc.alloc(1)[0]
        victim = self.tree.pop(HOST)
        return self._evict_host(victim) if victim >= 0 else -1

    def _evict_host(self, node: int) -> int:
        """Drop ``node``'s host copy; its page stays allocated and goes to the caller."""
        tree = self.tree
        page = tree.host[node]
        # its write-back copy is no longer wanted (nor ever made: a miss reason of its own)
        why = FROM_HOST if self._pending.pop(page, None) is None else WRITEBACK
        self._pending_keys.pop(page, None)
        self.stats.host_evicted_pages += 1
        if node in self._watch[1]:
            self._insight.died(1, node, tree.stamp)
        tree.set_host(node, -1)
        if tree.dev[node] < 0:
            tree.remove(node, why)
        return page

    def _backup(self, nodes: list[int], watch: bool = False) -> int:
        """Copy device nodes to host (shallow first, one transfer); returns how many made it."""
        hosts: list[int] = []
        for _ in nodes:
            page = self._host_page()
            if page < 0:
                break
            hosts.append(page)
        if hosts:
            dev = self.tree.dev
            self._copy("d2h", [dev[s] for s in nodes[:len(hosts)]], hosts)
            for s, h in reversed(list(zip(nodes, hosts, strict=False))):
                self.tree.set_host(s, h)  # deepest first: only the deepest becomes a candidate
            self.stats.backup_pages += len(hosts)
            self._to_storage([self.tree.key[s] for s in nodes[:len(hosts)]], hosts)
            if watch and self.insight is not None:
                self.insight.born(1, nodes[:len(hosts)])
        return len(hosts)

    def _to_storage(self, keys: list[int], hosts: list[int]) -> None:
        """L3 gets a copy of what the host tier just got (once the copy is in host memory)."""
        if self.storage is None or not keys:
            return
        if self.controller is not None:
            self.controller.synchronize()
        self.storage.backup(keys, hosts)

    def discard(self, key: int) -> bool:
        """Lose one cached page from both tiers (an unlocked leaf): what ``--fault radix-skew``
        does to one stage; False when the page is not such a leaf."""
        tree = self.tree
        node = tree.node_of(key)
        if node < 0 or tree.lock[node] or tree.nchild[node]:
            return False
        for tier, page, alloc in ((0, tree.dev[node], self.dev_alloc), (1, tree.host[node], self.host_alloc)):
            if page >= 0:
                (tree.set_device if tier == 0 else tree.set_host)(node, -1)
                alloc.free([page])
                self._watch[tier].pop(node, None)
        tree.remove(node, DROPPED)
        return True

    # -- inspection -------------------------------------------------------------------------
    def in_flight(self) -> list[Handle]:
        return list(self._in_flight.values())

    def in_flight_pages(self) -> int:
        return sum(len(h.new_pages) for h in self._in_flight.values())

    def check(self) -> None:
        """Tree invariants plus page accounting against both allocators (tests, --check-every)."""
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

def _ordered(result: Any) -> None:
    """Order later work on the caller's stream after a transfer (no-op on CPU).

    After a backup the device pages may be freed and rewritten by the next
    forward pass; after a load the forward pass reads them: both must wait.
    """
    wait = getattr(result, "wait", None)
    if wait is not None:
        wait()
