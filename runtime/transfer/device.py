"""The device mover: a stage move = its ids into a ring entry + one CUDA graph launch, in one call into C.

What a call costs on the host is what HiCache pays on every prefix hit and eviction, and on the
H200 host it decided small moves: so everything that does not depend on the call's page ids
(chunk tables per selection, a CUDA graph per selection, direction, ring entry and size bucket,
the id ring of ``ring.py``) is built once, and the common move (``check_and_move``) is one call
into ``native.py`` (7-34 us from the call to the copy queued, against 18-62 us for numpy checks
and three runtime calls through ctypes).  Larger moves, layer-by-layer loads and hosts without
the compiled module go through ``submit`` in entry-sized pieces; a pageable host tier (pinning
refused) takes synchronous torch index copies (path ``torch``).  ``backup``/``load`` queue on
the caller's current stream, ordered after the KV it just wrote; a layer-by-layer load runs on
the engine's own stream so later layers overlap the caller's compute.  docs/bench-transfer.md
describes the graphs and the ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..memory.host_pools import HostPools
from ..memory.pools import StagePools
from . import cudart, kernels, native
from .mover import PageMover, Queued
from .pages import PageIds
from .ring import MIN_BUCKET, IdRing, bucket, bucket_sizes, write_ids
from .selection import Selection, buffer_addresses, buffer_pair

#: Id entries in the ring (each with its own CUDA graphs), and the most pages one entry holds:
#: a entry is sized to the larger pool (a move never lists a destination page twice), up to
#: ``ENTRY_PAGES_MAX``; a larger move is queued as several launches, one entry each.
RING_ENTRIES = 4
ENTRY_PAGES_MAX = 1 << 16
_WORD_DTYPES = {8: "int64", 4: "int32", 2: "int16", 1: "int8"}


def have_triton() -> bool:
    """Whether the Triton kernel loads here (installed and importable); asked only on CUDA, so a
    CPU run never imports triton.  Where it does not load, the moves take the torch path."""
    if not kernels.HAVE_TRITON:
        return False
    try:
        kernels.stage_copy_kernel()
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class LaunchShape:
    """The kernel's launch shape (the benchmark's ``--sweep`` tries several)."""

    chunk_bytes: int = kernels.CHUNK_BYTES
    num_warps: int = kernels.NUM_WARPS
    programs_per_sm: int = kernels.PROGRAMS_PER_SM
    #: Bytes per work item of small moves (fewer coarse items than the grid has warps).
    fine_chunk_bytes: int = kernels.FINE_CHUNK_BYTES
    #: Words each lane moves per step.
    lane_words: int = kernels.LANE_WORDS


class _Launch:
    """Everything one (sel, direction) launch needs; graphs per (ring entry, bucket), captured on first use.

    ``tables`` holds (device table, geometry) coarse first, then fine.
    """

    __slots__ = ("tables", "anchor", "graphs", "execs")

    def __init__(self, tables: list[tuple[Any, kernels.ChunkTable]], anchor: Any, graphs: int):
        import numpy as np

        self.tables, self.anchor = tables, anchor
        # (entry, bucket size, with the entry's timing events) -> (graph, raw exec handle or 0)
        self.graphs: dict[tuple[int, int, bool], tuple[Any, int]] = {}
        #: raw exec handles of the one-launch graphs (with events), per entry then bucket (0: none yet)
        self.execs = np.zeros(graphs, dtype=np.int64)

    def table_for(self, pages: int, warps: int) -> tuple[Any, kernels.ChunkTable]:
        """The fine table when the coarse one would give fewer work items than the grid has warps."""
        coarse = self.tables[0]
        return self.tables[-1] if pages * coarse[1].chunks < warps else coarse


class DeviceMover(PageMover):
    """One kernel launch (a graph launch) per stage move; asynchronous on CUDA.

    ``context`` is the page checker's ``native.Context`` (None without the compiled module):
    its words also hold the id ring, so a one-launch move is one call into C (``check_and_move``).
    ``use_kernel=False`` (no Triton) and a pageable host tier take torch index copies.
    """

    def __init__(self, dp: StagePools, hp: HostPools, shape: LaunchShape | None = None,
                 context: native.Context | None = None, use_kernel: bool = True):
        import numpy as np
        import torch

        super().__init__(dp, hp)
        self.shape = shape or LaunchShape()
        self.device = dp.device
        self.cuda = self.device.type == "cuda"
        self.kernel = use_kernel and (hp.pinned or not self.cuda)  # the kernel reaches pinned host memory only
        self.path = "triton" if self.kernel else "torch"
        self.asynchronous = self.cuda and self.kernel
        # every address is a word offset from this tensor (on the pools' device)
        self._anchor = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._launches: dict[tuple[Selection, bool], _Launch] = {}
        self._events: list[tuple[Any, Any]] = []
        self._rt: cudart.Runtime | None = None
        self._native: Any = None
        if not self.asynchronous:
            self.programs = self.warps = 3  # interpreter: a few programs still exercise the persistent loop
            return
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.programs = sms * self.shape.programs_per_sm
        self.warps = self.programs * self.shape.num_warps
        self.stream = torch.cuda.Stream(self.device)  # layer-by-layer loads only
        self._caller_mark = torch.cuda.Event()
        pages = max(1, min(ENTRY_PAGES_MAX, max(dp.num_pages, hp.num_pages)))
        self._rt = cudart.runtime()
        words = context.words if context is not None else np.zeros(native.RING + native.PER_ENTRY * RING_ENTRIES,
                                                                    dtype=np.int64)
        self._ring = IdRing(RING_ENTRIES, pages, self._anchor.data_ptr(), self.device, words)
        self._buckets = bucket_sizes(pages)
        if context is not None and self._rt is not None and self._rt.record_external is not None:
            self._native = native.module()
            self._stream = cudart.current_stream_fn(self.device)
            words[native.QUERY], words[native.LAUNCH] = self._rt.functions
            words[native.BUCKETS], words[native.MIN_BUCKET] = len(self._buckets), MIN_BUCKET

    # -- per call ---------------------------------------------------------------------------
    def move(self, steps: list[Selection], ids: PageIds, d2h: bool, per_layer: bool = False) -> Queued:
        """Queue one launch per step (checked ids) on the caller's stream (layer by layer: the
        mover's own stream, after what the caller's wrote); synchronous without CUDA events."""
        if not self.kernel:
            for sel in steps:
                self._torch_copy(sel, ids, d2h)
            return Queued()
        if not self.asynchronous:
            for sel in steps:
                self._interpret(sel, ids, d2h)
            return Queued()
        import torch

        launches = [self._launch_for(p, d2h) for p in steps]  # built before anything is queued
        start, end = self._events.pop() if self._events else self._new_events()
        if per_layer:
            self._caller_mark.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(self._caller_mark)
            with torch.cuda.stream(self.stream):
                return self._queue_pieces(start, end, launches, ids, d2h, per_layer)
        return self._queue_pieces(start, end, launches, ids, d2h, per_layer)  # caller's stream: no switch

    def check_and_move(self, sel: Selection, dev: object, host: object, d2h: bool) -> Queued | None:
        """A one-launch move on the caller's stream, in one call into C, timed by the ring entry's
        events; None when this path cannot take it (no compiled module, bad or too many ids, not
        1-D int64 numpy arrays or CPU tensors): then ``move`` after the checks.

        The graph of the entry and size bucket records the entry's start event, copies the ids to
        the device, launches the kernel and records the entry's end event: one runtime call.
        """
        mod = self._native
        if mod is None or not sel.buffers:
            return None
        launch = self._launch_for(sel, d2h)
        words = self._ring.words
        stream = self._stream()
        while True:
            k = mod.move(words, dev, host, not d2h, launch.execs, stream)
            if k >= 0:
                start, end = self._ring.events[k]
                return Queued(start, end, entry=k)
            entry = int(words[native.WANT_ENTRY])
            if k == native.NEED_GRAPH:
                size, index = int(words[native.WANT_SIZE]), int(words[native.WANT_INDEX])
                graph, raw = self._capture(launch, entry, size, d2h, self._ring.events[entry])
                launch.graphs[(entry, size, True)] = graph, raw
                launch.execs[entry * len(self._buckets) + index] = raw
                if not raw:  # no raw handle for the runtime: this path cannot launch it
                    self._native = None
                    return None
            elif k in (native.BUSY, native.OWNED_ENTRY):
                self._ring.wait_free(entry)
            elif k == native.CUDA_ERROR:
                raise RuntimeError(f"CUDA runtime error {int(words[native.ERR])} while queuing a stage move")
            else:
                return None

    def own(self, entry: int, transfer: Any) -> None:
        """``transfer`` is timed by ``entry``'s events: it is finished before the entry is taken again."""
        self._ring.owners[entry] = transfer

    def _interpret(self, sel: Selection, ids: PageIds, d2h: bool) -> None:
        """``TRITON_INTERPRET=1`` on CPU tensors (tests): the same kernel, synchronously."""
        import numpy as np
        import torch

        launch = self._launch_for(sel, d2h)
        row = np.empty(1 + 2 * ids.count, dtype=np.int64)
        write_ids(row, ids.device, ids.host)
        t = torch.from_numpy(row)
        table, geometry = launch.table_for(ids.count, self.warps)
        self._kernel(launch, table, self._offset(t), geometry, d2h)

    def _torch_copy(self, sel: Selection, ids: PageIds, d2h: bool) -> None:
        """A pageable host tier (or no Triton): device-side index_select / index_copy_ plus one host
        copy per buffer; returns when the host side is written (d2h) or the copy is queued (h2d)."""
        import torch

        dev_idx = torch.from_numpy(ids.device).to(self.device)
        for ref in sel.buffers:
            d, h = buffer_pair(ref, self.dp, self.hp)
            if d2h:  # .cpu() waits for the caller's stream: the pages are what it last wrote
                h.numpy()[ids.host] = d.index_select(0, dev_idx).cpu().numpy()
            else:  # queued on the caller's stream, so its later work sees the pages
                d.index_copy_(0, dev_idx, torch.from_numpy(h.numpy()[ids.host]).to(self.device))

    def _new_events(self) -> tuple[Any, Any]:
        """Timing events of several-launch moves (created once, then recycled)."""
        import torch

        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _queue_pieces(self, start: Any, end: Any, launches: list[_Launch], ids: PageIds, d2h: bool,
                      per_layer: bool) -> Queued:
        """A move of more pages than an entry holds goes in entry-sized pieces, each recording its
        entry's guard event, so a later piece may reuse the entry once the earlier one ran."""
        import torch

        cap, n = self._ring.pages, ids.count
        events: list[Any] = []
        start.record()
        for lo in range(0, n, cap):
            entry = self._ring.fill(ids.device[lo:lo + cap], ids.host[lo:lo + cap])
            size, last = bucket(min(cap, n - lo), cap), lo + cap >= n
            for launch in launches:
                self._graph(launch, entry, size, d2h)[0].replay()
                if per_layer and last:  # the last piece of a layer ends that layer
                    events.append(torch.cuda.Event())
                    events[-1].record()
            self._ring.guard(entry)
            if last:
                end.record()
        return Queued(start, end, events)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two finished events (the bare runtime call where there is one)."""
        return self._rt.elapsed_ms(start, end) if self._rt is not None else start.elapsed_time(end)

    def recycle(self, start: Any, end: Any) -> None:
        """Timing events of a finished transfer: an entry's own go back to the entry (free now), others
        to the pool for the next several-launch move (creating events costs ~25 us)."""
        for k, (_, entry_end) in enumerate(self._ring.events):
            if entry_end is end:
                self._ring.release(k)
                return
        if len(self._events) < 64:
            self._events.append((start, end))

    def _graph(self, launch: _Launch, entry: int, size: int, d2h: bool) -> tuple[Any, int]:
        """The (graph, raw exec handle) of an entry's id copy and the launch, per size bucket,
        captured on first use."""
        found = launch.graphs.get((entry, size, False))
        if found is None:
            found = launch.graphs[(entry, size, False)] = self._capture(launch, entry, size, d2h)
        return found

    def _launch(self, launch: _Launch, entry: int, size: int, d2h: bool) -> None:
        table, geometry = launch.table_for(size, self.warps)
        self._kernel(launch, table, self._ring.offsets[entry], geometry, d2h)

    def _kernel(self, launch: _Launch, table: Any, ids_off: int, geometry: kernels.ChunkTable, d2h: bool) -> None:
        """The kernel launch with this mover's grid and shape (ids ``ids_off`` words from the anchor)."""
        kernels.launch_stage_copy(launch.anchor, self._anchor, table, ids_off, geometry, d2h, self.programs,
                                  self.shape.num_warps, self.shape.lane_words)

    def _record_node(self, event: Any, stream: Any) -> None:
        """An event-record node in the graph being captured on ``stream`` (a plain record there
        would only order the capture, not record the event at replay)."""
        assert self._rt is not None and self._rt.record_external is not None
        bad = self._rt.record_external(event.cuda_event, stream.cuda_stream, cudart.EVENT_RECORD_EXTERNAL)
        if bad:
            raise RuntimeError(f"CUDA runtime error {bad} while capturing an event-record node")

    def _offset(self, t: Any) -> int:
        return (t.data_ptr() - self._anchor.data_ptr()) // 8

    # -- once per (sel, direction[, entry, bucket]) -------------------------------------------
    def _launch_for(self, sel: Selection, d2h: bool) -> _Launch:
        launch = self._launches.get((sel, d2h))
        if launch is None:
            launch = self._launches[(sel, d2h)] = self._build(sel, d2h)
        return launch

    def _build(self, sel: Selection, d2h: bool) -> _Launch:
        import torch

        spans = [kernels.BufferSpan(*row) for row in buffer_addresses(sel, self.dp, self.hp)]
        tables = []
        for chunk in dict.fromkeys((self.shape.chunk_bytes, self.shape.fine_chunk_bytes)):
            geometry = kernels.chunk_table(spans, self._anchor.data_ptr(), chunk)
            rows = geometry.rows or [[0] * kernels.TABLE_COLUMNS]
            tables.append((torch.tensor(rows, dtype=torch.int64, device=self.device), geometry))
        # the word size follows the addresses, strides and page sizes, never the chunk size
        launch = _Launch(tables, self._anchor.view(getattr(torch, _WORD_DTYPES[tables[0][1].word])),
                         RING_ENTRIES * len(self._buckets) if self.asynchronous else 0)
        if self.asynchronous:  # compile and load the kernel now, outside any capture (n = 0: no copy)
            zero = torch.zeros(1, dtype=torch.int64, device=self.device)
            for table, geometry in tables:
                self._kernel(launch, table, self._offset(zero), geometry, d2h)
            torch.cuda.current_stream(self.device).synchronize()  # ``zero`` must outlive the launch
        return launch

    def _capture(self, launch: _Launch, entry: int, size: int, d2h: bool,
                 events: tuple[Any, Any] | None = None) -> tuple[Any, int]:
        """A CUDA graph of the entry's id copy and the launch (captured on a side stream); with
        ``events``, between event-record nodes of that start and end event."""
        import torch

        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                if events is not None:
                    self._record_node(events[0], side)
                self._ring.upload(entry, size)
                self._launch(launch, entry, size, d2h)
                if events is not None:
                    self._record_node(events[1], side)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        try:  # the executable graph's handle, for a bare cudaGraphLaunch (0: replay through torch)
            raw = int(graph.raw_cuda_graph_exec())
        except (AttributeError, RuntimeError, TypeError):
            raw = 0
        return graph, raw
