"""A map from 64-bit page keys to nodes in two typed arrays (open addressing).

Why not a ``dict``: a dict entry of int -> int costs its node in the hash table
(40-80 bytes under insert/delete churn) plus two int objects (28-36 bytes each),
~100-150 bytes per cached page, most of the tree's budget.  Here a key costs
12 bytes of array per table node, and the table stays between 35 % and 70 %
full: 17-34 bytes per key, no Python object per key.

Linear probing, power-of-two capacity, Fibonacci hashing of the key (chained
page keys are already uniform; Mooncake ids are consecutive integers, which
Fibonacci hashing spreads).  Two ways to remove a key:

* ``pop`` shifts the following run back (no tombstones), so a long replay with
  heavy eviction never degrades;
* ``bury`` (the cache insight's memory of evicted pages, ``insight.py``) leaves
  a *tombstone* in place that still answers ``get`` with how the key left
  (``ghost_reason``), costs one probe (no shifting) and 12 bytes per table node.
  At most ``max_ghosts`` tombstones survive a rebuild (the newest, by the
  rebuild epoch they were buried in); a rebuild happens when live keys and
  tombstones fill the table, and places every entry with numpy at once.
"""

from __future__ import annotations

from array import array

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1
_MAX_LOAD = 0.7
_MIN_LOAD = 0.35
EMPTY = -1
#: ``get`` of a buried key: ``GHOST - (reason | epoch << 3)`` (always <= GHOST).
GHOST = -2


def ghost_reason(value: int) -> int:
    """The reason code a tombstone holds (``value`` <= ``GHOST``, as ``get`` returned it)."""
    return (GHOST - value) & 7


