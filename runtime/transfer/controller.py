"""Device <-> host page transfers for one stage: backup (d2h), load (h2d), layer by layer.

One controller per stage, over that stage's ``StagePools`` and ``HostPools``.
Page ids are checked at the boundary (same length, in range, no duplicate
destination), then the same pages of every selected buffer move together.

Paths (``TransferResult.path`` and the stats say which ran):

* ``cpu-index``     -- device pools on CPU: ``index_select``/``index_put_``; same API, used by
  tests and CPU demos.
* ``triton-direct`` -- CUDA: one Triton launch per pool kind reads/writes the pinned host pages
  in place (zero-copy through unified addressing).  ``auto`` uses it for small transfers and
  scattered host pages.
* ``triton-staged`` -- CUDA: the device pages are gathered (``index_select`` per layer, or the
  Triton kernel for page_first blocks) into a cached staging ring on a second stream, pipelined
  with one copy-engine DMA per contiguous run of host pages (and buffer, for layer_first);
  loads DMA first, then scatter.  ``auto`` uses it for big transfers into long host runs,
  which is what the host allocator hands out (lowest free ids, ascending).
* ``triton-mixed``  -- staged for some pool kinds, direct for the rest.
* ``torch-staged``  -- CUDA without Triton, or pageable host memory: the staged path.

On CUDA all work goes to a dedicated copy stream, which first waits for the
caller's current stream (so the KV the model just wrote is what gets copied).
Results carry CUDA events: ``wait(layer)`` makes the *current* stream wait for
one layer (layer-by-layer loads overlap compute), ``synchronize()`` blocks the
host.  Stats are recorded once per transfer when it is known finished
(``synchronize``, ``poll``, or the next transfer noticing), with GPU-measured
seconds from the events.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import StageCacheError
from ..memory.host_pools import HostPools
from ..memory.pools import StagePools
from ..model.pool_kinds import HOST_CACHED
from .stats import TransferStats

#: ``auto`` picks per pool kind between the direct kernel and the staged path (thresholds
#: below, measured on the H200: docs/bench-transfer.md); ``direct`` and ``staged`` force one.
MODES = ("auto", "direct", "staged")

#: Staged path: a transfer is cut into units of about ``total / STAGING_CHUNKS`` bytes, at
#: least ``STAGING_CHUNK_MIN_BYTES`` and at most ``STAGING_CHUNK_BYTES`` (a layer_first unit
#: never spans layers), so the device gather of unit k+1 overlaps the DMA of unit k.
STAGING_CHUNKS = 8
STAGING_CHUNK_MIN_BYTES = 4 << 20
STAGING_CHUNK_BYTES = 32 << 20
#: Staging memory a controller keeps (a ring of unit slots, reused in order; at least 2 slots).
STAGING_MAX_BYTES = 256 << 20

#: ``auto`` stages a pool kind when it moves at least this many bytes in the transfer ...
AUTO_STAGED_MIN_BYTES = 32 << 20
#: ... and its contiguous host runs give DMAs of at least this many bytes on average
#: (scattered host pages would mean one small DMA per page: the direct kernel wins there).
AUTO_STAGED_MIN_DMA_BYTES = 1 << 20


class TransferError(StageCacheError, ValueError):
    """Bad page ids or layers passed to a transfer (nothing was copied)."""


@dataclass(frozen=True)
class _Plan:
    """Which buffers of which pool move: buffer indices shared by device and host."""

    pools: tuple[tuple[str, tuple[int, ...]], ...]
    layers: tuple[int, ...]  # global layer ids covered (all the stage's layers when None given)

    def nbytes(self, dp: StagePools, pages: int) -> int:
        return sum(len(ix) * dp.page_bytes(pool) * pages for pool, ix in self.pools)


class TransferResult:
    """One transfer; done at once on CPU, tracked by CUDA events on GPU.

    ``device_ids``/``host_ids`` are the checked page ids as CPU int64 tensors;
    ``device_pages``/``host_pages`` the same as lists.
    """

    def __init__(self, direction: str, device_ids, host_ids, layers: tuple[int, ...], nbytes: int, path: str):
        self.direction = direction
        self.device_ids = device_ids
        self.host_ids = host_ids
        self.layers = layers
        self.nbytes = nbytes
        self.path = path
        self.seconds: float | None = None
        self._start_event: Any = None
        self._end_event: Any = None
        self._layer_events: dict[int, Any] = {}
        self._controller: TransferController | None = None

    @property
    def device_pages(self) -> list[int]:
        return self.device_ids.tolist()

    @property
    def host_pages(self) -> list[int]:
        return self.host_ids.tolist()

    @property
    def pages(self) -> int:
        return int(self.device_ids.numel())

    @property
    def done(self) -> bool:
        if self.seconds is not None:
            return True
        return self._end_event is not None and self._end_event.query()

    def wait(self, layer: int | None = None) -> TransferResult:
        """Make the caller's current CUDA stream wait for ``layer`` (or everything); no-op on CPU."""
        if layer is not None and layer not in self.layers:
            raise TransferError(f"layer {layer} is not part of this transfer (layers {list(self.layers)})")
        if self._end_event is None:
            return self
        import torch

        event = self._end_event if layer is None else self._layer_events.get(layer, self._end_event)
        torch.cuda.current_stream().wait_event(event)
        return self

    def synchronize(self) -> TransferResult:
        """Block until finished; records the stats if not yet recorded."""
        if self._end_event is not None and self.seconds is None:
            self._end_event.synchronize()
        self._finish()
        return self

    def _finish(self) -> None:
        if self.seconds is None and self._end_event is not None:
            self.seconds = self._start_event.elapsed_time(self._end_event) / 1e3
        c, self._controller = self._controller, None
        if c is not None and c.stats is not None:
            c.stats.record(self.direction, self.nbytes, self.seconds or 0.0, self.pages,
                           len(self.layers), self.path)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    def __repr__(self) -> str:
        state = f"{self.seconds * 1e3:.3f} ms" if self.seconds is not None else "in flight"
        return f"TransferResult({self.direction}, pages={self.pages}, bytes={self.nbytes}, {self.path}, {state})"


