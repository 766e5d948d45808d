"""A page-granular radix tree over 64-bit page keys, stored as parallel arrays.

A page key names a page *and its whole prefix* (``pages.py``), so the tree needs no per-node
child maps: one key table (``keytable.py``) maps a key to its node, and every per-node field is
one entry of a typed ``array`` indexed by that node -- no Python object per node, which is what
lets a replay hold hundreds of thousands of pages (docs/hicache.md, "Tree storage and its cost").

Invariants (``check()`` asserts all of them; the hypothesis tests run it after every step):

* every node is resident somewhere: on device (``dev >= 0``), host, or both;
* device residency is *prefix-closed*: a node on device has its parent on device, so a matched
  prefix is one device run followed by one host run and device eviction only takes device
  *leaves* (no child on device);
* a host copy may go when nothing below it has one and the node stays on device or has no
  children at all (so no node is left resident nowhere);
* ``lock`` counts running requests on a node and its ancestors: a locked node is never an
  eviction candidate.

Eviction candidates sit in one lazy heap per tier (``eviction.py``), an entry being one int
``priority << 32 | node`` checked when popped; an empty heap is rebuilt from the arrays once, so
staleness can cost time but never a false "nothing evictable".
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StageCacheError
from .eviction import LRU, EvictionPolicy
from .keytable import KeyTable

DEVICE, HOST = 0, 1
_SLOT_MASK = (1 << 32) - 1
_DTYPES = {"Q": np.uint64, "q": np.int64, "i": np.int32}
_FIELDS = (("key", "Q"), ("parent", "i"), ("dev", "i"), ("host", "i"), ("lock", "i"),
           ("stamp", "q"), ("hits", "i"), ("nchild", "i"), ("ndev", "i"), ("nhost", "i"))


class RadixError(StageCacheError, RuntimeError):
    """The tree was used against its contract (unlock below zero, keys that are not chained)."""


@dataclass(frozen=True)
class NodeInfo:
    """A read-only copy of one node's fields (inspection and tests)."""

    node: int
    key: int
    parent: int
    device: int
    host: int
    lock: int
    stamp: int
    hits: int
    children: int


class Match:
    """A lookup's matched path (nodes, root side first): ``device`` leading pages on device;
    ``miss``: what the key table said of the first key not matched (-1: never cached or
    forgotten, <= ``keytable.GHOST``: a buried key; 0: none, the whole limit matched)."""

    __slots__ = ("path", "device", "miss")

    def __init__(self, path: list[int], device: int, miss: int = 0):
        self.path = path
        self.device = device
        self.miss = miss

    @property
    def pages(self) -> int:
        return len(self.path)

    @property
    def host(self) -> int:
        return len(self.path) - self.device

    @property
    def last(self) -> int:
        return self.path[-1] if self.path else -1


