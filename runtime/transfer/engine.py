"""The Triton engine: a stage move = ids into a slot + one CUDA graph launch between two events.

What a call costs on the host is what HiCache pays on every prefix hit and
eviction, and on the H200 host it decided small moves: so everything that does
not depend on the call's page ids is done once and kept, and what is left goes
to the CUDA runtime directly (``cudart.py``):

* per buffer selection (``Plan``) and direction: two chunk tables on the device,
  a coarse one (``chunk_bytes`` per work item) and a fine one (``fine_chunk_bytes``)
  for moves with fewer coarse items than the grid has warps, so a one-page move
  still spreads over every SM instead of leaving most of them idle;
* per (plan, direction, id slot, size bucket): a CUDA graph holding the copy of
  the slot's ids to the device (a bucket's worth: a few hundred bytes for a small
  move) and the one kernel launch; the kernel reads the page count and the ids
  from the device, so no work item waits on a PCIe round trip for its addresses;
* per controller: a ring of id slots (pinned host + device twin) whose reuse is
  guarded by the event of the transfer that last used them (the host only waits
  when more transfers are queued than the ring has slots), and a pool of timing
  events.  A move larger than a slot goes in slot-sized pieces.

``backup``/``load`` queue on the caller's current stream: ordered after the KV
the caller just wrote and before whatever it queues next, with no cross-stream
events and no stream switch.  A layer-by-layer load runs on the engine's own
stream, after an event on the caller's, so later layers overlap the caller's
compute (``TransferResult.wait``).  Under ``TRITON_INTERPRET=1`` on CPU pools
the same kernel runs synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..memory.host_pools import HostPools
from ..memory.pools import StagePools
from . import cudart, kernels, native
from .pages import PageIds
from .plan import Plan

#: Id slots in the ring (each with its own CUDA graphs), and the most pages one slot holds:
#: a slot is sized to the larger pool (a move never lists a destination page twice), up to
#: ``SLOT_PAGES_MAX``; a larger move is queued as several launches, one slot each.
RING_SLOTS = 4
SLOT_PAGES_MAX = 1 << 16
#: Smallest id-copy bucket (pages): a graph copies the ids of its bucket, not of the whole slot.
MIN_BUCKET = 16
_WORD_DTYPES = {8: "int64", 4: "int32", 2: "int16", 1: "int8"}


@dataclass(frozen=True)
class EngineOptions:
    """Launch shape of the engine (the benchmark's ``--sweep`` tries several)."""

    chunk_bytes: int = kernels.CHUNK_BYTES
    num_warps: int = kernels.NUM_WARPS
    programs_per_sm: int = kernels.PROGRAMS_PER_SM
    graphs: bool = True
    #: Copy the ids to the device inside the graph (one small copy ahead of the kernel) instead
    #: of letting every work item read them from pinned host memory across PCIe.
    device_ids: bool = True
    #: Bytes per work item of small moves (fewer coarse items than the grid has warps).
    fine_chunk_bytes: int = kernels.FINE_CHUNK_BYTES
    #: Start each warp-step on a 128-byte line of the host side (whole-line PCIe requests).
    align_host: bool = True


class _Launch:
    """Everything one (plan, direction) launch needs; graphs per (id slot, bucket), captured on first use.

    ``tables`` holds (device table, geometry) coarse first, then fine.
    """

    __slots__ = ("tables", "anchor", "graphs")

    def __init__(self, tables: list[tuple[Any, kernels.ChunkTable]], anchor: Any):
        self.tables, self.anchor = tables, anchor
        self.graphs: dict[tuple[int, int], tuple[Any, int]] = {}  # -> (graph, raw exec handle or 0)

    def table_for(self, pages: int, warps: int) -> tuple[Any, kernels.ChunkTable]:
        """The fine table when the coarse one would give fewer work items than the grid has warps."""
        coarse = self.tables[0]
        return self.tables[-1] if pages * coarse[1].chunks < warps else coarse


def bucket(pages: int, cap: int) -> int:
    """The id-copy size (pages) a move of ``pages`` uses: the next power of two, within [MIN_BUCKET, cap]."""
    return min(cap, max(MIN_BUCKET, 1 << (pages - 1).bit_length()))


class _Slots:
    """A ring of ``[n, device ids, host ids]`` slots, reused in turn once the transfer reading them ended.

    The host writes a slot in pinned memory; with ``device_ids`` the launch first copies
    it to the slot's device twin, so the kernel's many id reads stay on the device.
    """

    def __init__(self, slots: int, pages: int, anchor_addr: int, device: Any, device_ids: bool,
                 rt: cudart.Runtime | None = None):
        import torch

        self.pages = pages
        self.host = torch.zeros((slots, 1 + 2 * pages), dtype=torch.int64, pin_memory=True)
        self.dev = torch.zeros_like(self.host, device=device) if device_ids else None
        read = self.dev if device_ids else self.host
        self.offsets = [(read[k].data_ptr() - anchor_addr) // 8 for k in range(slots)]
        # one event per slot, recorded after the last launch that reads the slot: the timing
        # events of a transfer stay free to be reused as soon as its stats are taken
        self.guards: list[Any] = [torch.cuda.Event() for _ in range(slots)]
        for g in self.guards:
            g.record()  # creates the CUDA event (its handle is used by raw runtime calls)
        #: per slot, the event after the last launch that reads it: its guard, the end event of a
        #: one-launch move (one record less per move), or None once that move is known finished
        #: (its end event then goes back to the pool, where a later move records it again)
        self.marks: list[Any] = list(self.guards)
        self.rows = list(self.host.numpy())  # each slot's numpy row (a view), made once
        # the bare query where there is a runtime (torch's costs a few us on the hot path)
        self._done = (lambda g: rt.event_query(g.cuda_event) == 0) if rt is not None else (lambda g: g.query())
        self.next = 0

    def fill(self, dev: Any, host: Any) -> int:
        """Write the ids (at most ``pages``) into the next free slot; returns the slot."""
        k = self.next
        self.next = (k + 1) % len(self.rows)
        mark = self.marks[k]
        if mark is not None and not self._done(mark):
            mark.synchronize()  # backpressure: RING_SLOTS transfers are still queued
        _write_ids(self.rows[k], dev, host)
        return k

    def guard(self, slot: int) -> None:
        """Record the slot's own guard on the current stream (after a piece that reads it)."""
        self.guards[slot].record()
        self.marks[slot] = self.guards[slot]

    def upload(self, slot: int, pages: int) -> None:
        """Queue the copy of the slot's first ``pages`` ids to the device (a no-op for host ids)."""
        if self.dev is not None:
            width = 1 + 2 * pages
            self.dev[slot, :width].copy_(self.host[slot, :width], non_blocking=True)


def _write_ids(out: Any, dev: Any, host: Any) -> None:
    n = dev.shape[0]
    out[0] = n
    out[1:1 + n] = dev
    out[1 + n:1 + 2 * n] = host


class TritonEngine:
    """One kernel launch (a graph launch) per stage move; asynchronous on CUDA."""

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
        self._rt: cudart.Runtime | None = None
        self._launch3: Any = None
        if self.cuda:
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self.programs = sms * self.options.programs_per_sm
            self.warps = self.programs * self.options.num_warps
            self.stream = torch.cuda.Stream(self.device)  # layer-by-layer loads only
            self._entry = torch.cuda.Event()
            pages = max(1, min(SLOT_PAGES_MAX, max(dp.num_pages, hp.num_pages)))
            self._rt = cudart.runtime() if self.options.graphs else None
            # the three runtime calls of a move in one call into C (None: three ctypes calls)
            self._launch3 = native.launch_function() if self._rt is not None else None
            if self._launch3 is not None:
                import numpy as np

                self._fns = np.array(self._rt.functions, dtype=np.int64)  # type: ignore[union-attr]
                self._fns_at = int(self._fns.ctypes.data)
            self._slots = _Slots(RING_SLOTS, pages, self._anchor.data_ptr(), self.device, self.options.device_ids,
                                 self._rt)
        else:
            self.programs = self.warps = 3  # interpreter: a few programs still exercise the persistent loop

    # -- per call ---------------------------------------------------------------------------
    def run(self, plan: Plan, ids: PageIds, d2h: bool) -> None:
        """Interpreter (CPU tensors): the same kernel, synchronously."""
        import numpy as np
        import torch

        launch = self._launch_for(plan, d2h)
        slot = np.empty(1 + 2 * ids.count, dtype=np.int64)
        _write_ids(slot, ids.device, ids.host)
        t = torch.from_numpy(slot)
        table, geometry = launch.table_for(ids.count, self.warps)
        kernels.launch_stage_copy(launch.anchor, self._anchor, table, self._offset(t), geometry,
                                  d2h, self.programs, self.options.num_warps, self.options.align_host)

    def submit(self, d2h: bool, plans: list[Plan], ids: PageIds, per_layer: bool) -> tuple[Any, Any, list]:
        """Queue one launch per plan; returns (start, end, per-plan events when ``per_layer``).

        A move of more pages than a slot holds is queued in slot-sized pieces, each recording
        its slot's guard event, so a later piece may reuse the slot once the earlier one ran.
        """
        import torch

        launches = [self._launch_for(p, d2h) for p in plans]  # built before anything is queued
        start, end = self._events.pop() if self._events else self._new_events()
        if not per_layer and ids.count <= self._slots.pages and self._rt is not None:
            return self._submit_fast(launches[0], ids, d2h, start, end)
        if per_layer:  # the engine's stream, after what the caller's stream wrote so far
            self._entry.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(self._entry)
            with torch.cuda.stream(self.stream):
                return self._queue_pieces(start, end, launches, ids, d2h, per_layer)
        return self._queue_pieces(start, end, launches, ids, d2h, per_layer)  # caller's stream: no switch

    def _submit_fast(self, launch: _Launch, ids: PageIds, d2h: bool, start: Any, end: Any) -> tuple[Any, Any, list]:
        """The common move (whole selection, one slot): three runtime calls on the caller's stream
        (start, graph, end; the end event guards the slot), made from C where ``native.py`` could
        be built."""
        slots = self._slots
        slot = slots.fill(ids.device, ids.host)
        entry = self._graph(launch, slot, bucket(ids.count, slots.pages), d2h)
        rt, stream = self._rt, cudart.raw_stream(self.device)
        assert rt is not None
        if entry[1] and self._launch3 is not None:
            bad = self._launch3(self._fns_at, stream, start.cuda_event, entry[1], end.cuda_event)
        else:
            bad = rt.event_record(start.cuda_event, stream)
            bad |= rt.graph_launch(entry[1], stream) if entry[1] else (entry[0].replay() or 0)
            bad |= rt.event_record(end.cuda_event, stream)
        if bad:
            raise RuntimeError(f"CUDA runtime error {bad} while queuing a stage move")
        slots.marks[slot] = end
        return start, end, []

    def _new_events(self) -> tuple[Any, Any]:
        """Timing events, recorded once so that their CUDA handles exist for the runtime calls."""
        import torch

        events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for e in events:
            e.record()
        return events

    def _queue_pieces(self, start: Any, end: Any, launches: list[_Launch], ids: PageIds, d2h: bool,
                      per_layer: bool) -> tuple[Any, Any, list]:
        import torch

        cap, n = self._slots.pages, ids.count
        events: list[Any] = []
        start.record()
        for lo in range(0, n, cap):
            slot = self._slots.fill(ids.device[lo:lo + cap], ids.host[lo:lo + cap])
            size, last = bucket(min(cap, n - lo), cap), lo + cap >= n
            for launch in launches:
                self._queue(launch, slot, size, d2h)
                if per_layer and last:  # the last piece of a layer ends that layer
                    events.append(torch.cuda.Event())
                    events[-1].record()
            self._slots.guard(slot)
            if last:
                end.record()
        return start, end, events

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two finished events (the bare runtime call where there is one)."""
        return self._rt.elapsed_ms(start, end) if self._rt is not None else start.elapsed_time(end)

    def recycle(self, start: Any, end: Any) -> None:
        """Timing events of a finished transfer, for the next one (creating events costs ~25 us).

        A slot guarded by that end event is free now: it stops pointing at the event, which a
        later move may record again (waiting on it would wait for that later move)."""
        marks = self._slots.marks
        for k, mark in enumerate(marks):
            if mark is end:
                marks[k] = None
        if len(self._events) < 64:
            self._events.append((start, end))

    def _queue(self, launch: _Launch, slot: int, size: int, d2h: bool) -> None:
        """The slot's id copy (device ids) and the launch: one graph replay, captured on first use."""
        if not self.options.graphs:
            self._slots.upload(slot, size)
            self._launch(launch, slot, size, d2h)
            return
        self._graph(launch, slot, size, d2h)[0].replay()

    def _graph(self, launch: _Launch, slot: int, size: int, d2h: bool) -> tuple[Any, int]:
        """The (graph, raw exec handle) of a slot and size bucket, captured on first use."""
        entry = launch.graphs.get((slot, size))
        if entry is None:
            entry = launch.graphs[(slot, size)] = self._capture(launch, slot, size, d2h)
        return entry

    def _launch(self, launch: _Launch, slot: int, size: int, d2h: bool) -> None:
        table, geometry = launch.table_for(size, self.warps)
        kernels.launch_stage_copy(launch.anchor, self._anchor, table, self._slots.offsets[slot],
                                  geometry, d2h, self.programs, self.options.num_warps, self.options.align_host)

    def _offset(self, t: Any) -> int:
        return (t.data_ptr() - self._anchor.data_ptr()) // 8

    # -- once per (plan, direction[, slot, bucket]) -------------------------------------------
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
        tables = []
        for chunk in dict.fromkeys((self.options.chunk_bytes, self.options.fine_chunk_bytes)):
            geometry = kernels.chunk_table(spans, self._anchor.data_ptr(), chunk)
            rows = geometry.rows or [[0] * kernels.TABLE_COLUMNS]
            tables.append((torch.tensor(rows, dtype=torch.int64, device=self.device), geometry))
        # the word size follows the addresses, strides and page sizes, never the chunk size
        launch = _Launch(tables, self._anchor.view(getattr(torch, _WORD_DTYPES[tables[0][1].word])))
        if self.cuda:  # compile and load the kernel now, outside any capture (n = 0: no copy)
            zero = torch.zeros(1, dtype=torch.int64, device=self.device)
            for table, geometry in tables:
                kernels.launch_stage_copy(launch.anchor, self._anchor, table, self._offset(zero), geometry,
                                          d2h, self.programs, self.options.num_warps, self.options.align_host)
            torch.cuda.current_stream(self.device).synchronize()  # ``zero`` must outlive the launch
        return launch

    def _capture(self, launch: _Launch, slot: int, size: int, d2h: bool) -> tuple[Any, int]:
        """A CUDA graph of the slot's id copy and the launch (captured on a side stream)."""
        import torch

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._slots.upload(slot, size)
                self._launch(launch, slot, size, d2h)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        try:  # the executable graph's handle, for a bare cudaGraphLaunch (0: replay through torch)
            raw = int(graph.raw_cuda_graph_exec())
        except (AttributeError, RuntimeError, TypeError):
            raw = 0
        return graph, raw
