"""Device <-> host page transfers for one stage: backup (d2h), load (h2d), layer by layer.

One controller per stage, over that stage's ``StagePools`` and ``HostPools``: page ids are
checked once at the boundary (``pages.PageChecker``), then the same pages of every selected
buffer move together through the stage's one ``PageMover`` (docs/transfer.md lists the movers;
with ``use_triton=True`` and ``TRITON_INTERPRET=1`` CPU pools run the device kernel, so tests
cover it without a GPU).  On CUDA a transfer is asynchronous, queued on the caller's current
stream (so the KV the model just wrote is what gets copied); ``wait(layer)`` lets layer-by-layer
loads overlap compute.  Stats are recorded once per transfer, when it is known finished, with
GPU-measured seconds and the queue wait before the copy started (docs/metrics.md).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..memory.host_pools import HostPools
from ..memory.pools import StagePools
from .clock import EventClock, host_time
from .cpu import CpuMover
from .device import DeviceMover, LaunchShape, have_triton
from .mover import PageMover, Queued
from .pages import CheckedIds, PageChecker, PageIds, TransferError, as_ids, plain_ids
from .selection import Selection, select
from .stats import TransferStats, gbps

__all__ = ["TransferController", "TransferError", "TransferResult"]


class TransferResult:
    """One transfer; done at once on CPU, tracked by CUDA events on GPU."""

    __slots__ = ("direction", "ids", "layers", "nbytes", "path", "seconds", "queue_seconds", "_start", "_end",
                 "_layer_events", "_stats", "_mover", "called", "queued", "_kinds", "_reference")

    def __init__(self, direction: str, ids: PageIds | CheckedIds, sel: Selection, path: str, called: float = 0.0):
        self.direction = direction
        self.ids = ids
        self.layers = sel.layers
        self.nbytes = sel.nbytes(ids.count)
        self.path = path
        self.seconds: float | None = None  # DMA time: copy start to finish
        self.queue_seconds = 0.0  # the call (``perf_counter`` ``called``) to the copy's start
        self._kinds = sel.kinds
        self.called = called  # perf_counter() when backup/load was called
        self.queued = called  # perf_counter() once the copy was queued (CUDA) or began (CPU)
        self._reference: Any = None  # (event, host time) of the EventClock, on CUDA
        self._start: Any = None
        self._end: Any = None
        self._layer_events: dict[int, Any] = {}
        self._stats: TransferStats | None = None
        self._mover: PageMover | None = None  # gets the timing events back when finished

    @property
    def device_pages(self) -> list[int]:
        return self.ids.device.tolist()

    @property
    def host_pages(self) -> list[int]:
        return self.ids.host.tolist()

    @property
    def pages(self) -> int:
        return self.ids.count

    @property
    def kinds(self) -> tuple[tuple[str, int], ...]:
        """``(pool kind, bytes of one token page of it)`` this transfer moved: what a check of
        the transfer against the stage's plan reads (``plan.mirror``)."""
        return self._kinds

    @property
    def done(self) -> bool:
        return self.seconds is not None or (self._end is not None and self._end.query())

    @property
    def gbps(self) -> float:
        return gbps(self.nbytes, self.seconds)

    def wait(self, layer: int | None = None) -> TransferResult:
        """Make the caller's current CUDA stream wait for ``layer`` (or everything); no-op on CPU."""
        if layer is not None and layer not in self.layers:
            raise TransferError(f"layer {layer} is not part of this transfer (layers {list(self.layers)})")
        if self._end is None or self.seconds is not None:
            return self
        import torch

        event = self._end if layer is None else self._layer_events.get(layer, self._end)
        torch.cuda.current_stream().wait_event(event)
        return self

    def synchronize(self) -> TransferResult:
        """Block until finished; records the stats if not yet recorded."""
        if self._end is not None and self.seconds is None:
            self._end.synchronize()
        self._finish()
        return self

    def _finish(self) -> None:
        if self.seconds is None and self._end is not None:
            elapsed = self._mover.elapsed_ms  # type: ignore[union-attr]
            self.seconds = elapsed(self._start, self._end) / 1e3
            if self._reference is not None:
                self.queue_seconds = max(0.0, host_time(self._reference, self._start, elapsed) - self.called)
            self._mover.recycle(self._start, self._end)  # type: ignore[union-attr]
        stats, self._stats = self._stats, None
        if stats is not None:
            stats.record(self.direction, self.nbytes, self.seconds or 0.0, self.pages, self.queue_seconds,
                         self._kinds)

    def __repr__(self) -> str:
        state = f"{self.seconds * 1e3:.3f} ms" if self.seconds is not None else "in flight"
        return f"TransferResult({self.direction}, pages={self.pages}, bytes={self.nbytes}, {self.path}, {state})"


