"""The Triton engine: a stage move = ids into a pinned slot + one CUDA graph replay.

What a call costs on the host is what HiCache pays on every prefix hit and
eviction, so everything that does not depend on the call's page ids is done
once and kept:

* per buffer selection (``Plan``) and direction: the chunk table on the device;
* per (plan, direction, id slot): a CUDA graph holding the one kernel launch.
  The kernel reads the page count and the ids from the pinned slot itself
  (zero-copy), so the same graph serves every size and no upload is queued (an
  upload to a device copy was measured: it added ~80 us of host time per call
  and gained nothing on the device);
* per controller: a ring of pinned id slots whose reuse is guarded by the event
  of the transfer that last used them (the host only waits when more transfers
  are queued than the ring has slots), and a pool of timing events.

``backup``/``load`` queue on the caller's current stream: ordered after the KV
the caller just wrote and before whatever it queues next, with no cross-stream
events and no stream switch (each costs the host more than the launch).  A
layer-by-layer load runs on the engine's own stream, after an event on the
caller's, so later layers overlap the caller's compute (``TransferResult.wait``).
Under ``TRITON_INTERPRET=1`` on CPU pools the same kernel runs synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..memory.host_pools import HostPools
from ..memory.pools import StagePools
from . import kernels
from .pages import PageIds
from .plan import Plan

#: Pinned id slots (each with its own CUDA graphs), and the largest call (pages) a slot holds;
#: a larger call uses a one-off pinned tensor and a plain launch.
RING_SLOTS = 4
RING_PAGES = 1024
_WORD_DTYPES = {8: "int64", 4: "int32", 2: "int16", 1: "int8"}


@dataclass(frozen=True)
class EngineOptions:
    """Launch shape of the engine (the benchmark's ``--sweep`` tries several)."""

    chunk_bytes: int = kernels.CHUNK_BYTES
    num_warps: int = kernels.NUM_WARPS
    programs_per_sm: int = kernels.PROGRAMS_PER_SM
    graphs: bool = True


class _Launch:
    """Everything one (plan, direction) launch needs; graphs per id slot, captured on first use."""

    __slots__ = ("table", "geometry", "anchor", "graphs")

    def __init__(self, table: Any, geometry: kernels.ChunkTable, anchor: Any):
        self.table, self.geometry, self.anchor = table, geometry, anchor
        self.graphs: dict[int, Any] = {}


class _PinnedSlots:
    """Pinned ``[n, device ids, host ids]`` slots, reused in turn once the kernel reading them ran."""

    def __init__(self, slots: int, pages: int, anchor_addr: int):
        import torch

        self.buf = torch.zeros((slots, 1 + 2 * pages), dtype=torch.int64, pin_memory=True)
        self.arrays = self.buf.numpy()
        self.offsets = [(self.buf[k].data_ptr() - anchor_addr) // 8 for k in range(slots)]
        self.anchor_addr = anchor_addr
        self.guards: list[Any] = [None] * slots
        self.next = 0
        self._oneoff: list[tuple[Any, Any]] = []  # (event, tensor): kept alive until read

    def fill(self, ids: PageIds) -> tuple[int, int, Any]:
        """(slot or -1, the ids' int64 offset from the anchor, a one-off tensor to keep alive)."""
        import torch

        if 1 + 2 * ids.count > self.arrays.shape[1]:
            self._oneoff = [(e, t) for e, t in self._oneoff if not e.query()]
            t = torch.empty(1 + 2 * ids.count, dtype=torch.int64, pin_memory=True)
            _write_ids(t.numpy(), ids)
            return -1, (t.data_ptr() - self.anchor_addr) // 8, t
        k = self.next
        self.next = (k + 1) % len(self.offsets)
        guard = self.guards[k]
        if guard is not None and not guard.query():
            guard.synchronize()  # backpressure: RING_SLOTS transfers are still queued
        _write_ids(self.arrays[k], ids)
        return k, self.offsets[k], None

    def guard(self, slot: int, event: Any, keep: Any) -> None:
        if slot >= 0:
            self.guards[slot] = event
        else:
            self._oneoff.append((event, keep))


def _write_ids(out: Any, ids: PageIds) -> None:
    n = ids.count
    out[0] = n
    out[1:1 + n] = ids.device
    out[1 + n:1 + 2 * n] = ids.host


class TritonEngine:
    """One kernel launch (a graph replay) per stage move; asynchronous on CUDA."""

    path = "triton"

    def __init__(self, dp: StagePools, hp: HostPools, options: EngineOptions | None = None):
        import torch

        self.dp, self.hp = dp, hp
        self.options = options or EngineOptions()
        self.device = dp.device
        self.cuda = self.device.type == "cuda"
        # every address is a word offset from this tensor (on the pools' device)
        self._anchor = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._launches: dict[tuple[Plan, bool], _Launch] = {}
        self._events: list[tuple[Any, Any]] = []
        if self.cuda:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.programs = sms * self.options.programs_per_sm
            self.stream = torch.cuda.Stream(self.device)  # layer-by-layer loads only
            self._entry = torch.cuda.Event()
            self._slots = _PinnedSlots(RING_SLOTS, RING_PAGES, self._anchor.data_ptr())
            self._zero = torch.zeros(1, dtype=torch.int64, pin_memory=True)  # n = 0: compiles, moves nothing
        else:
            self.programs = 3  # interpreter: a few programs still exercise the persistent loop

    # -- per call ---------------------------------------------------------------------------
    def run(self, plan: Plan, ids: PageIds, d2h: bool) -> None:
        """Interpreter (CPU tensors): the same kernel, synchronously."""
        import numpy as np
        import torch

        launch = self._launch_for(plan, d2h)
        slot = np.empty(1 + 2 * ids.count, dtype=np.int64)
        _write_ids(slot, ids)
        t = torch.from_numpy(slot)
        kernels.launch_stage_copy(launch.anchor, self._anchor, launch.table, self._offset(t), launch.geometry,
                                  d2h, self.programs, self.options.num_warps)

    def submit(self, d2h: bool, plans: list[Plan], ids: PageIds, per_layer: bool) -> tuple[Any, Any, list]:
        """Queue one launch per plan; returns (start, end, per-plan events when ``per_layer``)."""
        import torch

        launches = [self._launch_for(p, d2h) for p in plans]  # built (and captured) before queuing
        slot, off, keep = self._slots.fill(ids)
        start, end = self._events.pop() if self._events else (
            torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        if not per_layer:  # the caller's stream: no switch, no cross-stream event
            start.record()
            self._queue(launches[0], slot, off, d2h)
            end.record()
            self._slots.guard(slot, end, keep)
            return start, end, []
        self._entry.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(self._entry)  # what the caller's stream wrote so far is what moves
        events = []
        with torch.cuda.stream(self.stream):
            start.record()
            for launch in launches:
                self._queue(launch, slot, off, d2h)
                events.append(torch.cuda.Event())
                events[-1].record()
            end.record()
        self._slots.guard(slot, end, keep)
        return start, end, events

    def recycle(self, start: Any, end: Any) -> None:
        """Timing events of a finished transfer, for the next one (creating events costs ~10 us).

        An end event still guarding an id slot stays out of the pool: re-recorded, it would
        make the slot look busy until a later transfer ends.
        """
        if len(self._events) < 64 and not any(g is end for g in self._slots.guards):
            self._events.append((start, end))

    def _queue(self, launch: _Launch, slot: int, off: int, d2h: bool) -> None:
        graph = launch.graphs.get(slot)
        if graph is None and slot >= 0 and self.options.graphs:
            graph = launch.graphs[slot] = self._capture(launch, off, d2h)
        if graph is not None:
            graph.replay()
        else:
            kernels.launch_stage_copy(launch.anchor, self._anchor, launch.table, off, launch.geometry, d2h,
                                      self.programs, self.options.num_warps)

    def _offset(self, t: Any) -> int:
        return (t.data_ptr() - self._anchor.data_ptr()) // 8

    # -- once per (plan, direction[, slot]) --------------------------------------------------
    def _launch_for(self, plan: Plan, d2h: bool) -> _Launch:
        launch = self._launches.get((plan, d2h))
        if launch is None:
            launch = self._launches[(plan, d2h)] = self._build(plan, d2h)
        return launch

    def _build(self, plan: Plan, d2h: bool) -> _Launch:
        import torch

        spans = []
        for ref in plan.buffers:
            d, h = self.dp.buffers[ref.pool][ref.index], self.hp.buffers[ref.pool][ref.index]
            spans.append(kernels.BufferSpan(ref.page_bytes, d.data_ptr(), h.data_ptr(), d.stride(0), h.stride(0)))
        geometry = kernels.chunk_table(spans, self._anchor.data_ptr(), self.options.chunk_bytes)
        table = torch.tensor(geometry.rows or [[0] * kernels.TABLE_COLUMNS], dtype=torch.int64, device=self.device)
        launch = _Launch(table, geometry, self._anchor.view(getattr(torch, _WORD_DTYPES[geometry.word])))
        if self.cuda:  # compile and load the kernel now, outside any capture (n = 0: no copy)
            kernels.launch_stage_copy(launch.anchor, self._anchor, table, self._offset(self._zero), geometry, d2h,
                                      self.programs, self.options.num_warps)
        return launch

    def _capture(self, launch: _Launch, off: int, d2h: bool) -> Any:
        """A CUDA graph of the launch reading the id slot at ``off`` (captured on a side stream)."""
        import torch

        side = torch.cuda.Stream(self.device)
        with torch.cuda.stream(side):
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                kernels.launch_stage_copy(launch.anchor, self._anchor, launch.table, off, launch.geometry, d2h,
                                          self.programs, self.options.num_warps)
            finally:
                graph.capture_end()
        return graph