class KeyTable:
    """``key -> node`` (nodes are ints >= 0); ``get`` returns -1 for a key never seen (or
    forgotten) and a value <= ``GHOST`` for a buried one."""

    def __init__(self, bits: int = 10, max_ghosts: int = 0):
        self._resize(bits)
        self.size = 0  # live keys
        self.ghosts = 0  # tombstones
        self.max_ghosts = max_ghosts
        self.epoch = 0  # rebuilds so far (tombstones record theirs, so the newest survive)
        self.forgotten = 0  # tombstones dropped by rebuilds

    def _resize(self, bits: int) -> None:
        self._bits = bits
        self._shift = 64 - bits
        self._mask = (1 << bits) - 1
        self._limit = int(_MAX_LOAD * (1 << bits))
        self._keys = array("Q", bytes(8 << bits))
        self._vals = array("i", [EMPTY]) * (1 << bits)

    def __len__(self) -> int:
        return self.size

    def get(self, key: int) -> int:
        keys, vals, mask = self._keys, self._vals, self._mask
        i = ((key * _GOLDEN) & _M64) >> self._shift
        while True:
            v = vals[i]
            if v == -1 or keys[i] == key:  # -1: EMPTY (a literal: this is the hottest loop)
                return v
            i = (i + 1) & mask

    def put(self, key: int, node: int) -> None:
        """Add a key that is not live (its own tombstone, if any, is overwritten)."""
        if self.size + self.ghosts >= self._limit:
            self._rebuild()
        keys, vals, mask = self._keys, self._vals, self._mask
        i = ((key * _GOLDEN) & _M64) >> self._shift
        while True:
            v = vals[i]
            if v == EMPTY:
                break
            if keys[i] == key:  # its tombstone (a live key is never put twice)
                self.ghosts -= 1
                break
            i = (i + 1) & mask
        keys[i] = key
        vals[i] = node
        self.size += 1

    def bury(self, key: int, reason: int) -> None:
        """Remove live ``key``, leaving a tombstone that remembers ``reason`` (0..7)."""
        keys, vals, mask = self._keys, self._vals, self._mask
        i = ((key * _GOLDEN) & _M64) >> self._shift
        while keys[i] != key or vals[i] < 0:
            if vals[i] == -1:
                raise KeyError(key)
            i = (i + 1) & mask
        vals[i] = GHOST - (reason | self.epoch << 3)
        self.size -= 1
        self.ghosts += 1
        if self.size + self.ghosts >= self._limit:
            self._rebuild()

    def buried_runs(self, keys: list[int], start: int, limit: int, first: int
                    ) -> tuple[list[tuple[int, int]], int]:
        """How the buried keys ``keys[start:]`` left, as runs ``[(end, reason), ...]``, up to the
        first key that is not buried (or ``limit``), and that index.  ``first``: what ``get``
        said of ``keys[start]`` (a tombstone).  One loop with the probe inlined: a lookup that
        missed evicted pages walks them all (the cache insight's miss reasons)."""
        tk, tv, mask, shift = self._keys, self._vals, self._mask, self._shift
        runs: list[tuple[int, int]] = []
        code = ghost_reason(first)
        j = start + 1
        while j < limit:
            key = keys[j]
            i = ((key * _GOLDEN) & _M64) >> shift
            v = tv[i]
            while v != -1 and tk[i] != key:
                i = (i + 1) & mask
                v = tv[i]
            if v > GHOST:  # not buried: never seen, or forgotten
                break
            c = (GHOST - v) & 7
            if c != code:
                runs.append((j, code))
                code = c
            j += 1
        runs.append((j, code))
        return runs, j

    def pop(self, key: int) -> None:
        """Remove live ``key``, shifting its probe run (tombstones included) back over the hole."""
        keys, vals, mask, shift = self._keys, self._vals, self._mask, self._shift
        i = ((key * _GOLDEN) & _M64) >> shift
        while keys[i] != key or vals[i] < 0:
            if vals[i] == -1:
                raise KeyError(key)
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            if vals[j] == -1:
                break
            home = ((keys[j] * _GOLDEN) & _M64) >> shift
            # keep entry j where it is if its home lies cyclically in (i, j]
            if (i < j and i < home <= j) or (j < i and (home > i or home <= j)):
                continue
            keys[i] = keys[j]
            vals[i] = vals[j]
            i = j
        vals[i] = -1
        self.size -= 1

    def _rebuild(self) -> None:
        """Every live key and the newest ``max_ghosts`` tombstones into a table at most
        ``_MIN_LOAD`` full (grown or not), placed all at once."""
        vals = np.frombuffer(self._vals, dtype=np.int32)
        keys = np.frombuffer(self._keys, dtype=np.uint64)
        live, dead = vals >= 0, vals <= GHOST
        gk, gv = keys[dead], vals[dead]
        if len(gv) > self.max_ghosts:
            newest = np.argsort((GHOST - gv) >> 3, kind="stable")[len(gv) - self.max_ghosts:]
            self.forgotten += len(gv) - len(newest)
            gk, gv = gk[newest], gv[newest]
        ks = np.concatenate([keys[live], gk])
        vs = np.concatenate([vals[live], gv])
        del vals, keys, live, dead
        bits = self._bits
        while len(ks) > _MIN_LOAD * (1 << bits):
            bits += 1
        self._resize(bits)
        self.ghosts = len(gv)
        self.epoch += 1
        self._place(ks, vs)

    def _place(self, ks: np.ndarray, vs: np.ndarray) -> None:
        """Linear-probing layout of distinct keys into the (empty) table: sorted by home node,
        each key takes the first free node at or after its home; a run past the end wraps."""
        if not len(ks):
            return
        home = ((ks * np.uint64(_GOLDEN)) >> np.uint64(self._shift)).astype(np.int64)
        order = np.argsort(home, kind="stable")
        home, ks, vs = home[order], ks[order], vs[order]
        idx = np.arange(len(ks))
        pos = idx + np.maximum.accumulate(home - idx)
        fits = pos <= self._mask
        keys = np.frombuffer(self._keys, dtype=np.uint64)
        vals = np.frombuffer(self._vals, dtype=np.int32)
        keys[pos[fits]] = ks[fits]
        vals[pos[fits]] = vs[fits]
        del keys, vals
        for k, v in zip(ks[~fits].tolist(), vs[~fits].tolist(), strict=True):  # the wrapped tail
            i = ((k * _GOLDEN) & _M64) >> self._shift
            while self._vals[i] != EMPTY:
                i = (i + 1) & self._mask
            self._keys[i] = k
            self._vals[i] = v

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, nodes) of every live entry, as numpy arrays (copies)."""
        vals = np.frombuffer(self._vals, dtype=np.int32)
        live = vals >= 0
        return np.frombuffer(self._keys, dtype=np.uint64)[live].copy(), vals[live].copy()

    def nbytes(self) -> int:
        return self._keys.itemsize * len(self._keys) + self._vals.itemsize * len(self._vals)