class TransferController:
    """Moves token pages of one stage between its device pools and its host mirror.

    One controller per stage, driven from one thread (the stage's scheduler); the
    ``TransferStats`` it records into may be read from any thread.  On the
    synchronous engines (CPU, torch) calls from several threads are serialised
    (one copy at a time), and the time a call waited shows as its queue wait.
    """

    def __init__(self, device_pools: StagePools, host_pools: HostPools,
                 stats: TransferStats | None = None, use_triton: bool | None = None,
                 shape: LaunchShape | None = None):
        _check_mirror(device_pools, host_pools)
        self.device_pools, self.host_pools, self.stats = device_pools, host_pools, stats
        self.checker = PageChecker(device_pools.stage_map.stage, device_pools.allocator, host_pools.allocator)
        self.mover: PageMover = make_mover(device_pools, host_pools, use_triton, shape, self.checker.context)
        self.path: str = self.mover.path
        self._copy_lock = threading.Lock()  # synchronous movers: one copy at a time
        self._clock = EventClock(device_pools.device) if self.mover.asynchronous else None
        self._selections: dict[tuple[Any, Any], Selection] = {
            (None, None): select(device_pools, host_pools, None, None)}
        self._pending: list[TransferResult] = []

    # -- public API -------------------------------------------------------------------------
    def backup(self, device_pages: Sequence[int], host_pages: Sequence[int],
               layers: Sequence[int] | None = None, blocking: bool = False,
               pools: Sequence[str] | None = None) -> TransferResult:
        """Device -> host: copy ``device_pages[i]`` of every selected buffer to ``host_pages[i]``.

        ``layers`` (global ids) and ``pools`` (kinds) narrow the selection; None = all.
        On CUDA the copy is asynchronous unless ``blocking``; see ``TransferResult``.
        """
        return self._transfer("d2h", device_pages, host_pages, layers, blocking, pools)

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int],
             layers: Sequence[int] | None = None, blocking: bool = False,
             pools: Sequence[str] | None = None) -> TransferResult:
        """Host -> device: copy ``host_pages[i]`` of every selected buffer to ``device_pages[i]``."""
        return self._transfer("h2d", device_pages, host_pages, layers, blocking, pools)

    def load_layer_by_layer(self, host_pages: Sequence[int], device_pages: Sequence[int],
                            layers: Sequence[int] | None = None,
                            pools: Sequence[str] | None = None) -> TransferResult:
        """Host -> device one layer at a time, in order, one event per layer.

        The forward pass calls ``result.wait(layer)`` before attention of that
        layer, so the copy of later layers overlaps compute of earlier ones.
        """
        called = time.perf_counter()
        ids = self.checker.check(device_pages, host_pages, "device")
        sel = self.selection(layers, pools)
        return self._move("h2d", ids, sel, [self.selection([g], pools) for g in sel.layers], False, called,
                          per_layer=True)

    def selection(self, layers: Sequence[int] | None = None, pools: Sequence[str] | None = None) -> Selection:
        """The (cached) buffer selection of ``layers`` x ``pools``; None = all."""
        key = (None if layers is None else tuple(layers), None if pools is None else tuple(pools))
        sel = self._selections.get(key)
        if sel is None:
            sel = select(self.device_pools, self.host_pools, layers, pools)
            if len(self._selections) < 4096:
                self._selections[key] = sel
        return sel

    @property
    def copying(self) -> bool:
        """Whether a synchronous engine's copy is in progress (a call now would wait for it)."""
        return self._copy_lock.locked()

    def poll(self) -> int:
        """Record stats of finished CUDA transfers; returns how many are still in flight."""
        still = []
        for r in self._pending:
            if r.done:
                r._finish()
            else:
                still.append(r)
        self._pending = still
        return len(still)

    def synchronize(self) -> None:
        """Wait for every transfer in flight and record its stats."""
        for r in self._pending:
            r.synchronize()
        self._pending = []

    # -- engine -----------------------------------------------------------------------------
    def _transfer(self, direction: str, device_pages: Sequence[int], host_pages: Sequence[int],
                  layers: Sequence[int] | None, blocking: bool, pools: Sequence[str] | None) -> TransferResult:
        """``backup`` (d2h) or ``load`` (h2d): the mover's one-call move where it takes it, else the
        checks (which name what is wrong) and the mover's general path."""
        called = time.perf_counter()
        sel = self._selections[(None, None)] if layers is None and pools is None else self.selection(layers, pools)
        d2h = direction == "d2h"
        stage = self.checker.stage
        dev, host = plain_ids(device_pages, "device page", stage), plain_ids(host_pages, "host page", stage)
        if not self.mover.asynchronous:
            with self._copy_lock:  # a copy in progress on another thread: this call queues here
                t0 = time.perf_counter()
                done = self.mover.check_and_move(sel, dev, host, d2h)
                t1 = time.perf_counter()
            if done is not None:  # checked and copied in one call; ids made numpy only when read
                result = TransferResult(direction, CheckedIds(dev, host), sel, self.path, called)
                result.seconds, result.queue_seconds, result.queued = t1 - t0, t0 - called, t0
                result._stats = self.stats
                result._finish()
                return result
        else:
            reference = self._clock.reference(called)  # type: ignore[union-attr]  # precedes the start event
            queued = self.mover.check_and_move(sel, dev, host, d2h)
            if queued is not None:  # the copy is queued: the bookkeeping follows while it runs
                at = time.perf_counter()
                ids = PageIds(as_ids(dev, "device page", stage), as_ids(host, "host page", stage))  # numpy views
                result = self._track(direction, ids, sel, called, at, queued, reference)
                return result.synchronize() if blocking else result
        ids = self.checker.check(device_pages, host_pages, "host" if d2h else "device")
        return self._move(direction, ids, sel, [sel], blocking, called)

    def _move(self, direction: str, ids: PageIds, sel: Selection, steps: list[Selection], blocking: bool,
              called: float, per_layer: bool = False) -> TransferResult:
        """Run ``steps`` (the selection, or one per layer) on the mover; one result for all.

        On CUDA the copy is queued first and the bookkeeping (the result, finishing earlier
        transfers) follows while it runs: host work before the launch delays the copy itself.
        """
        steps = [s for s in steps if s.buffers]
        if not ids.count or not steps:
            result = TransferResult(direction, ids, sel, self.path, called)
            result._stats, result.seconds = self.stats, 0.0
            result._finish()
            return result
        if not self.mover.asynchronous:
            result = TransferResult(direction, ids, sel, self.path, called)
            result._stats = self.stats
            with self._copy_lock:  # a copy in progress on another thread: this call queues here
                t0 = time.perf_counter()
                self.mover.move(steps, ids, direction == "d2h", per_layer)
                t1 = time.perf_counter()
            result.seconds, result.queue_seconds, result.queued = t1 - t0, t0 - called, t0
            result._finish()
            return result
        # the clock's reference precedes the start event (a new one is due at most twice a second)
        reference = self._clock.reference(called) if self._clock is not None else None
        queued = self.mover.move(steps, ids, direction == "d2h", per_layer)
        result = self._track(direction, ids, sel, called, time.perf_counter(), queued, reference)
        if per_layer:
            result._layer_events = {s.layers[0]: e for s, e in zip(steps, queued.layer_events, strict=True)}
        return result.synchronize() if blocking else result

    def _track(self, direction: str, ids: PageIds, sel: Selection, called: float, at: float, queued: Queued,
               reference: Any) -> TransferResult:
        """The result of a move queued at ``at`` (``perf_counter``), timed by its events; earlier
        moves' stats recorded."""
        result = TransferResult(direction, ids, sel, self.path, called)
        result.queued, result._reference = at, reference
        result._stats, result._mover = self.stats, self.mover
        result._start, result._end = queued.start, queued.end
        if queued.entry is not None:
            self.mover.own(queued.entry, result)
        if self._pending:
            self.poll()
        self._pending.append(result)
        return result


def make_mover(dp: StagePools, hp: HostPools, use_triton: bool | None = None,
               shape: LaunchShape | None = None, context: Any = None) -> PageMover:
    """The mover for these pools: the device mover on CUDA (and under ``TRITON_INTERPRET=1`` when
    asked for), the CPU mover otherwise."""
    cuda = dp.device.type == "cuda"
    if use_triton is None:
        use_triton = cuda and have_triton()
    if use_triton and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise TransferError("use_triton=True needs device pools on CUDA (or TRITON_INTERPRET=1, which runs "
                            "the kernels on CPU tensors for tests)")
    if cuda or use_triton:
        return DeviceMover(dp, hp, shape, context, use_kernel=use_triton)
    return CpuMover(dp, hp, context)


def _check_mirror(dp: StagePools, hp: HostPools) -> None:
    if hp.device_pools is dp:
        return
    if hp.plan != dp.plan:
        raise TransferError(
            f"host pools of stage {hp.stage_map.stage} do not mirror the device pools "
            f"of stage {dp.stage_map.stage}"
        )
