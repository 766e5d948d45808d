"""A transfer's host fast path in C, compiled on first use: the page-id check, and the whole move.

Why C: a small move's copy takes 50-100 us on the link, and on the H200 host
the Python around it (five numpy passes over the ids, the ring entry fill, three
runtime calls through ctypes, their argument conversions) took 20-60 us before
the copy was queued -- several times that right after a large copy, when the
interpreter and the driver have been pushed out of the CPU caches.  What touches
less memory and runs fewer instructions suffers less from that, so the common
move is one call into this module:

* ``ids_ok(ctx, dev, host, dest_is_device)``: every boundary check in one pass
  over the caller's int64 arrays (read in place through the buffer protocol): in
  range, allocated, no destination listed twice (a generation counter instead of
  clearing a mark array: a page whose mark equals this call's generation was
  listed before in this call).  ``None`` when an argument is not a 1-D int64
  vector (the caller converts it and asks again);
* ``move(ctx, dev, host, dest_is_device, execs, stream)``: takes the next ring entry
  of the engine's ring (the entry's last reader must be done: one event query,
  only when that reader was not yet seen finished), checks the ids while writing
  them into the entry's pinned row, picks the graph of the entry and size bucket,
  and queues it with one ``cudaGraphLaunch`` -- the graph records the entry's own
  start and end events, so there is no other runtime call.  It returns the entry,
  or a negative code saying what the engine must do first (capture a graph, wait
  for a entry, finish the transfer that owns the entry's events) or that the move
  is not one for this path (then the general path runs and names any bad id);
* ``copy_pages(table, dev, host, d2h, threads)``: CPU pools -- one ``memcpy`` per
  page per buffer of a plan, without the GIL, split by bytes over ``threads``
  threads: torch's own OpenMP threads where the compiler has OpenMP, else a
  thread per part (``fallback.py``);
* ``copy_checked(ctx, table, dev, host, d2h, threads, threads_from_pages)``: CPU
  pools, the common move -- ``ids_ok``'s checks on the caller's ids, then, only
  when every one passes, ``copy_pages``' copy: one call where the check, the id
  conversion and the copy were three (on CPU a one-page move is a few us of
  copying, so the calls around it were most of its cost).  False: an id failed
  and nothing moved; None: not 1-D int64 vectors (the general path takes both).

The ids may be numpy arrays or torch tensors (``configure`` names the tensor
type): a 1-D contiguous int64 CPU one is read in place, any other is left to the
caller (never a CUDA tensor's device pointer read from the host).

Everything that does not change between calls sits in one int64 context array
(``context``): addresses of the allocators' "in use" maps and of the mark arrays,
page counts, the generation, and the ring (next entry, per entry: the event to
wait for, whether its events time an unfinished transfer, its end event).  The
calls run with the GIL held, so a check and a entry take are atomic for Python
threads.

The module is a CPython extension built by the build backend when the package is installed
(``setup.py``: ``pip install .`` or ``-e .``); nothing is compiled at run time.  Where it was not
built (no C compiler or Python headers at install) or ``STAGECACHE_NATIVE=0``, ``module()`` is
None, one log line says so, ``pages.py`` runs its numpy check (the same answers: tested against
each other), the device mover queues moves from Python, and CPU moves go through numpy.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: Words of ``context`` (the C enum below): the checks', then the ring's.
(DEV_USED, DEV_PAGES, HOST_USED, HOST_PAGES, DEV_MARKS, HOST_MARKS, GEN, ENTRIES, CAP, NEXT, ROWS, ROW_WORDS,
 QUERY, LAUNCH, BUCKETS, MIN_BUCKET, ERR, WANT_ENTRY, WANT_INDEX, WANT_SIZE, RING) = range(21)
#: Words per ring entry after ``RING``: the event to wait for before reuse (0: free), whether the
#: entry's own events time a transfer not yet finished, the entry's end event.
MARK, OWNED, END, PER_ENTRY = range(4)
#: Most ring entries a context has room for.
MAX_ENTRIES = 8
#: ``move`` codes: >= 0 the entry queued; these otherwise.
IDS_BAD, NEED_GRAPH, BUSY, OWNED_ENTRY, CUDA_ERROR, NOT_HANDLED = -1, -2, -3, -4, -5, -6

_LOADED: list[Any] = []


def _load() -> Any:
    # torch before the module: the module then shares torch's OpenMP runtime (one libgomp.so.1),
    # and ids may come as torch tensors
    import torch

    from . import _native

    _native.configure(torch.Tensor, torch.int64)
    return _native


def module() -> Any:
    """The compiled module (``ids_ok``, ``move``, ``copy_pages``, ``copy_checked``), or None where it
    was not built."""
    if _LOADED:
        return _LOADED[0]
    mod = None
    if os.environ.get("STAGECACHE_NATIVE", "1") == "0":
        log.info("STAGECACHE_NATIVE=0: transfers run through numpy and Python")
    else:
        try:
            mod = _load()
        except ImportError as exc:
            log.warning("stagecache: the compiled transfer helper is not installed (%s): transfers run "
                        "through numpy and Python; reinstall with a C compiler and the Python headers for "
                        "the fast path", exc)
    _LOADED.append(mod)
    return mod


@dataclass(frozen=True)
class Context:
    """The int64 words the C calls read and write, and the mark arrays some of them point at
    (held here so that they live as long as the words)."""

    words: np.ndarray
    marks: tuple[np.ndarray, np.ndarray]


def context(dev_used: int, dev_pages: int, host_used: int, host_pages: int) -> Context:
    """A fresh context: the checks' part filled in (the "in use" maps' addresses and page counts,
    one mark array per side), the ring's left for the engine (``engine.py``)."""
    marks = (np.zeros(max(1, dev_pages), dtype=np.int64), np.zeros(max(1, host_pages), dtype=np.int64))
    words = np.zeros(RING + PER_ENTRY * MAX_ENTRIES, dtype=np.int64)
    words[[DEV_USED, DEV_PAGES, HOST_USED, HOST_PAGES]] = dev_used, dev_pages, host_used, host_pages
    words[[DEV_MARKS, HOST_MARKS]] = [int(m.ctypes.data) for m in marks]
    return Context(words, marks)