class TransferController:
    """Moves token pages of one stage between its device pools and its host mirror.

    One controller per stage, driven from one thread (the stage's scheduler); the
    ``TransferStats`` it records into may be read from any thread.
    """

    def __init__(self, device_pools: StagePools, host_pools: HostPools,
                 stats: TransferStats | None = None, use_triton: bool | None = None,
                 mode: str = "auto"):
        import torch

        if host_pools.device_pools is not device_pools:
            mirrored = {p: tuple(b is not None for b in device_pools.buffers[p]) for p in host_pools.kinds}
            if host_pools.stage_map != device_pools.stage_map or mirrored != {
                p: host_pools.plan[p] for p in host_pools.kinds
            }:
                raise TransferError(
                    f"host pools of stage {host_pools.stage_map.stage} do not mirror the device pools "
                    f"of stage {device_pools.stage_map.stage}"
                )
        if mode not in MODES:
            raise TransferError(f"unknown transfer mode {mode!r}; modes are {', '.join(MODES)}")
        self.device_pools = device_pools
        self.host_pools = host_pools
        self.stats = stats
        self.mode = mode
        self.cuda = device_pools.device.type == "cuda"
        if use_triton is None:
            from .kernels import HAVE_TRITON

            use_triton = self.cuda and HAVE_TRITON
        if use_triton and not self.cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise TransferError(
                "use_triton=True needs device pools on CUDA (or TRITON_INTERPRET=1, which runs the "
                "kernels on CPU tensors for tests)"
            )
        self.use_triton = bool(use_triton)
        self.stream = torch.cuda.Stream(device_pools.device) if self.cuda else None
        #: Second stream for the staged path's gathers/scatters, overlapping the DMAs.
        self.gather_stream = torch.cuda.Stream(device_pools.device) if self.cuda else None
        self._tables: dict[tuple[str, str, tuple[int, ...]], Any] = {}
        self._pending: list[TransferResult] = []
        self._all_plan = self._plan(None)
        #: (words per program, warps) of the direct kernel, None = kernels' defaults; the
        #: benchmark sweeps these.
        self.kernel_config: tuple[int | None, int | None] = (None, None)
        # cached between calls: staging ring, pinned/device id buffers, device arange
        self._stage_buf: Any = None
        self._ids_host: Any = None
        self._ids_dev: Any = None
        self._ids_event: Any = None
        self._arange: Any = None

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
        dev, host = self._check_pages(device_pages, host_pages, "device")
        plan = self._plan(layers, pools)
        path, _ = self._choose(plan, host)
        result = TransferResult("h2d", dev, host, plan.layers, plan.nbytes(self.device_pools, dev.numel()), path)
        if not dev.numel():
            return self._done_now(result, 0.0)
        if not self.cuda:
            t0 = time.perf_counter()
            for layer in plan.layers:
                layer_plan = self._plan([layer], pools)
                _, layer_staged = self._choose(layer_plan, host)
                self._run_here("h2d", layer_plan, dev, host, path, layer_staged)
            return self._done_now(result, time.perf_counter() - t0)
        import torch

        caller = torch.cuda.current_stream(self.device_pools.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(caller)  # copy what the caller's stream has written so far
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            dev_t, host_t = self._index_tensors(dev, host)
            for layer in plan.layers:
                layer_plan = self._plan([layer], pools)
                _, layer_staged = self._choose(layer_plan, host)  # one layer of page_first: direct
                self._run_cuda("h2d", layer_plan, dev, host, dev_t, host_t, layer_staged)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                result._layer_events[layer] = ev
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
        return self._track(result, start, end, blocking=False)

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

    # -- checks -----------------------------------------------------------------------------
    def _check_pages(self, device_pages, host_pages, dest: str):
        """Both id lists as CPU int64 tensors, or ``TransferError`` naming stage, side and ids.

        Vectorised (one tensor op per check), so validating 20k page ids costs
        well under a millisecond rather than dominating a small-page transfer.
        """
        stage = self.device_pools.stage_map.stage
        dev = _ids(device_pages, "device page", stage)
        host = _ids(host_pages, "host page", stage)
        if dev.numel() != host.numel():
            raise TransferError(
                f"stage {stage}: {dev.numel()} device pages but {host.numel()} host pages; "
                "each device page needs exactly one host page"
            )
        for ids, side, n in ((dev, "device", self.device_pools.num_pages),
                             (host, "host", self.host_pools.num_pages)):
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
                bad = ids[(ids < 0) | (ids >= n)].tolist()
                raise TransferError(
                    f"stage {stage}: {side} page id(s) {bad[:8]}{'...' if len(bad) > 8 else ''} "
                    f"out of range 0..{n - 1}"
                )
        target = host if dest == "host" else dev
        if target.numel() > 1 and not bool((target[1:] > target[:-1]).all()):  # ascending: no dups
            # O(n) duplicate test: write each position into its page's slot, read back; a page
            # listed twice keeps only one position (sorting 20k ids costs ~20x more)
            import torch

            n = self.host_pools.num_pages if dest == "host" else self.device_pools.num_pages
            pos = torch.arange(target.numel())
            marks = torch.empty(n, dtype=torch.int64).index_copy_(0, target, pos)
            lost = marks.index_select(0, target) != pos
            if bool(lost.any()):
                dup = sorted(set(target[lost].tolist()))
                raise TransferError(
                    f"stage {stage}: destination {dest} page(s) {dup[:8]} appear more than once; "
                    "the result would depend on copy order"
                )
        return dev, host

    def _plan(self, layers: Sequence[int] | None, kinds: Sequence[str] | None = None) -> _Plan:
        dp, hp = self.device_pools, self.host_pools
        m = dp.stage_map
        if kinds is not None:
            unknown = [k for k in kinds if k not in HOST_CACHED]
            if unknown:
                raise TransferError(f"stage {m.stage}: unknown or not host-cached pool kind(s) {unknown}; "
                                    f"transfers move {', '.join(HOST_CACHED)}")
        selected = [p for p in HOST_CACHED if kinds is None or p in kinds]
        if layers is None:
            pools = []
            for pool in selected:
                ix = tuple(i for i, (d, h) in enumerate(zip(dp.buffers[pool], hp.buffers[pool], strict=True))
                           if d is not None and h is not None)
                if ix:
                    pools.append((pool, ix))
            return _Plan(tuple(pools), tuple(range(m.start, m.end)))
        gids = []
        for g in layers:
            if isinstance(g, bool) or not isinstance(g, int):
                raise TransferError(f"stage {m.stage}: layer ids must be integers, got {g!r}")
            m.local_id(g)  # LayerNotOwnedError names the stage's range
            if g not in gids:
                gids.append(g)
        pools = []
        for pool in selected:
            ix = []
            for g in gids:
                idx = m.pool_map(pool).get(m.local_id(g))
                if idx is None:
                    continue
                if idx >= len(dp.buffers[pool]) or dp.buffers[pool][idx] is None or hp.buffers[pool][idx] is None:
                    raise TransferError(f"stage {m.stage}: {pool} buffer {idx} of layer {g} is missing")
                ix.append(idx)
            if ix:
                pools.append((pool, tuple(ix)))
        return _Plan(tuple(pools), tuple(gids))

    # -- engine -----------------------------------------------------------------------------
    def _choose(self, plan: _Plan, host) -> tuple[str, frozenset[str]]:
        """Path name and the pool kinds that go through staging + DMA (the rest: direct kernel).

        ``auto`` decides per pool kind from two measured thresholds: the pool's bytes in this
        transfer (``AUTO_STAGED_MIN_BYTES``) and the mean bytes per DMA the host runs give
        (``AUTO_STAGED_MIN_DMA_BYTES``).  Big transfers into long host runs make few large DMAs,
        which the copy engine moves at the link's ceiling; small ones or scattered host pages
        would make many small DMAs, so the direct kernel writes them in place.
        """
        kinds = [p for p, _ in plan.pools]
        if not self.use_triton:
            return ("torch-staged" if self.cuda else "cpu-index"), frozenset(kinds)
        hp = self.host_pools
        if self.cuda and not hp.pinned:  # pageable host memory: the kernel cannot reach it, DMA can
            return "torch-staged", frozenset(kinds)
        if self.mode == "direct" or not host.numel():
            staged: frozenset[str] = frozenset()
        else:
            # page_first with only some buffers of a kind: host slices are strided, which a
            # DMA cannot do in one piece, so those always go direct.
            dma_ok = [(p, ix) for p, ix in plan.pools
                      if hp.layout == "layer_first" or len(ix) == len(hp.buffers[p])]
            if self.mode == "staged":
                staged = frozenset(p for p, _ in dma_ok)
            else:
                n = int(host.numel())
                runs = 1 + int((host[1:] - host[:-1] != 1).sum()) if n > 1 else 1
                staged = frozenset(p for p, ix in dma_ok if self._staging_pays(p, ix, n, runs))
        if not staged:
            return "triton-direct", staged
        return ("triton-staged" if len(staged) == len(kinds) else "triton-mixed"), staged

    def _staging_pays(self, pool: str, ix: tuple[int, ...], n: int, runs: int) -> bool:
        nbytes = self.device_pools.page_bytes(pool) * len(ix) * n
        dmas = runs * (len(ix) if self.host_pools.layout == "layer_first" else 1)
        return nbytes >= AUTO_STAGED_MIN_BYTES and nbytes / dmas >= AUTO_STAGED_MIN_DMA_BYTES

    def _transfer(self, direction: str, device_pages, host_pages, layers, blocking: bool,
                  kinds: Sequence[str] | None = None) -> TransferResult:
        dev, host = self._check_pages(device_pages, host_pages, "host" if direction == "d2h" else "device")
        plan = self._all_plan if layers is None and kinds is None else self._plan(layers, kinds)
        path, staged = self._choose(plan, host)
        result = TransferResult(direction, dev, host, plan.layers,
                                plan.nbytes(self.device_pools, dev.numel()), path)
        if self._pending:
            self.poll()
        if not dev.numel():
            return self._done_now(result, 0.0)
        if not self.cuda:
            t0 = time.perf_counter()
            self._run_here(direction, plan, dev, host, path, staged)
            return self._done_now(result, time.perf_counter() - t0)
        import torch

        caller = torch.cuda.current_stream(self.device_pools.device)
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(caller)  # copy what the caller's stream has written so far
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            dev_t, host_t = self._index_tensors(dev, host)
            self._run_cuda(direction, plan, dev, host, dev_t, host_t, staged)
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
        return self._track(result, start, end, blocking)

    def _done_now(self, result: TransferResult, seconds: float) -> TransferResult:
        result.seconds = seconds
        result._controller = self
        result._finish()
        return result

    def _track(self, result: TransferResult, start, end, blocking: bool) -> TransferResult:
        result._start_event, result._end_event = start, end
        result._controller = self
        if blocking:
            return result.synchronize()
        self._pending.append(result)
        return result

    def _run_here(self, direction: str, plan: _Plan, dev: list[int], host: list[int], path: str,
                  staged: frozenset[str]) -> None:
        """Synchronous CPU execution: torch indexing, or the Triton paths under TRITON_INTERPRET."""
        if path == "cpu-index":
            self._run_cpu(direction, plan, dev, host)
            return
        dev_t, host_t = self._index_tensors(dev, host)
        self._run_cuda(direction, plan, dev, host, dev_t, host_t, staged)

    def _run_cpu(self, direction: str, plan: _Plan, dev: list[int], host: list[int]) -> None:
        import torch

        d_idx, h_idx = dev, host
        dp, hp = self.device_pools, self.host_pools
        for pool, ix in plan.pools:
            if hp.layout == "page_first" and len(ix) == len(hp.buffers[pool]):
                whole = hp.pool_tensors[pool]
                if direction == "d2h":
                    whole[h_idx] = torch.stack([dp.buffers[pool][i].index_select(0, d_idx) for i in ix], 1)
                else:
                    block = whole.index_select(0, h_idx)
                    for k, i in enumerate(ix):
                        dp.buffers[pool][i].index_copy_(0, d_idx, block[:, k])
                continue
            for i in ix:
                d, h = dp.buffers[pool][i], hp.buffers[pool][i]
                if direction == "d2h":
                    h[h_idx] = d.index_select(0, d_idx)
                else:
                    d.index_copy_(0, d_idx, h.index_select(0, h_idx))

    def _index_tensors(self, dev, host):
        """Both id tensors on the launch device, through one cached pinned buffer (no per-call
        pinned allocation, one small async upload on the copy stream)."""
        if not self.cuda:
            return dev, host
        import torch

        n = int(dev.numel())
        if self._ids_host is None or self._ids_host.shape[1] < n:
            if self._ids_event is not None:
                self._ids_event.synchronize()
            cap = max(1024, 1 << max(0, n - 1).bit_length())
            self._ids_host = torch.empty((2, cap), dtype=torch.int64, pin_memory=True)
            self._ids_dev = torch.empty((2, cap), dtype=torch.int64, device=self.device_pools.device)
        elif self._ids_event is not None:
            self._ids_event.synchronize()  # the previous upload has finished reading the buffer
        self._ids_host[0, :n].copy_(dev)
        self._ids_host[1, :n].copy_(host)
        # later uses of _ids_dev are ordered after earlier ones: all on self.stream, and the
        # staged path's side stream is joined back into it before a transfer ends
        self._ids_dev[:, :n].copy_(self._ids_host[:, :n], non_blocking=True)
        if self._ids_event is None:
            self._ids_event = torch.cuda.Event()
        self._ids_event.record()
        return self._ids_dev[0, :n], self._ids_dev[1, :n]

    def _table(self, side: str, pool: str, ix: tuple[int, ...]):
        """Cached int64 device tensor of the base addresses of buffers ``ix`` of one side."""
        import torch

        key = (side, pool, ix)
        t = self._tables.get(key)
        if t is None:
            bufs = (self.device_pools if side == "device" else self.host_pools).buffers[pool]
            t = torch.tensor([bufs[i].data_ptr() for i in ix], dtype=torch.int64).to(self.device_pools.device)
            self._tables[key] = t
        return t

    def _run_cuda(self, direction: str, plan: _Plan, dev, host, dev_t, host_t, staged: frozenset[str]) -> None:
        direct = _Plan(tuple(x for x in plan.pools if x[0] not in staged), plan.layers)
        via_dma = _Plan(tuple(x for x in plan.pools if x[0] in staged), plan.layers)
        if direct.pools:
            self._run_direct(direction, direct, dev_t, host_t)
        if via_dma.pools:
            self._run_staged(direction, via_dma, dev, host, dev_t, self.use_triton)

    def _run_direct(self, direction: str, plan: _Plan, dev_t, host_t) -> None:
        from .kernels import copy_pages, word_bytes

        dp, hp = self.device_pools, self.host_pools
        for pool, ix in plan.pools:
            pb = dp.page_bytes(pool)
            d_tab, h_tab = self._table("device", pool, ix), self._table("host", pool, ix)
            d_stride, h_stride = pb, hp.page_stride(pool)
            key = ("word", pool, ix)
            w = self._tables.get(key)
            if w is None:
                addrs = [dp.buffers[pool][i].data_ptr() for i in ix] + [hp.buffers[pool][i].data_ptr() for i in ix]
                w = self._tables[key] = word_bytes(pb, (d_stride, h_stride), addrs)
            if direction == "d2h":
                copy_pages(d_tab, h_tab, dev_t, host_t, pb, d_stride, h_stride, w, *self.kernel_config)
            else:
                copy_pages(h_tab, d_tab, host_t, dev_t, pb, h_stride, d_stride, w, *self.kernel_config)

    # -- staged path: device gather/scatter at HBM speed + few large copy-engine DMAs ---------------
    def _staging(self, nbytes: int):
        """The controller's staging buffer, at least ``nbytes``; kept between calls, grown on demand.

        Allocated on the copy stream and marked as used by the side stream, so the caching
        allocator reuses a replaced buffer only after both streams are done with it.
        """
        import torch

        buf = self._stage_buf
        if buf is None or buf.numel() < nbytes:
            self._stage_buf = None
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device_pools.device)
            if self.gather_stream is not None:
                buf.record_stream(self.gather_stream)
            self._stage_buf = buf
        return buf

    def _run_staged(self, direction: str, plan: _Plan, dev, host, dev_t, triton_gather: bool) -> None:
        """Gather on the device into staging, one copy-engine DMA per contiguous host run, pipelined.

        The transfer is cut into units of at most ``STAGING_CHUNK_BYTES``: (one layer buffer,
        a page range) for layer_first, (a page range of every buffer) for page_first with all
        buffers (a run of n host pages is then ONE block of n x layers x page bytes).  Units are
        grouped into batches of 1, 2, 4, ... units, each moved to/from staging by ONE device
        launch: the first DMA starts after a tiny gather, later gathers hide behind DMAs, and
        the CPU issues few launches and events.  Backups gather on the side stream and DMA on
        the copy stream; loads DMA first and scatter on the side stream.  A transfer larger than
        ``STAGING_MAX_BYTES`` runs in rounds that reuse the staging buffer once the previous
        round's DMAs (scatters) are done.
        """
        import bisect
        import contextlib

        import numpy as np
        import torch

        dp, hp = self.device_pools, self.host_pools
        n = int(dev.numel())
        total = plan.nbytes(dp, n)
        chunk = max(STAGING_CHUNK_MIN_BYTES, min(STAGING_CHUNK_BYTES, total // max(1, STAGING_CHUNKS)))
        batches = []  # (pool, ix, kind, j0, j1, a, b, units): kind full|layers|unit
        for pool, ix in plan.pools:
            pb = dp.page_bytes(pool)
            full = hp.layout == "page_first" and len(ix) == len(hp.buffers[pool])
            row = pb * (len(ix) if full else 1)
            step = max(1, chunk // row)
            if full:
                units = [(a, min(n, a + step)) for a in range(0, n, step)]
                for u0, u1 in _doubling(len(units)):
                    batches.append((pool, ix, "full", 0, len(ix), units[u0][0], units[u1 - 1][1],
                                    [(None, a, b) for a, b in units[u0:u1]]))
            elif step >= n:  # whole layers per unit: a batch is a range of layers
                for j0, j1 in _doubling(len(ix)):
                    batches.append((pool, ix, "layers", j0, j1, 0, n, [(j, 0, n) for j in range(j0, j1)]))
            else:
                for j in range(len(ix)):
                    for a in range(0, n, step):
                        b = min(n, a + step)
                        batches.append((pool, ix, "unit", j, j + 1, a, b, [(j, a, b)]))
        sizes = [-(-self._batch_bytes(bt) // 256) * 256 for bt in batches]
        staging = self._staging(max(max(sizes), min(sum(sizes), STAGING_MAX_BYTES)))
        h = host.numpy()
        breaks = (np.flatnonzero(np.diff(h) != 1) + 1).tolist()
        run_starts, run_ends = [0, *breaks], [*breaks, n]

        def pieces(a: int, b: int):
            r = bisect.bisect_right(run_starts, a) - 1
            out = []
            while r < len(run_starts) and run_starts[r] < b:
                p0, p1 = max(a, run_starts[r]), min(b, run_ends[r])
                out.append((p0 - a, int(h[p0]), p1 - p0))
                r += 1
            return out

        cuda = self.cuda
        main, side = self.stream, self.gather_stream
        side_ctx = (lambda: torch.cuda.stream(side)) if cuda else contextlib.nullcontext
        if cuda:
            side.wait_stream(main)
        pos = self._slot_ids(n, dev_t.device)
        offset = 0
        for bt, size in zip(batches, sizes, strict=True):
            if offset + size > staging.numel():  # next round: staging is reused
                offset = 0
                if cuda:
                    (side.wait_stream(main) if direction == "d2h" else main.wait_stream(side))
            region = staging[offset:offset + self._batch_bytes(bt)]  # exact; offsets 256-aligned
            offset += size
            if direction == "d2h":
                with side_ctx():
                    self._batch_move("gather", bt, dev_t, pos, region, triton_gather)
                    ready = _event(side)
                if ready is not None:
                    main.wait_event(ready)
                self._batch_dma("d2h", bt, region, pieces)
            else:
                self._batch_dma("h2d", bt, region, pieces)
                ready = _event(main)
                with side_ctx():
                    if ready is not None:
                        side.wait_event(ready)
                    self._batch_move("scatter", bt, dev_t, pos, region, triton_gather)
        if cuda:
            main.wait_stream(side)

    def _batch_bytes(self, bt) -> int:
        pool, ix, kind, j0, j1, a, b, _units = bt
        return self.device_pools.page_bytes(pool) * (j1 - j0) * (b - a)

    def _unit_view(self, bt, region, unit):
        """Staging view of one unit (rows of one layer, or page blocks of every layer)."""
        pool, ix, kind, j0, j1, a, b, _units = bt
        pb = self.device_pools.page_bytes(pool)
        j, ua, ub = unit
        if kind == "full":
            return region.view(b - a, len(ix), pb)[ua - a:ub - a]
        return region.view(j1 - j0, b - a, pb)[j - j0, ua - a:ub - a]

    def _batch_dma(self, direction: str, bt, region, pieces) -> None:
        """One ``copy_`` per contiguous host run of each unit of the batch (copy engine)."""
        pool, ix, kind, _j0, _j1, _a, _b, units = bt
        hp = self.host_pools
        for unit in units:
            j, ua, ub = unit
            view = self._unit_view(bt, region, unit)
            host_t = hp.pool_tensors[pool] if kind == "full" else hp.buffers[pool][ix[j]]
            for k0, h0, length in pieces(ua, ub):
                host_part, stage_part = host_t[h0:h0 + length], view[k0:k0 + length]
                if direction == "d2h":
                    host_part.copy_(stage_part, non_blocking=True)
                else:
                    stage_part.copy_(host_part, non_blocking=True)

    def _batch_move(self, op: str, bt, dev_t, pos, region, use_triton: bool) -> None:
        """Device pages <-> staging for a whole batch at HBM speed (``op`` = gather or scatter)."""
        dp = self.device_pools
        pool, ix, kind, j0, j1, a, b, units = bt
        pb = dp.page_bytes(pool)
        if use_triton:
            from .kernels import copy_pages, word_bytes

            sub = ix[j0:j1]
            if kind == "full":
                tab = self._stage_table(region.data_ptr(), pb, len(ix), region.device)
                s_stride = len(ix) * pb
            else:
                tab = self._stage_table(region.data_ptr(), (b - a) * pb, j1 - j0, region.device)
                s_stride = pb
            key = ("word", pool, sub, s_stride, region.data_ptr() % 16)
            w = self._tables.get(key)
            if w is None:
                w = self._tables[key] = word_bytes(
                    pb, (pb, s_stride), [region.data_ptr()] + [dp.buffers[pool][i].data_ptr() for i in sub])
            d_tab, ids, slots = self._table("device", pool, sub), dev_t[a:b], pos[:b - a]
            if op == "gather":
                copy_pages(d_tab, tab, ids, slots, pb, pb, s_stride, w)
            else:
                copy_pages(tab, d_tab, slots, ids, pb, s_stride, pb, w)
            return
        for unit in units:  # torch fallback: one index op per layer and unit
            j, ua, ub = unit
            view = self._unit_view(bt, region, unit)
            ids = dev_t[ua:ub]
            for k, i in ((jj, ix[jj]) for jj in range(len(ix))) if kind == "full" else ((None, ix[j]),):
                target = view[:, k] if k is not None else view
                if op == "gather":
                    target.copy_(dp.buffers[pool][i].index_select(0, ids))
                else:
                    dp.buffers[pool][i].index_copy_(0, ids, target)

    def _stage_table(self, base: int, stride: int, count: int, device):
        """Cached device tensor ``base + stride * arange(count)`` (staging addresses per layer)."""
        import torch

        key = ("stage", base, stride, count)
        t = self._tables.get(key)
        if t is None:
            if len(self._tables) > 512:  # staging moved or shapes churned: drop stale entries
                self._tables = {k: v for k, v in self._tables.items() if k[0] != "stage"}
            t = torch.arange(count, dtype=torch.int64, device=device) * stride + base
            self._tables[key] = t
        return t

    def _slot_ids(self, n: int, device):
        """Cached ``arange`` on the device (staging positions for the page_first gather kernel)."""
        import torch

        t = self._arange
        if t is None or t.numel() < n or t.device != device:
            t = self._arange = torch.arange(max(n, 1024), dtype=torch.int64, device=device)
        return t


def _doubling(count: int) -> list[tuple[int, int]]:
    """``[0, count)`` cut into ranges of 1, 2, 4, ... items (the last one possibly shorter)."""
    out, start, size = [], 0, 1
    while start < count:
        out.append((start, min(count, start + size)))
        start, size = start + size, size * 2
    return out


def _event(stream):
    """A CUDA event recorded on ``stream`` now (None on CPU, where everything is synchronous)."""
    if stream is None:
        return None
    import torch

    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _ids(values, what: str, stage: int):
    """Page ids (list, tuple, range, tensor, array) -> 1-D CPU int64 tensor; non-integers refused."""
    import torch

    if isinstance(values, torch.Tensor):
        t = values.detach()
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TransferError(f"stage {stage}: {what} ids must be integers, got a {t.dtype} tensor")
        return t.reshape(-1).to("cpu", torch.int64)
    import numpy as np

    if isinstance(values, range):
        return torch.arange(values.start, values.stop, values.step, dtype=torch.int64)
    if not isinstance(values, (np.ndarray, list, tuple)):
        values = list(values)
    arr = np.asarray(values)
    if arr.size == 0:
        return torch.empty(0, dtype=torch.int64)
    if arr.dtype.kind not in "iu":  # floats, bools, strings, objects (mixed types)
        items = values.reshape(-1).tolist() if isinstance(values, np.ndarray) else values
        bad = next((v for v in items if type(v) is not int), items[0])
        raise TransferError(f"stage {stage}: {what} ids must be integers, got {bad!r}")
    return torch.from_numpy(arr.astype(np.int64, copy=False).reshape(-1))


def _runs(ids) -> list[tuple[int, int, int]]:
    """Contiguous runs of ``ids`` (1-D int64 tensor) as (position in list, first id, length)."""
    import torch

    n = int(ids.numel())
    if n == 0:
        return []
    breaks = ((ids[1:] - ids[:-1]) != 1).nonzero().flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([n])])
    return list(zip(starts.tolist(), ids[starts].tolist(), (ends - starts).tolist(), strict=True))
