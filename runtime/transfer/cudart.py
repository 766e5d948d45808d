"""The CUDA runtime torch already loaded, called through ctypes and from C for the hot path.

A stage move's graph records its own start and end events, so queuing it is one
``cudaGraphLaunch`` -- made from the compiled fast path (``native.py``) through
the runtime's own function addresses (``Runtime.functions``), with
``cudaEventQuery`` for a ring entry whose last reader may still run.  The ctypes entry
points serve the rest: recording events as graph nodes while capturing
(``cudaEventRecordWithFlags``), elapsed times, and the page-loop peer of the
benchmark.  Through torch's Python wrappers each runtime call costs the H200 host
5-11 us (stream lookups, device guards, argument parsing), about as much as the
copy of a small page set takes on the link.  The handles come from torch's own
objects (``cuda_event``, ``raw_cuda_graph_exec``, the raw current stream), so
torch still owns and frees them.  Where the runtime library or a handle is not
available, ``Runtime`` is None and callers use torch's methods.
"""

from __future__ import annotations

import ctypes
import glob
import os
from typing import Any

#: cudaMemcpyKind: let the runtime infer the direction from unified addresses.
MEMCPY_DEFAULT = 4
#: cudaEventRecordExternal: inside a stream capture, record the event at replay (an event-record
#: node) instead of only ordering the capture.
EVENT_RECORD_EXTERNAL = 1


def _loaded_paths() -> list[str]:
    """libcudart files this process has mapped already (the one torch uses comes first)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        return []
    return sorted(paths)


def _candidates() -> list[str]:
    import torch

    names = _loaded_paths() + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    roots = [os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(torch.__file__))]
    for root in roots:
        names += sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcudart.so*"), recursive=True))
    return names


class Runtime:
    """ctypes entry points (event record as a graph node, elapsed time, async memcpy; each returns
    a cudaError_t) and the addresses of those the C fast path calls."""

    def __init__(self, lib: Any):
        vp = ctypes.c_void_p
        self.lib = lib  # for entry points only the benchmark binds (its copy-engine batch probe)
        version = ctypes.c_int()
        self.version = version.value if lib.cudaRuntimeGetVersion(ctypes.byref(version)) == 0 else 0  # 13000 = 13.0
        lib.cudaMemcpyAsync.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, vp]
        lib.cudaEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), vp, vp]
        lib.cudaMemcpyAsync.restype = lib.cudaEventElapsedTime.restype = ctypes.c_int
        self.memcpy_async = lib.cudaMemcpyAsync
        self._elapsed = lib.cudaEventElapsedTime
        self._ms = ctypes.c_float()
        self._ms_ref = ctypes.byref(self._ms)
        try:  # CUDA 11.1+
            self.record_external: Any = lib.cudaEventRecordWithFlags
            self.record_external.argtypes, self.record_external.restype = [vp, vp, ctypes.c_uint], ctypes.c_int
        except AttributeError:
            self.record_external = None
        # entry points as addresses, for C code that calls them (``native.py``): query, graph launch
        self.functions = [ctypes.cast(f, ctypes.c_void_p).value for f in (lib.cudaEventQuery, lib.cudaGraphLaunch)]

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two finished timing events (torch ``Event``s), as ``elapsed_time``."""
        if self._elapsed(self._ms_ref, start.cuda_event, end.cuda_event):
            return start.elapsed_time(end)  # torch raises the runtime's error with its message
        return self._ms.value


_RUNTIME: list[Runtime | None] = []


def runtime() -> Runtime | None:
    """The process's CUDA runtime through ctypes, or None (no CUDA build, library not found)."""
    if not _RUNTIME:
        found = None
        for name in _candidates():
            try:
                found = Runtime(ctypes.CDLL(name))
                break
            except (OSError, AttributeError):
                continue
        _RUNTIME.append(found)
    return _RUNTIME[0]


def current_stream_fn(device: Any) -> Any:
    """A no-argument callable giving the caller's current stream on ``device`` as a raw handle
    (bound once: the lookup of torch's function and the device index are not redone per call)."""
    import functools

    import torch

    fast = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fast is not None:
        return functools.partial(fast, device.index if device.index is not None else torch.cuda.current_device())
    return lambda: torch.cuda.current_stream(device).cuda_stream
