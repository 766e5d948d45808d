"""A map from 64-bit page keys to node slots in two typed arrays (open addressing).

Why not a ``dict``: a dict entry of int -> int costs its slot in the hash table
(40-80 bytes under insert/delete churn) plus two int objects (28-36 bytes each),
~100-150 bytes per cached page, most of the tree's budget.  Here a key costs
12 bytes of array per table slot, and the table stays between 35 % and 70 %
full: 17-34 bytes per key, no Python object per key.

Linear probing, power-of-two capacity, Fibonacci hashing of the key (chained
page keys are already uniform; Mooncake ids are consecutive integers, which
Fibonacci hashing spreads).  Deletion shifts the following run back (no
tombstones), so a long replay with heavy eviction never degrades.
"""

from __future__ import annotations

from array import array

import numpy as np

_GOLDEN = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1
_MAX_LOAD = 0.7


class KeyTable:
    """``key -> slot`` (slots are ints >= 0); ``get`` returns -1 for a missing key."""

    def __init__(self, bits: int = 10):
        self._resize(bits)
        self.size = 0

    def _resize(self, bits: int) -> None:
        self._bits = bits
        self._shift = 64 - bits
        self._mask = (1 << bits) - 1
        self._limit = int(_MAX_LOAD * (1 << bits))
        self._keys = array("Q", bytes(8 << bits))
        self._vals = array("i", [-1]) * (1 << bits)

    def __len__(self) -> int:
        return self.size

    def get(self, key: int) -> int:
        keys, vals, mask = self._keys, self._vals, self._mask
        i = ((key * _GOLDEN) & _M64) >> self._shift
        while True:
            v = vals[i]
            if v < 0 or keys[i] == key:
                return v
            i = (i + 1) & mask

    def put(self, key: int, slot: int) -> None:
        """Add a key that is not in the table."""
        if self.size >= self._limit:
            self._grow()
        keys, vals, mask = self._keys, self._vals, self._mask
        i = ((key * _GOLDEN) & _M64) >> self._shift
        while vals[i] >= 0:
            i = (i + 1) & mask
        keys[i] = key
        vals[i] = slot
        self.size += 1

    def pop(self, key: int) -> None:
        """Remove a key that is in the table, shifting its probe run back over the hole."""
        keys, vals, mask, shift = self._keys, self._vals, self._mask, self._shift
        i = ((key * _GOLDEN) & _M64) >> shift
        while keys[i] != key or vals[i] < 0:
            if vals[i] < 0:
                raise KeyError(key)
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            if vals[j] < 0:
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

    def _grow(self) -> None:
        old_keys, old_vals = self._keys, self._vals
        live = np.frombuffer(old_vals, dtype=np.int32) >= 0
        ks = np.frombuffer(old_keys, dtype=np.uint64)[live].tolist()
        vs = np.frombuffer(old_vals, dtype=np.int32)[live].tolist()
        del live
        self._resize(self._bits + 1)
        self.size = 0
        for k, v in zip(ks, vs, strict=True):
            self.put(k, v)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, slots) of every entry, as numpy arrays (copies)."""
        vals = np.frombuffer(self._vals, dtype=np.int32)
        live = vals >= 0
        return np.frombuffer(self._keys, dtype=np.uint64)[live].copy(), vals[live].copy()

    def nbytes(self) -> int:
        return self._keys.itemsize * len(self._keys) + self._vals.itemsize * len(self._vals)
