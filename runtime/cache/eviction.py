"""Eviction policies: which evictable page of a tier goes first (``--eviction-policy NAME``).

The tree only ever offers *candidates* a tier may lose without breaking its
invariants (a device leaf, a host copy nobody below needs); a policy orders
them by an integer priority, lowest evicted first.  A policy sees the tree's
per-page arrays (``stamp`` = logical time of the last use, ``hits`` = lookups
that used the page) and may keep arrays of its own.

* ``lru`` -- least recently used first (sglang's default ``--radix-eviction-policy``).
* ``lfu`` -- least frequently used with dynamic aging (LFU-DA): a page's
  priority is ``age + hits`` fixed at its last use, where ``age`` is the
  priority of the last page evicted.  Pages that were popular long ago age
  out once the cache has moved past them; ties go to the least recent.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from ..errors import ConfigError


class EvictionPolicy:
    """Base: subclasses define ``priority``; the hooks are optional."""

    name = ""
    #: Called with the node after each use that changes ``hits``; None skips the call (fast path).
    touched: Any = None

    def attach(self, tree: Any) -> None:
        self.tree = tree

    def on_new(self, node: int) -> None:
        """A node (re)used for a new page."""

    def priority(self, node: int) -> int:
        raise NotImplementedError

    def priorities(self, nodes: np.ndarray) -> list[int]:
        """Priorities of many nodes (the tree's rare full rebuild of its candidate heaps)."""
        return [self.priority(s) for s in nodes.tolist()]

    def evicted(self, node: int) -> None:
        """The page in ``node`` is leaving a tier (called before the tree changes it)."""


class LRU(EvictionPolicy):
    name = "lru"

    def priority(self, node: int) -> int:
        return self.tree.stamp[node]

    def priorities(self, nodes: np.ndarray) -> list[int]:
        return np.frombuffer(self.tree.stamp, dtype=np.int64)[nodes].tolist()


class LFUAging(EvictionPolicy):
    """LFU with dynamic aging (see module docstring); one int64 per page of its own."""

    name = "lfu"
    STAMP_BITS = 40  # the recency tie-break inside one frequency level

    def __init__(self) -> None:
        self.level = array("q")
        self.age = 0
        self.touched = self._touched

    def on_new(self, node: int) -> None:
        if node == len(self.level):
            self.level.append(self.age + 1)
        else:
            self.level[node] = self.age + 1

    def _touched(self, node: int) -> None:
        self.level[node] = self.age + 1 + self.tree.hits[node]

    def priority(self, node: int) -> int:
        return (self.level[node] << self.STAMP_BITS) | self.tree.stamp[node]

    def evicted(self, node: int) -> None:
        self.age = max(self.age, self.level[node])


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "lfu": LFUAging}
DEFAULT_POLICY = "lru"


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"--eviction-policy {name!r}: accepted: {', '.join(POLICIES)}") from None