class RadixTree:
    """The tree, its locks and its eviction candidates; tier *policy* lives in ``hicache``."""

    def __init__(self, policy: EvictionPolicy | None = None, ghosts: int = 0):
        #: ``ghosts`` > 0: removed keys stay in the key table as tombstones with how they left
        #: (the newest ``ghosts`` of them; ``keytable.py``) -- the cache insight's miss reasons
        self._node = KeyTable(max_ghosts=ghosts)
        for name, code in _FIELDS:
            setattr(self, name, array(code))
        self._free = array("i")
        self.policy = policy if policy is not None else LRU()
        self.policy.attach(self)
        self._clock = 0
        self._heaps: tuple[list[int], list[int]] = ([], [])
        self._rebuild_at = [4096, 4096]  # heap sizes that trigger a rebuild (2x live + slack)
        self.num_nodes = 0
        self.device_pages = 0
        self.host_pages = 0

    # -- nodes ------------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new(self, key: int, parent: int, stamp: int, page: int) -> int:
        """A new node on device ``page`` (not offered: the caller offers when it is done)."""
        if self._free:  # under pressure: reuse a removed node
            node = self._free.pop()
            self.key[node] = key
            self.parent[node] = parent
            self.dev[node] = page
            self.host[node] = -1
            self.stamp[node] = stamp
            self.hits[node] = 0  # lock and the child counts are 0 already (checked at removal)
        else:  # a growing cache: plain appends
            node = len(self.key)
            self.key.append(key)
            self.parent.append(parent)
            self.dev.append(page)
            self.host.append(-1)
            self.lock.append(0)
            self.stamp.append(stamp)
            self.hits.append(0)
            self.nchild.append(0)
            self.ndev.append(0)
            self.nhost.append(0)
        self._node.put(key, node)
        if parent >= 0:
            self.nchild[parent] += 1
            self.ndev[parent] += 1
        self.num_nodes += 1
        self.device_pages += 1
        self.policy.on_new(node)
        return node

    @property
    def clock(self) -> int:
        """The logical time of the last lookup or insert (what ``stamp`` holds)."""
        return self._clock

    def node_of(self, key: int) -> int:
        return self._node.get(key)

    def remove(self, node: int, why: int = 0) -> int:
        """Unlink a childless, unlocked node that is no longer resident on either tier; its key.

        ``why`` (0..7): how it left, kept in its tombstone when the tree keeps ghosts.
        """
        if self.nchild[node] or self.lock[node] or self.dev[node] >= 0 or self.host[node] >= 0:
            raise RadixError(f"cannot remove {self.info(node)}: it has children, is locked or resident")
        key = self.key[node]
        if self._node.max_ghosts:
            self._node.bury(key, why)
        else:
            self._node.pop(key)
        parent = self.parent[node]
        self.parent[node] = -2  # dead (never a candidate: dev and host are -1)
        self._free.append(node)
        self.num_nodes -= 1
        if parent >= 0:
            self.nchild[parent] -= 1
            self.offer(parent)
        return key

    def set_device(self, node: int, page: int) -> None:
        """Record (``page >= 0``) or clear (``-1``) a node's device page, keeping the counts right."""
        self._set_tier(node, page, self.dev, self.ndev, "device_pages")

    def set_host(self, node: int, page: int) -> None:
        """The same for the node's host page."""
        self._set_tier(node, page, self.host, self.nhost, "host_pages")

    def _set_tier(self, node: int, page: int, pages: Any, child_counts: Any, total: str) -> None:
        old = pages[node]
        pages[node] = page
        if (old >= 0) != (page >= 0):
            step = 1 if page >= 0 else -1
            setattr(self, total, getattr(self, total) + step)
            parent = self.parent[node]
            if parent >= 0:
                child_counts[parent] += step
                if step < 0:
                    self.offer(parent)
        self.offer(node)

    # -- lookups and inserts ------------------------------------------------------------------
    def match(self, keys: list[int], limit: int, offer: bool = True,
              before: list[int] | None = None) -> Match:
        """Longest cached prefix of ``keys`` (at most ``limit`` pages); marks it used.

        ``offer=False`` when the caller locks the path right away (its unlock offers).
        ``before``: filled with the path's last-use stamps as they were (reuse gaps).
        """
        get, parent = self._node.get, self.parent
        path: list[int] = []
        prev = -1
        miss = 0
        for k in keys[:limit]:
            node = get(k)
            if node < 0:
                miss = node
                break
            if parent[node] != prev:
                raise RadixError(f"page key {k} is cached after another prefix: keys are not chained")
            path.append(node)
            prev = node
        t = self._tick()
        stamp, hits, dev, touched = self.stamp, self.hits, self.dev, self.policy.touched
        if before is not None:
            before.extend([stamp[s] for s in path])
        device = len(path)
        for i, node in enumerate(path):
            stamp[node] = t
            hits[node] += 1
            if touched is not None:
                touched(node)
            if device == len(path) and dev[node] < 0:
                device = i
        if offer:
            for node in path:
                self.offer(node)
        return Match(path, device, miss)

    def insert(self, after: int, keys: list[int], pages: list[int], path: list[int] = ()
               ) -> tuple[list[int], list[int]]:
        """Cache ``keys`` below node ``after`` (-1: the root) on device ``pages``.

        Returns (created nodes, duplicate pages).  A key already on device
        (another request computed it meanwhile) makes the caller's page a
        duplicate, to be freed; a key on host only adopts the caller's page (no
        reload needed).  ``path`` (the matched prefix) is marked used as well.
        """
        get, parent, dev, stamp = self._node.get, self.parent, self.dev, self.stamp
        t = self._tick()
        for node in path:
            stamp[node] = t
        created: list[int] = []
        duplicates: list[int] = []
        prev = after
        for k, page in zip(keys, pages, strict=True):
            node = get(k)
            if node < 0:
                node = self._new(k, prev, t, page)
                created.append(node)
            elif parent[node] != prev:
                raise RadixError(f"page key {k} is cached after another prefix: keys are not chained")
            elif dev[node] >= 0:
                if dev[node] != page:
                    duplicates.append(page)
            else:
                self.set_device(node, page)
            stamp[node] = t
            prev = node
        if prev >= 0:
            self.offer(prev)  # the chain's tip; nodes above it have a device child now
        return created, duplicates

    def insert_host(self, after: int, keys: list[int], host_pages: list[int]) -> list[int]:
        """Cache ``keys`` below node ``after`` as host-only nodes on ``host_pages`` (pages read
        from L3); none of the keys may be cached yet.  Returns the new nodes, root side first."""
        t = self._tick()
        nodes: list[int] = []
        prev = after
        for k, page in zip(keys, host_pages, strict=True):
            if self._node.get(k) >= 0:
                raise RadixError(f"page key {k} is cached already: L3 pages extend a matched prefix")
            node = self._new(k, prev, t, 0)  # born on device, moved to host at once (the counts follow)
            self.set_host(node, page)
            self.set_device(node, -1)
            nodes.append(node)
            prev = node
        return nodes

    # -- locks ----------------------------------------------------------------------------------
    def lock_path(self, node: int) -> None:
        lock, parent = self.lock, self.parent
        while node >= 0:
            lock[node] += 1
            node = parent[node]

    def unlock_path(self, node: int) -> None:
        lock, parent = self.lock, self.parent
        while node >= 0:
            if lock[node] <= 0:
                raise RadixError(f"unlock of {self.info(node)} below zero")
            lock[node] -= 1
            if not lock[node]:
                self.offer(node)
            node = parent[node]

    # -- eviction candidates ------------------------------------------------------------------
    def candidate(self, node: int, tier: int) -> bool:
        if self.lock[node]:
            return False
        if tier == DEVICE:
            return self.dev[node] >= 0 and not self.ndev[node]
        return (self.host[node] >= 0 and not self.nhost[node]
                and (self.dev[node] >= 0 or not self.nchild[node]))

    def offer(self, node: int) -> None:
        """Push ``node`` to each tier's heap it is a candidate of, at its current priority."""
        if self.lock[node] or self.parent[node] == -2:
            return
        dev = self.dev[node] >= 0
        tiers = [DEVICE] if dev and not self.ndev[node] else []
        if self.host[node] >= 0 and not self.nhost[node] and (dev or not self.nchild[node]):
            tiers.append(HOST)
        if not tiers:
            return
        entry = (self.policy.priority(node) << 32) | node
        for tier in tiers:
            heap = self._heaps[tier]
            heapq.heappush(heap, entry)
            if len(heap) > self._rebuild_at[tier]:
                self._rebuild()  # mostly stale entries: start again from the candidates

    def pop(self, tier: int) -> int:
        """The tier's lowest-priority candidate (told to the policy as evicted), or -1."""
        for attempt in range(2):
            heap = self._heaps[tier]
            while heap:
                entry = heapq.heappop(heap)
                node = entry & _SLOT_MASK
                if self.candidate(node, tier) and self.policy.priority(node) == entry >> 32:
                    self.policy.evicted(node)
                    return node
            if attempt == 0:
                self._rebuild()
        return -1

    def _views(self) -> dict[str, np.ndarray]:
        return {name: np.frombuffer(getattr(self, name), dtype=_DTYPES[code]) for name, code in _FIELDS}

    def _rebuild(self) -> None:
        """Both heaps from scratch: every candidate once, at its current priority."""
        v = self._views()
        free = v["lock"] == 0
        masks = (free & (v["dev"] >= 0) & (v["ndev"] == 0),
                 free & (v["host"] >= 0) & (v["nhost"] == 0) & ((v["dev"] >= 0) | (v["nchild"] == 0)))
        del v
        for tier, mask in enumerate(masks):
            nodes = np.flatnonzero(mask)
            heap = [(p << 32) | s for p, s in zip(self.policy.priorities(nodes), nodes.tolist(),
                                                   strict=True)]
            heapq.heapify(heap)
            self._heaps[tier][:] = heap
            self._rebuild_at[tier] = 2 * len(heap) + 4096

    # -- inspection -----------------------------------------------------------------------------
    def info(self, node: int) -> NodeInfo:
        return NodeInfo(node, self.key[node], self.parent[node], self.dev[node], self.host[node],
                        self.lock[node], self.stamp[node], self.hits[node], self.nchild[node])

    def nodes(self) -> Iterator[int]:
        """Live nodes (no particular order)."""
        return iter(self._node.items()[1].tolist())

    def page_ids(self) -> tuple[list[int], list[int]]:
        """Device and host page ids the tree holds."""
        v = self._views()
        return v["dev"][v["dev"] >= 0].tolist(), v["host"][v["host"] >= 0].tolist()

    def locked_pages(self) -> int:
        """Device pages of the tree held by running requests (not evictable)."""
        v = self._views()
        return int(((v["lock"] > 0) & (v["dev"] >= 0)).sum())

    def check(self) -> None:
        """Assert the invariants of the module docstring (tests, ``--check-every``)."""
        v = self._views()
        live = np.zeros(len(v["key"]), dtype=bool)
        keys, nodes = self._node.items()
        live[nodes] = True
        assert len(nodes) == len(self._node) == self.num_nodes == int((v["parent"] != -2).sum()), \
            "node count"
        assert np.array_equal(v["key"][nodes], keys), "key table out of step with the nodes"
        assert all(self._node.get(k) == s for k, s in zip(keys.tolist(), nodes.tolist(),
                                                          strict=True)), "a key is not reachable"
        dev, host, parent = v["dev"], v["host"], v["parent"]
        assert not (live & (dev < 0) & (host < 0)).any(), "a node is resident nowhere"
        assert not (~live & ((dev >= 0) | (host >= 0))).any(), "a dead node holds pages"
        has_parent = live & (parent >= 0)
        assert live[parent[has_parent]].all(), "a node's parent is dead"
        assert (dev[parent[has_parent & (dev >= 0)]] >= 0).all(), "device residency not prefix-closed"
        n = len(live)
        for field, mask in (("nchild", has_parent), ("ndev", has_parent & (dev >= 0)),
                            ("nhost", has_parent & (host >= 0))):
            want = np.bincount(parent[mask], minlength=n)
            assert np.array_equal(v[field][live], want[live]), f"{field} counts out of step"
        assert (v["lock"] >= 0).all(), "negative lock"
        assert self.device_pages == int((dev >= 0).sum()), "device page count"
        assert self.host_pages == int((host >= 0).sum()), "host page count"
