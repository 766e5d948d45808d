"""Device <-> host page transfers for one stage: backup (d2h), load (h2d), layer by layer.

One controller per stage, over that stage's ``StagePools`` and ``HostPools``.
Page ids are checked at the boundary (same length, in range, no duplicate
destination), then the same pages of every selected buffer move together.

Paths (``TransferResult.path`` and the stats say which ran):

* ``cpu-index``     -- device pools on CPU: ``index_select``/``index_put_``; same API, used by
  tests and CPU demos.
* ``triton-direct`` -- CUDA: one Triton launch per pool kind reads/writes the pinned host pages
  in place (zero-copy through unified addressing).  The ``auto`` choice: fastest measured.
* ``triton-staged`` -- CUDA, ``mode="staged"``: Triton gathers the device pages into a staging
  buffer on a second stream, pipelined with one DMA per contiguous run of host pages and buffer
  (scatter in reverse for loads).  Needs long host runs to be competitive.
* ``triton-mixed``  -- staged where a DMA can do it, direct for strided page_first subsets.
* ``torch-staged``  -- CUDA without Triton: ``index_select`` gather + DMA runs.

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

from .errors import StageCacheError
from .host_pool import HostPools
from .layer_map import POOLS
from .pools import StagePools
from .transfer_stats import TransferStats

#: ``auto`` = ``direct`` with pinned host pools: on the H200 the direct kernel matched or beat
#: the pipelined staged path for every pool kind, page pattern and layout (docs/bench-transfer.md),
#: and it needs no staging memory.  ``staged`` stays selectable (and is what pageable host
#: memory or a CUDA build without Triton gets).
MODES = ("auto", "direct", "staged")

#: The staged path cuts a transfer into about this many chunks (each at least
#: ``STAGING_CHUNK_MIN_BYTES``) so gather and DMA of neighbouring chunks overlap.
STAGING_CHUNKS = 8
STAGING_CHUNK_MIN_BYTES = 4 << 20


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
            if host_pools.stage_map != device_pools.stage_map or host_pools.plan != {
                p: tuple(b is not None for b in bufs) for p, bufs in device_pools.buffers.items()
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
            unknown = [k for k in kinds if k not in POOLS]
            if unknown:
                raise TransferError(f"stage {m.stage}: unknown pool kind(s) {unknown}; pools are {', '.join(POOLS)}")
        selected = [p for p in POOLS if kinds is None or p in kinds]
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
    def _choose(self, plan: _Plan, host: list[int]) -> tuple[str, frozenset[str]]:
        """Path name and the pool kinds that go through staging + DMA (the rest: direct kernel).

        ``auto`` decides per pool kind: big pages in long host runs make few large
        DMAs (staged); small pages or scattered host pages would make many tiny
        DMAs, so the direct kernel writes them in place.
        """
        kinds = [p for p, _ in plan.pools]
        if not self.use_triton:
            return ("torch-staged" if self.cuda else "cpu-index"), frozenset(kinds)
        hp = self.host_pools
        if self.cuda and not hp.pinned:  # pageable host memory: the kernel cannot reach it, DMA can
            return "torch-staged", frozenset(kinds)
        if self.mode in ("direct", "auto") or not host.numel():
            staged: frozenset[str] = frozenset()
        else:
            # page_first with only some buffers of a kind: host slices are strided, which a
            # DMA cannot do in one piece, so those always go direct.
            dma_ok = [p for p, ix in plan.pools if hp.layout == "layer_first" or len(ix) == len(hp.buffers[p])]
            staged = frozenset(dma_ok)
        if not staged:
            return "triton-direct", staged
        return ("triton-staged" if len(staged) == len(kinds) else "triton-mixed"), staged

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

    def _index_tensors(self, dev: list[int], host: list[int]):
        import torch

        both = torch.stack([dev, host])
        if self.cuda:
            both = both.pin_memory().to(self.device_pools.device, non_blocking=True)
        return both[0], both[1]

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

    def _run_cuda(self, direction: str, plan: _Plan, dev: list[int], host: list[int],
                  dev_t, host_t, staged: frozenset[str]) -> None:
        direct = _Plan(tuple(x for x in plan.pools if x[0] not in staged), plan.layers)
        via_dma = _Plan(tuple(x for x in plan.pools if x[0] in staged), plan.layers)
        if direct.pools:
            self._run_direct(direction, direct, dev_t, host_t)
        if via_dma.pools:
            self._run_staged(direction, via_dma, dev, host, dev_t, host_t, self.use_triton)

    def _run_direct(self, direction: str, plan: _Plan, dev_t, host_t) -> None:
        from .kernels import copy_pages, word_bytes

        dp, hp = self.device_pools, self.host_pools
        for pool, ix in plan.pools:
            pb = dp.page_bytes(pool)
            d_tab, h_tab = self._table("device", pool, ix), self._table("host", pool, ix)
            d_stride, h_stride = pb, hp.page_stride(pool)
            addrs = [dp.buffers[pool][i].data_ptr() for i in ix] + [hp.buffers[pool][i].data_ptr() for i in ix]
            w = word_bytes(pb, (d_stride, h_stride), addrs)
            if direction == "d2h":
                copy_pages(d_tab, h_tab, dev_t, host_t, pb, d_stride, h_stride, w, *self.kernel_config)
            else:
                copy_pages(h_tab, d_tab, host_t, dev_t, pb, h_stride, d_stride, w, *self.kernel_config)

    def _run_staged(self, direction: str, plan: _Plan, dev, host, dev_t, host_t, triton_gather: bool) -> None:
        """Gather/scatter on the device + one DMA per (buffer, contiguous host run), pipelined.

        Pages are cut into a few chunks: the gather of chunk k+1 runs on a second
        stream while the DMA engine copies chunk k, so the device-side gather
        hides behind PCIe instead of adding to it (the reverse for loads).
        """
        import contextlib

        import torch

        dp, hp = self.device_pools, self.host_pools
        n = int(dev.numel())
        side = self.gather_stream
        side_ctx = (lambda: torch.cuda.stream(side)) if side is not None else contextlib.nullcontext
        if side is not None:
            side.wait_stream(self.stream)
            dev_t.record_stream(side)
        whole_pf = hp.layout == "page_first"
        slots = _arange_like(dev_t, n)
        for pool, ix in plan.pools:
            pb = dp.page_bytes(pool)
            full = whole_pf and len(ix) == len(hp.buffers[pool])
            # staging: page_first + all buffers -> (n, L, pb) matches a host run as one block;
            # otherwise (L, n, pb): one block per buffer and run.
            shape = (n, len(ix), pb) if full else (len(ix), n, pb)
            staging = torch.empty(shape, dtype=torch.uint8, device=dp.device)
            if side is not None:
                staging.record_stream(side)
            per_pos = len(ix) * pb
            chunk = max(1, -(-max(STAGING_CHUNK_MIN_BYTES, n * per_pos // STAGING_CHUNKS) // per_pos))
            pieces = _chunk_runs(host, chunk)
            for c0 in range(0, n, chunk):
                c1 = min(n, c0 + chunk)
                if direction == "d2h":
                    with side_ctx():
                        self._gather(pool, ix, dev_t, slots, c0, c1, staging, full, triton_gather)
                    self._handoff(side, self.stream)
                for k0, h0, length in pieces.get(c0 // chunk, ()):
                    self._dma(direction, pool, ix, staging, full, k0, h0, length)
                if direction == "h2d":
                    self._handoff(self.stream, side)
                    with side_ctx():
                        self._scatter(pool, ix, dev_t, slots, c0, c1, staging, full, triton_gather)
        if side is not None:
            self.stream.wait_stream(side)

    @staticmethod
    def _handoff(producer, consumer) -> None:
        """``consumer`` waits for what ``producer`` has queued so far (no-op without CUDA)."""
        if producer is None or consumer is None:
            return
        import torch

        ev = torch.cuda.Event()
        ev.record(producer)
        consumer.wait_event(ev)

    def _dma(self, direction: str, pool: str, ix, staging, full: bool, k0: int, h0: int, length: int) -> None:
        hp = self.host_pools
        if full:
            pairs = [(hp.pool_tensors[pool][h0:h0 + length], staging[k0:k0 + length])]
        else:
            pairs = [(hp.buffers[pool][i][h0:h0 + length], staging[j, k0:k0 + length]) for j, i in enumerate(ix)]
        for host_part, stage_part in pairs:
            if direction == "d2h":
                host_part.copy_(stage_part, non_blocking=True)
            else:
                stage_part.copy_(host_part, non_blocking=True)

    def _staging_table(self, staging, full: bool, n_layers: int, pb: int):
        import torch

        base = staging.data_ptr()
        step = pb if full else staging.shape[1] * pb
        return torch.arange(n_layers, dtype=torch.int64, device=staging.device) * step + base

    def _gather(self, pool: str, ix, dev_t, slots, a: int, b: int, staging, full: bool, use_triton: bool) -> None:
        """Device pages ``dev_t[a:b]`` of buffers ``ix`` -> staging positions ``a..b-1``."""
        dev_ids = dev_t[a:b]
        dp = self.device_pools
        pb = dp.page_bytes(pool)
        if use_triton:
            from .kernels import copy_pages, word_bytes

            s_stride = len(ix) * pb if full else pb
            w = word_bytes(pb, (pb, s_stride), [staging.data_ptr()] + [dp.buffers[pool][i].data_ptr() for i in ix])
            copy_pages(self._table("device", pool, ix), self._staging_table(staging, full, len(ix), pb),
                       dev_ids, slots[a:b], pb, pb, s_stride, w)
            return
        for j, i in enumerate(ix):
            target = staging[a:b, j] if full else staging[j, a:b]
            target.copy_(dp.buffers[pool][i].index_select(0, dev_ids))

    def _scatter(self, pool: str, ix, dev_t, slots, a: int, b: int, staging, full: bool, use_triton: bool) -> None:
        """Staging positions ``a..b-1`` -> device pages ``dev_t[a:b]`` of buffers ``ix``."""
        dev_ids = dev_t[a:b]
        dp = self.device_pools
        pb = dp.page_bytes(pool)
        if use_triton:
            from .kernels import copy_pages, word_bytes

            s_stride = len(ix) * pb if full else pb
            w = word_bytes(pb, (pb, s_stride), [staging.data_ptr()] + [dp.buffers[pool][i].data_ptr() for i in ix])
            copy_pages(self._staging_table(staging, full, len(ix), pb), self._table("device", pool, ix),
                       slots[a:b], dev_ids, pb, s_stride, pb, w)
            return
        for j, i in enumerate(ix):
            source = staging[a:b, j] if full else staging[j, a:b]
            dp.buffers[pool][i].index_copy_(0, dev_ids, source)


def _chunk_runs(host, chunk: int) -> dict[int, list[tuple[int, int, int]]]:
    """Host runs cut at every ``chunk`` positions, grouped by chunk index."""
    out: dict[int, list[tuple[int, int, int]]] = {}
    for k0, h0, length in _runs(host):
        pos, end = k0, k0 + length
        while pos < end:
            stop = min(end, (pos // chunk + 1) * chunk)
            out.setdefault(pos // chunk, []).append((pos, h0 + pos - k0, stop - pos))
            pos = stop
    return out


def _arange_like(t, n: int):
    import torch

    return torch.arange(n, dtype=torch.int64, device=t.device)


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
