"""A page-granular radix tree over token ids, with a device tier and a host tier per node.

Keys are whole pages of ``page_size`` tokens: a request's partial last page is
never cached, because a page id is the unit every pool of a stage shares (page
``p`` of every pool holds token page ``p``).  Each node covers one or more whole
pages and records, per page, the device page id (``device``) and/or the host
page id (``host``); ``None`` means the node is not resident on that tier.

Two structural invariants make eviction simple and safe, and ``check()``
asserts both (the hypothesis tests call it after every step):

* device residency is *prefix-closed*: a node on device has its parent on
  device, so device eviction only ever takes device *leaves* (no child on
  device) and a matched prefix is always one device run followed by one host run;
* every node is resident somewhere (device, host, or both).

Locks count running requests: ``lock(node)`` increments the node and all its
ancestors, so a page a request uses (or is about to load) is never an eviction
candidate.  LRU order uses a logical clock (deterministic replays) and lazy
heaps: entries are validated when popped, and an empty heap falls back to a full
rescan, so a stale heap can cost time but never a false "out of pages".
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..errors import StageCacheError


class RadixError(StageCacheError, RuntimeError):
    """The tree was used against its contract (unlock below zero, bad page counts)."""


class Node:
    """One radix edge: ``key`` tokens (a whole number of pages) and their pages per tier."""

    __slots__ = ("key", "parent", "children", "device", "host", "lock_ref", "last_access",
                 "hit_count", "alive", "id")

    def __init__(self, key: tuple[int, ...], parent: Node | None, node_id: int):
        self.key = key
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.device: list[int] | None = None
        self.host: list[int] | None = None
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.alive = True
        self.id = node_id

    def __repr__(self) -> str:
        where = ("D" if self.device is not None else "") + ("H" if self.host is not None else "")
        return f"Node(id={self.id}, tokens={len(self.key)}, {where or '-'}, lock={self.lock_ref})"

    def has_device_child(self) -> bool:
        return any(c.device is not None for c in self.children.values())


@dataclass(frozen=True)
class Match:
    """What a prefix lookup found: the matched path, split into its device and host runs."""

    nodes: tuple[Node, ...]  # root excluded, top-down, every node fully matched
    device_nodes: tuple[Node, ...]  # leading run resident on device
    host_nodes: tuple[Node, ...]  # the rest: resident on host only (to be loaded)
    page_size: int

    @property
    def last_node(self) -> Node | None:
        return self.nodes[-1] if self.nodes else None

    @property
    def device_pages(self) -> int:
        return sum(len(n.key) for n in self.device_nodes) // self.page_size

    @property
    def host_pages(self) -> int:
        return sum(len(n.key) for n in self.host_nodes) // self.page_size

    @property
    def pages(self) -> int:
        return self.device_pages + self.host_pages


class RadixTree:
    """The tree and its LRU bookkeeping; the tier *policy* (backup, load) lives in ``hicache``."""

    def __init__(self, page_size: int):
        if page_size <= 0:
            raise RadixError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self._ids = itertools.count()
        self.root = Node((), None, next(self._ids))
        self.root.device = []
        self.root.host = []
        self.root.lock_ref = 1  # never evicted
        self._clock = 0
        self._seq = itertools.count()
        self._dev_heap: list[tuple[int, int, Node]] = []
        self._host_heap: list[tuple[int, int, Node]] = []
        self.num_nodes = 0
        self.device_pages = 0  # pages of cached tokens resident on device
        self.host_pages = 0

    # -- helpers --------------------------------------------------------------------------
    def _page_key(self, tokens: Sequence[int], page: int) -> tuple[int, ...]:
        ps = self.page_size
        return tuple(tokens[page * ps:(page + 1) * ps])

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch(self, node: Node, stamp: int) -> None:
        node.last_access = stamp
        self.push_candidate(node)

    def push_candidate(self, node: Node) -> None:
        """Offer ``node`` to both LRU heaps; validity is re-checked when it is popped."""
        if node is self.root or not node.alive:
            return
        entry = (node.last_access, next(self._seq), node)
        if node.device is not None:
            heapq.heappush(self._dev_heap, entry)
        if node.host is not None:
            heapq.heappush(self._host_heap, entry)
        limit = 8 * self.num_nodes + 1024
        if len(self._dev_heap) > limit or len(self._host_heap) > limit:
            self._rebuild_heaps()

    def _rebuild_heaps(self) -> None:
        nodes = [n for n in self.nodes() if n is not self.root]
        self._dev_heap = [(n.last_access, next(self._seq), n) for n in nodes if self.device_evictable(n)]
        self._host_heap = [(n.last_access, next(self._seq), n) for n in nodes if self.host_evictable(n)]
        heapq.heapify(self._dev_heap)
        heapq.heapify(self._host_heap)

    # -- eviction candidates --------------------------------------------------------------
    def device_evictable(self, node: Node) -> bool:
        """A device leaf nobody holds: evicting it keeps device residency prefix-closed."""
        return (node is not self.root and node.alive and node.device is not None
                and node.lock_ref == 0 and not node.has_device_child())

    def host_evictable(self, node: Node) -> bool:
        """Dropping the host copy is safe if the node stays on device or is a leaf."""
        return (node is not self.root and node.alive and node.host is not None
                and node.lock_ref == 0 and (node.device is not None or not node.children))

    def _pop(self, tier: str) -> Node | None:
        ok = self.device_evictable if tier == "device" else self.host_evictable
        for attempt in range(2):
            heap = self._dev_heap if tier == "device" else self._host_heap
            while heap:
                stamp, _, node = heapq.heappop(heap)
                if stamp == node.last_access and ok(node):
                    return node
            if attempt == 0:
                self._rebuild_heaps()  # nothing valid left: rescan once so we never miss one
        return None

    def pop_device_lru(self) -> Node | None:
        """The least recently used evictable device leaf (removed from the heap), or None."""
        return self._pop("device")

    def pop_host_lru(self) -> Node | None:
        """The least recently used node whose host copy may go (removed from the heap), or None."""
        return self._pop("host")

    # -- structure ------------------------------------------------------------------------
    def _split(self, node: Node, pages: int) -> Node:
        """Cut ``node`` after ``pages`` pages; returns the new upper node (same locks, stamp)."""
        ps = self.page_size
        cut = pages * ps
        upper = Node(node.key[:cut], node.parent, next(self._ids))
        upper.device = node.device[:pages] if node.device is not None else None
        upper.host = node.host[:pages] if node.host is not None else None
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.hit_count = node.hit_count
        parent = node.parent
        assert parent is not None
        parent.children[node.key[:ps]] = upper
        node.key = node.key[cut:]
        node.device = node.device[pages:] if node.device is not None else None
        node.host = node.host[pages:] if node.host is not None else None
        node.parent = upper
        upper.children[node.key[:ps]] = node
        self.num_nodes += 1
        return upper

    def _matched_pages(self, node: Node, tokens: Sequence[int], page: int, limit: int) -> int:
        """How many whole pages of ``node.key`` equal ``tokens`` from ``page`` (at most ``limit``)."""
        ps = self.page_size
        n = min(len(node.key) // ps, limit)
        k = 1  # the first page matched through the children dict
        while k < n and node.key[k * ps:(k + 1) * ps] == self._page_key(tokens, page + k):
            k += 1
        return k

    def match(self, tokens: Sequence[int], max_pages: int | None = None) -> Match:
        """Longest cached page-aligned prefix of ``tokens`` (at most ``max_pages`` pages).

        Splits a node the match ends inside of, so every returned node is
        fully matched, and marks the path as just used (LRU).
        """
        ps = self.page_size
        total = len(tokens) // ps if max_pages is None else min(max_pages, len(tokens) // ps)
        stamp = self._tick()
        node, page, path = self.root, 0, []
        while page < total:
            child = node.children.get(self._page_key(tokens, page))
            if child is None:
                break
            k = self._matched_pages(child, tokens, page, total - page)
            if k < len(child.key) // ps:
                child = self._split(child, k)
            path.append(child)
            page += k
            node = child
        for n in path:
            n.hit_count += 1
            self._touch(n, stamp)
        split = next((i for i, n in enumerate(path) if n.device is None), len(path))
        return Match(tuple(path), tuple(path[:split]), tuple(path[split:]), ps)

    def insert(self, tokens: Sequence[int], device_pages: Sequence[int]) -> tuple[list[Node], list[int]]:
        """Cache ``tokens`` (whole pages) held in ``device_pages``; returns (new nodes, duplicates).

        Where the tree already holds a page on device with a *different* id (a
        concurrent request computed the same prefix), the caller's page is a
        duplicate and is returned for freeing.  Where the tree holds it on host
        only, the caller's device page is adopted (no reload needed).  Pages the
        tree already owns with the same id (the request's own matched prefix)
        are left as they are.
        """
        ps = self.page_size
        if len(tokens) % ps:
            raise RadixError(f"insert needs whole pages: {len(tokens)} tokens, page_size {ps}")
        total = len(tokens) // ps
        if len(device_pages) != total:
            raise RadixError(f"insert: {total} pages of tokens but {len(device_pages)} device pages")
        stamp = self._tick()
        node, page = self.root, 0
        created: list[Node] = []
        duplicates: list[int] = []
        while page < total:
            child = node.children.get(self._page_key(tokens, page))
            if child is None:
                leaf = Node(tuple(tokens[page * ps:]), node, next(self._ids))
                leaf.device = list(device_pages[page:])
                node.children[leaf.key[:ps]] = leaf
                self.num_nodes += 1
                self.device_pages += len(leaf.device)
                self._touch(leaf, stamp)
                created.append(leaf)
                break
            k = self._matched_pages(child, tokens, page, total - page)
            if k < len(child.key) // ps:
                child = self._split(child, k)
            mine = list(device_pages[page:page + k])
            if child.device is None:
                child.device = mine  # host-only node: adopt the freshly computed pages
                self.device_pages += k
            elif child.device != mine:
                duplicates.extend(p for p, q in zip(mine, child.device, strict=True) if p != q)
            self._touch(child, stamp)
            node = child
            page += k
        return created, duplicates

    def remove_leaf(self, node: Node) -> None:
        """Unlink a childless node (its pages must already be released by the caller)."""
        if node.children or node is self.root or node.lock_ref:
            raise RadixError(f"cannot remove {node!r}: it has children, is the root, or is locked")
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[:self.page_size]]
        node.alive = False
        self.num_nodes -= 1
        self.push_candidate(parent)

    def set_device(self, node: Node, pages: list[int] | None) -> None:
        """Record (or clear) a node's device pages, keeping the resident-page counter right."""
        old = len(node.device) if node.device is not None else 0
        new = len(pages) if pages is not None else 0
        node.device = pages
        self.device_pages += new - old
        self.push_candidate(node)
        if pages is None and node.parent is not None:
            self.push_candidate(node.parent)

    def set_host(self, node: Node, pages: list[int] | None) -> None:
        old = len(node.host) if node.host is not None else 0
        new = len(pages) if pages is not None else 0
        node.host = pages
        self.host_pages += new - old
        self.push_candidate(node)

    # -- locks ----------------------------------------------------------------------------
    def lock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise RadixError(f"unlock of {node!r} below zero")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.push_candidate(node)
            node = node.parent

    # -- inspection -----------------------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def locked_pages(self) -> int:
        """Device pages of the tree held by running requests (not evictable)."""
        return sum(len(n.device) for n in self.nodes()
                   if n is not self.root and n.lock_ref and n.device is not None)

    def check(self) -> None:
        """Assert the structural invariants (tests call this after every operation)."""
        ps = self.page_size
        dev = host = count = 0
        for n in self.nodes():
            if n is self.root:
                continue
            count += 1
            pages = len(n.key) // ps
            assert n.alive, f"{n!r} is linked but marked dead"
            assert len(n.key) % ps == 0 and pages > 0, f"{n!r}: key is not whole pages"
            assert n.parent is not None and n.parent.children.get(n.key[:ps]) is n, f"{n!r}: bad link"
            assert n.device is not None or n.host is not None, f"{n!r} is resident nowhere"
            if n.device is not None:
                assert len(n.device) == pages, f"{n!r}: {len(n.device)} device pages for {pages}"
                assert n.parent is self.root or n.parent.device is not None, (
                    f"{n!r} is on device but its parent is not (device residency must be prefix-closed)")
                dev += pages
            if n.host is not None:
                assert len(n.host) == pages, f"{n!r}: {len(n.host)} host pages for {pages}"
                host += pages
            assert n.lock_ref >= 0, f"{n!r}: negative lock"
            child_locks = sum(c.lock_ref for c in n.children.values())
            assert n.lock_ref >= child_locks, f"{n!r}: lock below its children's ({child_locks})"
        assert count == self.num_nodes, f"node count {count} != {self.num_nodes}"
        assert dev == self.device_pages, f"device pages {dev} != counter {self.device_pages}"
        assert host == self.host_pages, f"host pages {host} != counter {self.host_pages}"

    def page_ids(self) -> tuple[list[int], list[int]]:
        """Every device and host page id the tree holds (to check against the allocators)."""
        dev: list[int] = []
        host: list[int] = []
        for n in self.nodes():
            if n is self.root:
                continue
            dev.extend(n.device or ())
            host.extend(n.host or ())
        return dev, host
