"""A transfer's host fast path in C, compiled on first use: the page-id check, and the whole move.

Why C: a small move's copy takes 50-100 us on the link, and on the H200 host
the Python around it (five numpy passes over the ids, the id slot fill, three
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
* ``move(ctx, dev, host, dest_is_device, execs, stream)``: takes the next id slot
  of the engine's ring (the slot's last reader must be done: one event query,
  only when that reader was not yet seen finished), checks the ids while writing
  them into the slot's pinned row, picks the graph of the slot and size bucket,
  and queues it with one ``cudaGraphLaunch`` -- the graph records the slot's own
  start and end events, so there is no other runtime call.  It returns the slot,
  or a negative code saying what the engine must do first (capture a graph, wait
  for a slot, finish the transfer that owns the slot's events) or that the move
  is not one for this path (then the general path runs and names any bad id);
* ``copy_pages(table, dev, host, d2h, threads)``: CPU pools -- one ``memcpy`` per
  page per buffer of a plan, without the GIL, split by bytes over ``threads``
  threads: torch's own OpenMP threads where the compiler has OpenMP, else a
  thread per part (``fallback.py``).

The ids may be numpy arrays or torch tensors (``configure`` names the tensor
type): a 1-D contiguous int64 CPU one is read in place, any other is left to the
caller (never a CUDA tensor's device pointer read from the host).

Everything that does not change between calls sits in one int64 context array
(``context``): addresses of the allocators' "in use" maps and of the mark arrays,
page counts, the generation, and the ring (next slot, per slot: the event to
wait for, whether its events time an unfinished transfer, its end event).  The
calls run with the GIL held, so a check and a slot take are atomic for Python
threads.

The source is compiled as a CPython extension with the machine's C compiler and
Python headers (what Triton needs for its own launchers) into a per-user cache,
keyed by the source's hash and the interpreter's ABI, and loaded only from a
directory and file that are the user's own and writable by nobody else;
otherwise it is built into a fresh private directory.  No compiler or headers, a
failed build, or ``STAGECACHE_NATIVE=0``: ``module()`` is None, ``pages.py`` runs
its numpy checks (the same answers; tested against each other), the engine
queues moves from Python, and CPU pools move through numpy and torch rows.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: Words of ``context`` (the C enum below): the checks', then the ring's.
(DEV_USED, DEV_PAGES, HOST_USED, HOST_PAGES, DEV_MARKS, HOST_MARKS, GEN, SLOTS, CAP, NEXT, ROWS, ROW_WORDS,
 QUERY, LAUNCH, BUCKETS, MIN_BUCKET, ERR, WANT_SLOT, WANT_INDEX, WANT_SIZE, RING) = range(21)
#: Words per ring slot after ``RING``: the event to wait for before reuse (0: free), whether the
#: slot's own events time a transfer not yet finished, the slot's end event.
MARK, OWNED, END, PER_SLOT = range(4)
#: Most ring slots a context has room for.
MAX_SLOTS = 8
#: ``move`` codes: >= 0 the slot queued; these otherwise.
IDS_BAD, NEED_GRAPH, BUSY, OWNED_SLOT, CUDA_ERROR, NOT_HANDLED = -1, -2, -3, -4, -5, -6

#: The C source (a CPython extension module), shipped next to this file.
SOURCE = (Path(__file__).with_name("native.c")).read_text()

NAME = "_stagecache_native"
_LOADED: list[Any] = []


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stagecache"


def _private(path: Path) -> bool:
    """Whether ``path`` is this user's and nobody else may write it: a library built or loaded
    where others can write would run their code."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _file_name() -> str:
    key = hashlib.sha256((SOURCE + (sysconfig.get_config_var("SOABI") or "")).encode()).hexdigest()[:16]
    return f"{NAME}-{key}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def _build(target: Path) -> bool:
    """Compile ``SOURCE`` into ``target`` (written under a temporary name, then renamed)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    include = sysconfig.get_paths().get("include")
    if cc is None or not include or not Path(include, "Python.h").exists():
        return False
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "native.c", Path(tmp) / target.name
        src.write_text(SOURCE)
        # OpenMP where the compiler has it (the CPU copy's threads: see copy_parallel), else without
        for extra in (["-fopenmp"], []):
            try:
                done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-pthread", *extra, f"-I{include}", "-o",
                                       str(out), str(src)], capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError):
                return False
            if done.returncode == 0 and out.exists():
                break
        else:
            return False
        os.chmod(out, 0o755)  # whatever the umask: a library only its owner may rewrite
        os.replace(out, target)
    return True


def _load(path: Path) -> Any:
    # torch before the module: the module then shares torch's OpenMP runtime (one libgomp.so.1),
    # and ids may come as torch tensors (torch is a dependency; without it, numpy arrays only)
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if torch is not None:
        mod.configure(torch.Tensor, torch.int64)
    return mod


def module() -> Any:
    """The compiled module (``ids_ok``, ``move``, ``copy_pages``), or None where it cannot be had."""
    if _LOADED:
        return _LOADED[0]
    mod = None
    if os.environ.get("STAGECACHE_NATIVE", "1") != "0":
        name = _file_name()
        try:
            cache = _cache_dir()
            cache.mkdir(mode=0o700, parents=True, exist_ok=True)
            target = cache / name
            if _private(cache) and (target.exists() and _private(target) or _build(target)):
                mod = _load(target) if _private(target) else None
        except (OSError, ImportError):
            mod = None
        if mod is None:  # no usable cache: a private directory of this process, built anew
            tmp = tempfile.mkdtemp(prefix="stagecache-native-")
            try:
                target = Path(tmp) / name
                mod = _load(target) if _build(target) else None
            except (OSError, ImportError):
                mod = None
            finally:  # a loaded library stays mapped once its file is gone
                shutil.rmtree(tmp, ignore_errors=True)
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
    words = np.zeros(RING + PER_SLOT * MAX_SLOTS, dtype=np.int64)
    words[[DEV_USED, DEV_PAGES, HOST_USED, HOST_PAGES]] = dev_used, dev_pages, host_used, host_pages
    words[[DEV_MARKS, HOST_MARKS]] = [int(m.ctypes.data) for m in marks]
    return Context(words, marks)
