"""Page ids at the transfer boundary: converted once, then the one page-id check.

Every transfer checks its ids before any byte moves: integers, same count on
both sides, in range, allocated in the pools' allocators right now, and no
destination page listed twice (the result would depend on copy order).  The check
is ``PageChecker.check``: numpy operations over the whole id arrays (the reference),
or -- where the compiled helper was built at install -- the same answer from one
compiled pass (``native.py``; tested against the reference), so it stays on even on
the hot path.  Once it failed, the numpy steps name what is wrong.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ..errors import StageCacheError
from ..memory.allocator import PageAllocator
from . import native


class TransferError(StageCacheError, ValueError):
    """Bad page ids or layers passed to a transfer (nothing was copied)."""


@dataclass(frozen=True)
class PageIds:
    """Checked page ids of one transfer: ``device[i]`` moves to/from ``host[i]``."""

    device: np.ndarray  # int64
    host: np.ndarray  # int64

    @property
    def count(self) -> int:
        return int(self.device.shape[0])


class CheckedIds:
    """Ids a compiled move checked as the caller passed them (1-D int64 numpy arrays or CPU
    tensors): ``PageIds``' fields, made numpy arrays only when read (a one-page CPU move costs
    a few us; the conversion would be a good part of it)."""

    __slots__ = ("_device", "_host", "count")

    def __init__(self, device: object, host: object):
        self._device, self._host = device, host
        self.count = len(device)  # type: ignore[arg-type]

    @property
    def device(self) -> np.ndarray:
        return as_ids(self._device, "device page", -1)

    @property
    def host(self) -> np.ndarray:
        return as_ids(self._host, "host page", -1)


try:
    from torch import Tensor as _TENSOR
    from torch import int64 as _INT64
except ImportError:  # pragma: no cover - torch is a dependency
    _INT64 = _TENSOR = None

def as_ids(values: object, what: str, stage: int) -> np.ndarray:
    """Page ids (list, tuple, range, tensor, array) -> contiguous 1-D int64 numpy array; non-integers refused."""
    if hasattr(values, "detach"):  # a torch tensor: CPU int64 ones are viewed, not copied
        if values.dtype is _INT64 and values.is_cpu and values.dim() == 1:
            return _contiguous(values.numpy())
        if values.dtype.is_floating_point or values.dtype.is_complex or str(values.dtype) == "torch.bool":
            raise TransferError(f"stage {stage}: {what} ids must be integers, got a {values.dtype} tensor")
        values = values.detach().reshape(-1).cpu().numpy()
    elif isinstance(values, range):
        return np.arange(values.start, values.stop, values.step, dtype=np.int64)
    arr = values if type(values) is np.ndarray else np.asarray(
        values if isinstance(values, (list, tuple)) else list(values))  # type: ignore[call-overload]
    if arr.dtype == np.int64 and arr.ndim == 1:
        return _contiguous(arr)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":  # floats, bools, strings, objects (mixed types)
        items = arr.reshape(-1).tolist()
        bad = next((v for v in items if type(v) is not int), items[0])
        raise TransferError(f"stage {stage}: {what} ids must be integers, got {bad!r}")
    return arr.reshape(-1).astype(np.int64)


def _contiguous(arr: np.ndarray) -> np.ndarray:
    """The compiled checks and copies read ids in place: a strided view is copied once here."""
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def plain_ids(values: object, what: str, stage: int) -> object:
    """``values`` itself when the compiled checks read it in place (a numpy array or a torch
    tensor: they refuse any that is not 1-D int64 contiguous on the CPU), else ``as_ids``."""
    if type(values) is np.ndarray or (_TENSOR is not None and type(values) is _TENSOR):
        return values
    return as_ids(values, what, stage)


class PageChecker:
    """The boundary checks of one controller, with its scratch arrays kept between calls."""

    def __init__(self, stage: int, device: PageAllocator, host: PageAllocator):
        self.stage = stage
        self.allocators = {"device": device, "host": host}
        # duplicate test without sorting: write each position into its page's mark, read back
        self._marks = {side: np.zeros(a.num_pages, dtype=np.int64) for side, a in self.allocators.items()}
        self._positions = np.arange(0, dtype=np.int64)
        self._lock = threading.Lock()  # the numpy checks share ``_marks``
        # the one-pass C check (``native.py``) reads the ids in place; its context (maps, marks,
        # generation) is shared with the engine's one-call moves
        self._native = native.module()
        self.context = native.context(device.used_address(), device.num_pages, host.used_address(),
                                      host.num_pages) if self._native is not None else None

    def check(self, device_pages: object, host_pages: object, dest: str) -> PageIds:
        """Both id lists as int64 arrays, or ``TransferError`` naming stage, side and ids."""
        dev = as_ids(device_pages, "device page", self.stage)
        host = as_ids(host_pages, "host page", self.stage)
        if dev.shape[0] != host.shape[0]:
            raise TransferError(
                f"stage {self.stage}: {dev.shape[0]} device pages but {host.shape[0]} host pages; "
                "each device page needs exactly one host page"
            )
        n = dev.shape[0]
        if not n:
            return PageIds(dev, host)
        if self._native is not None:
            ok = self._native.ids_ok(self.context.words, dev, host, dest == "device")  # type: ignore[union-attr]
        else:
            with self._lock:
                ok = self._vector_ok(dev, host, dest)
        if not ok:
            with self._lock:
                for side, ids in (("device", dev), ("host", host)):  # names what is wrong
                    self._check_side(side, ids)
                self._check_unique(dest, dev if dest == "device" else host)
        return PageIds(dev, host)

    def _vector_ok(self, dev: np.ndarray, host: np.ndarray, dest: str) -> bool:
        """Every check in as few numpy passes as they take; True when all pass.

        Viewed as unsigned, a negative id is larger than any page count, so one ``max`` per
        side is the whole range check.
        """
        for ids, alloc in ((dev, self.allocators["device"]), (host, self.allocators["host"])):
            if ids.view(np.uint64).max() >= alloc.num_pages or not alloc.all_allocated(ids):
                return False
        return not self._repeated(dest, dev if dest == "device" else host).any()

    def _repeated(self, side: str, ids: np.ndarray) -> np.ndarray:
        """Mask of the ids listed more than once, without sorting: each position is written into
        its page's mark, and a position that does not read back lost to a later duplicate."""
        n = ids.shape[0]
        if self._positions.shape[0] < n:
            self._positions = np.arange(max(n, 2 * self._positions.shape[0]), dtype=np.int64)
        pos = self._positions[:n]
        marks = self._marks[side]
        marks[ids] = pos
        return marks[ids] != pos

    # -- only once a check above failed: find what is wrong and say it ----------------------
    def _check_side(self, side: str, ids: np.ndarray) -> None:
        alloc = self.allocators[side]
        n = alloc.num_pages
        if ids.min() < 0 or ids.max() >= n:
            bad = ids[(ids < 0) | (ids >= n)].tolist()
            raise TransferError(
                f"stage {self.stage}: {side} page id(s) {bad[:8]}{'...' if len(bad) > 8 else ''} "
                f"out of range 0..{n - 1}"
            )
        if not alloc.all_allocated(ids):
            bad = alloc.unallocated(ids).tolist()
            raise TransferError(
                f"stage {self.stage}: {side} page(s) {bad[:8]}{'...' if len(bad) > 8 else ''} "
                f"are not allocated in {alloc.name}; transfers only move allocated pages"
            )

    def _check_unique(self, side: str, ids: np.ndarray) -> None:
        lost = self._repeated(side, ids)
        if lost.any():
            dup = sorted(set(ids[lost].tolist()))
            raise TransferError(
                f"stage {self.stage}: destination {side} page(s) {dup[:8]} appear more than once; "
                "the result would depend on copy order"
            )
