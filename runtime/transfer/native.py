"""A transfer's host fast path in C, compiled on first use: the page-id check, and the launch.

Why C: a move's ids are checked before a byte moves (in range, allocated, no
destination listed twice), and on the H200 host those checks were most of the
time from the call to the copy's start -- numpy runs them as five or six
separate passes, each paying its dispatch (about 2 us warm, 10-30 us right after
a large copy has pushed the interpreter out of the CPU caches), and a small
move's copy itself takes 50-100 us.  One C pass over the ids reads each id once.

The source below is compiled with the machine's C compiler (the one Triton uses
for its launchers) into a per-user cache, keyed by the source's hash, and loaded
through ctypes -- only from a directory and file that are the user's own and
writable by nobody else; otherwise it is built into a fresh private directory.  No compiler, a failed build, or ``STAGECACHE_NATIVE=0``: ``None``,
and ``pages.py`` runs its numpy checks (the same answers; tested against each
other).  Everything that does not change between calls (addresses, page counts)
sits in a context array, so a call passes three arguments.  The duplicate test
keeps one generation counter per call instead of clearing a mark array: a page
whose mark equals this call's generation was listed before in this call.

The launch: a stage move queues three things on the caller's stream (start
event, graph, end event), each a bare CUDA runtime call through ctypes
(``cudart.py``).  ``stagecache_launch`` makes them from C through the runtime's
own function addresses, so Python crosses into C once per move.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

SOURCE = r"""
#include <stdint.h>

/* ctx (int64 words): device "in use" map, device pages, host "in use" map, host pages,
   device marks, host marks, ids (device ids, then host ids at + cap), cap, generation.
   1 when every id of both sides is in range and allocated and no destination id repeats;
   0 otherwise (the caller's numpy checks then say what is wrong). */
int stagecache_ids_ok(int64_t *ctx, int64_t n, int dest_is_device)
{
    const uint8_t *dev_used = (const uint8_t *)(intptr_t)ctx[0];
    const uint8_t *host_used = (const uint8_t *)(intptr_t)ctx[2];
    const uint64_t dev_pages = (uint64_t)ctx[1], host_pages = (uint64_t)ctx[3];
    int64_t *marks = (int64_t *)(intptr_t)(dest_is_device ? ctx[4] : ctx[5]);
    const int64_t *dev = (const int64_t *)(intptr_t)ctx[6];
    const int64_t *host = dev + ctx[7];
    const int64_t *dst = dest_is_device ? dev : host;
    const int64_t generation = ++ctx[8];
    for (int64_t i = 0; i < n; i++) {
        uint64_t d = (uint64_t)dev[i], h = (uint64_t)host[i];
        if (d >= dev_pages || h >= host_pages)
            return 0;
        if (!dev_used[d] || !host_used[h])
            return 0;
        if (marks[dst[i]] == generation)
            return 0;
        marks[dst[i]] = generation;
    }
    return 1;
}

typedef int (*record_fn)(void *event, void *stream);
typedef int (*launch_fn)(void *exec, void *stream);

/* fns: the addresses of cudaEventRecord and cudaGraphLaunch in the process's CUDA runtime.
   Queues a stage move on stream -- start event, graph, end event -- in one call from Python;
   returns the first CUDA error (0: none), and makes no call after it. */
int stagecache_launch(const int64_t *fns, void *stream, void *start, void *exec, void *end)
{
    record_fn record = (record_fn)(intptr_t)fns[0];
    launch_fn launch = (launch_fn)(intptr_t)fns[1];
    int err = record(start, stream);
    if (!err)
        err = launch(exec, stream);
    if (!err)
        err = record(end, stream);
    return err;
}
"""

_LOADED: list[Any] = []


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stagecache"


def _private(path: Path) -> bool:
    """Whether ``path`` is this user's and nobody else may write it: a library built or loaded
    where others can write would run their code."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build(target: Path) -> bool:
    """Compile ``SOURCE`` into ``target`` (written under a temporary name, then renamed)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return False
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "ids.c", Path(tmp) / "ids.so"
        src.write_text(SOURCE)
        try:
            done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
                                  capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
        if done.returncode != 0 or not out.exists():
            return False
        os.chmod(out, 0o755)  # whatever the umask: a library only its owner may rewrite
        os.replace(out, target)
    return True


def _library() -> Any:
    """The compiled library (ctypes), or None where it cannot be had."""
    if _LOADED:
        return _LOADED[0]
    lib = None
    if os.environ.get("STAGECACHE_NATIVE", "1") != "0":
        name = f"ids-{hashlib.sha256(SOURCE.encode()).hexdigest()[:16]}.so"
        try:
            cache = _cache_dir()
            cache.mkdir(mode=0o700, parents=True, exist_ok=True)
            target = cache / name
            if _private(cache) and (target.exists() and _private(target) or _build(target)):
                lib = ctypes.CDLL(str(target)) if _private(target) else None
        except OSError:
            lib = None
        if lib is None:  # no usable cache: a private directory of this process, built anew
            tmp = tempfile.mkdtemp(prefix="stagecache-native-")
            try:
                target = Path(tmp) / name
                lib = ctypes.CDLL(str(target)) if _build(target) else None
            except OSError:
                lib = None
            finally:  # a loaded library stays mapped once its file is gone
                shutil.rmtree(tmp, ignore_errors=True)
    if lib is not None:
        vp = ctypes.c_void_p
        lib.stagecache_ids_ok.argtypes = [vp, ctypes.c_int64, ctypes.c_int]
        lib.stagecache_launch.argtypes = [vp] * 5
        lib.stagecache_ids_ok.restype = lib.stagecache_launch.restype = ctypes.c_int
    _LOADED.append(lib)
    return lib


def ids_ok_function() -> Any:
    """The compiled id check ``(ctx, n, dest_is_device) -> 1 | 0``, or None."""
    lib = _library()
    return None if lib is None else lib.stagecache_ids_ok


def launch_function() -> Any:
    """The compiled launch ``(fns, stream, start, exec, end) -> cudaError``, or None."""
    lib = _library()
    return None if lib is None else lib.stagecache_launch
