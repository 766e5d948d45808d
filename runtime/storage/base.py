"""The L3 store interface (sglang's ``HiCacheStorage`` shape) and what every backend counts.

A store maps string keys (``keys.py``) to byte objects.  Pages move *zero-copy*: a page of one
pool kind is a list of host-tier segments (one per buffer of the kind in the ``layer_first``
layout, one in ``page_first``), given as 1-D ``uint8`` CPU tensors viewing the host pools, and a
backend reads into / writes from them directly (``readv``/``writev`` for files, registered
memory for Mooncake).  Per key the answer is an ``Outcome``, never a bare bool: a *missing* key
is a miss; a *corrupt* object (checksum or size wrong), a *failed* transfer, a *full* store and
a store that is *down* are errors, counted in ``StoreStats`` and never returned as data.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from ..errors import StageCacheError

if TYPE_CHECKING:  # the CLI imports this module to parse flags: no torch import for that
    import torch

#: One page of one pool kind in the host tier: its segments, in buffer order.
Segments = Sequence["torch.Tensor"]


class Outcome(IntEnum):
    """What one key's read or write came to."""

    OK = 0
    MISSING = 1  # not in the store: a miss, not an error
    CORRUPT = 2  # the object failed its checksum or size check: a miss and an error
    FAILED = 3  # the call or the transfer failed (I/O error, master unreachable): an error
    NO_SPACE = 4  # the store is full and could not evict: a refused write, an error
    DOWN = 5  # the store is marked down: not tried (counted, not an error of its own)


#: Outcomes counted as errors (``StoreStats.errors``).
ERRORS = (Outcome.CORRUPT, Outcome.FAILED, Outcome.NO_SPACE)


class StoreUnavailable(StageCacheError):
    """The store cannot be opened at all (library missing, master unreachable, bad directory)."""


def segments_bytes(segments: Segments) -> int:
    return sum(int(t.numel()) for t in segments)


@dataclass
class StoreStats:
    """A store's counters since it was opened (one writer: the stage's scheduler thread)."""

    backend: str = ""
    reads: int = 0  # objects read back whole (OK)
    writes: int = 0  # objects written (OK)
    read_bytes: int = 0
    write_bytes: int = 0
    read_seconds: float = 0.0  # wall time of batch reads (every outcome)
    write_seconds: float = 0.0
    misses: int = 0
    skipped: int = 0  # keys not tried because the store was down
    evictions: int = 0  # objects the store dropped to make room
    errors: dict[str, int] = field(default_factory=lambda: {o.name.lower(): 0 for o in ERRORS})
    downs: int = 0  # times the store went down
    up: bool = True
    down_reason: str | None = None
    used_bytes: int = 0
    capacity_bytes: int = 0  # 0: bounded by the backend itself (Mooncake segments)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def count(self, outcomes: Sequence[Outcome], nbytes: Sequence[int], read: bool, seconds: float) -> None:
        """One batch call's outcomes, bytes and wall time, in the read or the write counters."""
        if read:
            self.read_seconds += seconds
        else:
            self.write_seconds += seconds
        for o, n in zip(outcomes, nbytes, strict=True):
            if o is Outcome.OK:
                if read:
                    self.reads += 1
                    self.read_bytes += n
                else:
                    self.writes += 1
                    self.write_bytes += n
            elif o is Outcome.MISSING:
                self.misses += 1
            elif o is Outcome.DOWN:
                self.skipped += 1
            else:
                self.errors[o.name.lower()] += 1

    def to_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


class L3Store(ABC):
    """One stage's view of an L3 store (``HiCacheStorage``-shaped; see the module docstring).

    The public batch calls time themselves and count outcomes; a backend implements the
    ``_get_into`` / ``_set_from`` / ``_exists`` primitives and the small-object ``get``/``set``.
    """

    backend = "?"

    def __init__(self) -> None:
        self.stats = StoreStats(backend=self.backend)

    # -- pages, zero-copy --------------------------------------------------------------------
    def batch_get_into(self, keys: Sequence[str], views: Sequence[Segments]) -> list[Outcome]:
        """Read each key's object into its segments; OK only when every byte arrived and checked."""
        return self._batch(keys, views, read=True)

    def batch_set_from(self, keys: Sequence[str], views: Sequence[Segments]) -> list[Outcome]:
        """Write each key's object from its segments (a key already stored is kept as it is)."""
        return self._batch(keys, views, read=False)

    def _batch(self, keys: Sequence[str], views: Sequence[Segments], read: bool) -> list[Outcome]:
        """One batch call either way: timed, counted, and all DOWN without a call while down."""
        if len(keys) != len(views):
            name = "batch_get_into" if read else "batch_set_from"
            raise ValueError(f"{name}: {len(keys)} keys for {len(views)} views")
        if not keys:
            return []
        t0 = time.perf_counter()
        call = self._get_into if read else self._set_from
        out = call(keys, views) if self.stats.up else [Outcome.DOWN] * len(keys)
        self.stats.count(out, [segments_bytes(v) for v in views], read, time.perf_counter() - t0)
        return out

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored (sglang's ``batch_exists``); 0 when down."""
        if not keys or not self.stats.up:
            return 0
        found = self._exists(keys)
        return next((i for i, ok in enumerate(found) if not ok), len(keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- small objects (manifests, probes) ------------------------------------------------------
    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """A small object's bytes; None when missing.  Errors raise ``StoreUnavailable``."""

    @abstractmethod
    def set(self, key: str, data: bytes) -> Outcome:
        """Write (or replace) a small object."""

    # -- backend primitives ---------------------------------------------------------------------
    @abstractmethod
    def _get_into(self, keys: Sequence[str], views: Sequence[Segments]) -> list[Outcome]: ...

    @abstractmethod
    def _set_from(self, keys: Sequence[str], views: Sequence[Segments]) -> list[Outcome]: ...

    @abstractmethod
    def _exists(self, keys: Sequence[str]) -> list[bool]: ...

    # -- management -----------------------------------------------------------------------------
    def register(self, tensors: Sequence[torch.Tensor]) -> None:  # noqa: B027 - optional
        """Make host tensors reachable for zero-copy transfers (a no-op where none is needed)."""

    @abstractmethod
    def remove(self, keys: Sequence[str]) -> None:
        """Drop keys (missing ones are ignored)."""

    @abstractmethod
    def reset(self) -> int:
        """Drop every stagecache object in the store (``--l3-reset``); how many went."""

    def health(self) -> tuple[bool, str | None]:
        """Is the store up, and why not."""
        return self.stats.up, self.stats.down_reason

    def mark_down(self, reason: str) -> None:
        if self.stats.up:
            self.stats.downs += 1
        self.stats.up, self.stats.down_reason = False, reason

    def mark_up(self) -> None:
        self.stats.up, self.stats.down_reason = True, None

    def close(self) -> None:  # noqa: B027 - optional: most stores hold nothing to release
        """Release the store's resources (files, the Mooncake client)."""

    def __enter__(self) -> L3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
