"""A transfer's host fast path in C (``native.c``, built at install): the page-id check, and the whole move.

Why C: a small move's copy takes 50-100 us on the link, and on the H200 host the Python around
it (numpy passes over the ids, the ring entry fill, runtime calls through ctypes) took 20-60 us
before the copy was queued -- several times that once a large copy had pushed the interpreter
and the driver out of the CPU caches.  So the common move is one call (``native.c`` documents
each: ``ids_ok``, ``move``, ``copy_pages``, ``copy_checked``); everything that does not change
between calls sits in one int64 ``context`` array.  The calls run with the GIL held, so a check
and an entry take are atomic for Python threads.  Where the module was not built or
``STAGECACHE_NATIVE=0``, ``module()`` is None and every move takes the Python path
(docs/transfer.md).
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
