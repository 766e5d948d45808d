"""Hook sglang's DeepSeek-V4 HiCache start-up: validate each stage's pool, count its transfers.

``install()`` patches the two sglang calls where a stage's pool and transfers
appear at server start-up: the HiCache stack build (validate + publish the
report) and the cache controller's transfer submissions (bytes, seconds,
host-hit tokens), feeding a ``SglangSource`` that stagecache's exporters and
dashboard read.  ``sglang_plugin`` is the ``sglang.srt.plugins`` entry point that
installs it in every scheduler process when ``STAGECACHE_SGLANG=1``.

Names used from sglang 0.5.23, verified in its source:
``sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.build_deepseek_v4_hicache_stack``
and the controller methods ``start_writing`` / ``start_loading`` with their ``HiCacheAck`` acks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from stagecache.runtime.live.numbers import PoolBytes, StageLive

from ...errors import ConfigError, MappingError, StageMappingInvalid
from ...validation.report import StageReport, StartupReport
from .reader import inspect_pool, model_num_layers, pp_rank_of, read_pool


class SglangSource:
    """A ``SnapshotSource`` fed by the sglang hooks of ``attach()`` (thread-safe).

    One per process: with PP each rank's scheduler process reports its own stage.
    ``cache_tokens.host`` counts tokens loaded host->device (a HiCache host hit is
    served by such a load); sglang does not expose looked-up totals at this point,
    so ``host_hit_ratio`` stays 0.0 and ``cache_tokens.device``/``miss`` stay 0.
    """

    def __init__(self, model_name: str = "sglang"):
        self.model_name = model_name
        self._lock = threading.Lock()
        self._reports: dict[int, StageReport] = {}
        self._meta: dict[str, Any] = {}
        self._cross: list[MappingError] = []
        self._live: dict[int, StageLive] = {}

    # -- feeding ---------------------------------------------------------------------------
    def publish(self, report: StartupReport, pool_bytes: dict[int, dict[str, int]] | None = None) -> None:
        with self._lock:
            self._meta = {
                "model": report.model, "num_layers": report.num_layers, "pp_size": report.pp_size,
                "tp_size": report.tp_size, "page_size": report.page_size,
            }
            for s in report.stages:
                stage = s.stage_map.stage
                self._reports[stage] = s
                live = self._stage(stage)
                for pool, nbytes in (pool_bytes or {}).get(stage, {}).items():
                    live.pool_bytes[pool] = PoolBytes(device=nbytes)
            self._cross = [e for e in self._cross if e not in report.cross_errors] + list(report.cross_errors)

    def record_transfer(self, stage: int, direction: str, num_bytes: int, seconds: float, tokens: int) -> None:
        """One HiCache transfer: ``direction`` is ``d2h`` (write/backup) or ``h2d`` (load)."""
        if direction not in ("d2h", "h2d"):
            raise ConfigError(f"transfer direction must be 'd2h' or 'h2d', got {direction!r}")
        with self._lock:
            live = self._stage(stage)
            live.time = time.time()
            nbytes = getattr(live.transfer_bytes, direction) + int(num_bytes)
            secs = getattr(live.transfer_seconds, direction) + float(seconds)
            setattr(live.transfer_bytes, direction, nbytes)
            setattr(live.transfer_seconds, direction, secs)
            setattr(live.transfer_count, direction, getattr(live.transfer_count, direction) + 1)
            setattr(live.bandwidth_bytes_per_second, direction, nbytes / secs if secs > 0 else 0.0)
            if direction == "h2d":
                live.cache_tokens.host += int(tokens)

    def _stage(self, stage: int) -> StageLive:
        """The stage's live numbers, created on first use (caller holds the lock)."""
        if stage not in self._live:
            self._live[stage] = StageLive(stage=stage, model_name=self.model_name)
        return self._live[stage]

    # -- SnapshotSource --------------------------------------------------------------------
    def startup(self) -> dict[str, Any] | None:
        with self._lock:
            if not self._reports:
                return None
            stages = tuple(self._reports[k] for k in sorted(self._reports))
            report = StartupReport(stages=stages, cross_errors=tuple(self._cross), **self._meta)
        return report.to_dict()

    def stages(self) -> dict[int, StageLive]:
        with self._lock:
            return {k: v.model_copy(deep=True) for k, v in self._live.items()}


def _ack_seconds(ack: Any) -> float | None:
    """Wait for a ``HiCacheAck``'s copy; its device-measured time when the events record one."""
    try:
        ack.finish_event.synchronize()
        if getattr(ack, "timing_enabled", False):
            return float(ack.start_event.elapsed_time(ack.finish_event)) / 1000.0
    except (AttributeError, RuntimeError):
        return None
    return None


def wrap_controller(controller: Any, source: SglangSource, stage: int, sync: bool = False) -> Callable[[], None]:
    """Count the bytes/seconds of the controller's ``start_writing``/``start_loading``.

    Each call that submits a transfer appends one ``HiCacheAck`` (``num_bytes``,
    ``num_tokens``) to ``ack_write_queue``/``ack_load_queue``; we read that ack.
    Seconds are the submission's wall time, or -- with ``sync=True`` -- the copy
    itself (waits on the ack's CUDA event, which serialises transfers: debugging only).
    Returns a function that restores the original methods.
    """
    patched = []
    for method, queue_name, direction in (
        ("start_writing", "ack_write_queue", "d2h"),
        ("start_loading", "ack_load_queue", "h2d"),
    ):
        original = getattr(controller, method)

        def wrapped(*a, _orig=original, _q=queue_name, _d=direction, **k):
            queue = getattr(controller, _q)
            before = len(queue)
            t0 = time.perf_counter()
            result = _orig(*a, **k)
            acks = list(queue)[before:]
            measured = [_ack_seconds(ack) for ack in acks] if sync else [None] * len(acks)
            elapsed = time.perf_counter() - t0  # after the waits when sync
            for ack, secs in zip(acks, measured, strict=True):
                source.record_transfer(
                    stage, _d, int(getattr(ack, "num_bytes", 0)),
                    secs if secs is not None else elapsed / len(acks),
                    int(getattr(ack, "num_tokens", 0)),
                )
            return result

        functools.update_wrapper(wrapped, original)
        setattr(controller, method, wrapped)
        patched.append(method)

    def restore() -> None:
        for method in patched:
            controller.__dict__.pop(method, None)

    return restore


class Attachment:
    """An installed start-up hook: its ``source``, and ``detach()`` to undo every patch."""

    def __init__(self, source: SglangSource, original: Callable[..., Any]):
        self.source = source
        self.dashboard_url: str | None = None
        self._original = original
        self._restorers: list[Callable[[], None]] = []
        self._dashboard: contextlib.ExitStack | None = None
        self._lock = threading.Lock()

    def _start_dashboard(self, host: str, port: int) -> None:
        with self._lock:
            if self._dashboard is not None:
                return
            from stagecache.dashboard.server import (
                dashboard_in_thread,  # heavy: only when asked for
            )

            stack = contextlib.ExitStack()
            self.dashboard_url = stack.enter_context(
                dashboard_in_thread(self.source, host, port, title=f"stagecache: {self.source.model_name}")
            )
            self._dashboard = stack

    def detach(self) -> None:
        """Restore sglang's function and the wrapped controllers; stop the dashboard."""
        if hybrid_pool_assembler.build_deepseek_v4_hicache_stack is not self._original:
            hybrid_pool_assembler.build_deepseek_v4_hicache_stack = self._original
        for restore in self._restorers:
            restore()
        self._restorers.clear()
        if self._dashboard is not None:
            self._dashboard.close()
            self._dashboard = None


def _parallel_from_sglang() -> tuple[int, int | None, int]:
    """``(pp_size, pp_rank, tp_size)`` of this scheduler process, from sglang's runtime context."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    try:
        pp_size = int(parallel.pp_size)
    except Exception as exc:
        raise ConfigError(
            f"pp_size not given and sglang's runtime context has none ({exc}); pass pp_size=..."
        ) from None
    try:
        pp_rank: int | None = int(parallel.pp_rank)
    except Exception:
        pp_rank = None  # inferred from the pool's layer range
    try:
        tp_size = int(parallel.tp_size)
    except Exception:
        tp_size = 1
    return pp_size, pp_rank, tp_size


def _check_stage(kvcache: Any, pp_size: int | None, pp_rank: int | None, tp_size: int,
                 model_name: str, num_layers: int | None) -> tuple[int, StartupReport, dict[str, int]]:
    """Validate the pool one ``build_deepseek_v4_hicache_stack`` call got: rank, report, bytes."""
    if kvcache is None:
        raise ConfigError("build_deepseek_v4_hicache_stack called without kvcache=")
    size, rank, tp = pp_size, pp_rank, tp_size
    if size is None:  # a plugin in a scheduler process: sglang knows the topology
        size, live_rank, tp = _parallel_from_sglang()
        rank = rank if rank is not None else live_rank
    n = model_num_layers([kvcache], size, num_layers)
    rank = rank if rank is not None else pp_rank_of(kvcache, size, n)
    if rank is None:
        raise ConfigError(
            f"kvcache layers [{kvcache.start_layer}, {kvcache.end_layer}) match no rank of "
            f"get_pp_indices for pp_size={size}; pass pp_rank=..."
        )
    report = inspect_pool(kvcache, pp_size=size, pp_rank=rank, tp_size=tp, model_name=model_name,
                          num_layers=n)
    return rank, report, read_pool(kvcache, rank, n, model_name).pool_bytes


def install(
    *,
    pp_size: int | None = None,
    pp_rank: int | None = None,
    tp_size: int = 1,
    source: SglangSource | None = None,
    strict: bool = True,
    sync_transfers: bool = False,
    model_name: str = "sglang",
    dashboard_port: int | None = None,
    dashboard_host: str = "127.0.0.1",
    num_layers: int | None = None,
) -> Attachment:
    """Hook sglang's DeepSeek-V4 HiCache stack build in this process until ``detach()``.

    Every ``build_deepseek_v4_hicache_stack(kvcache=..., ...)`` (sglang's
    ``_DeepSeekV4Strategy`` calls it through the module, so the hook sees it) first
    validates the pool and publishes the report; with ``strict`` an invalid stage raises
    ``StageMappingInvalid`` listing every error (stage, pool, expected vs got) instead of
    sglang's first ``ValueError``.  The controller it returns is wrapped to count
    transfers.  With ``dashboard_port`` the stage's dashboard (and ``/metrics``) is
    served on ``dashboard_port + pp_rank`` once the report exists.  ``pp_size=None``
    reads ``pp_size``/``pp_rank``/``tp_size`` from sglang's runtime context at build time;
    ``num_layers=None`` takes the model's layer count as ``reader.model_num_layers`` does.

    The hook must run in the scheduler processes, which sglang *spawns*: use the
    ``sglang.srt.plugins`` entry point (``sglang_plugin``), or call this at the top level
    of a launcher script (a spawned process re-runs it).  See docs/sglang.md.
    """
    src = source or SglangSource(model_name)
    original = hybrid_pool_assembler.build_deepseek_v4_hicache_stack
    att = Attachment(src, original)

    @functools.wraps(original)
    def build(*args: Any, **kwargs: Any):
        rank, report, nbytes = _check_stage(kwargs.get("kvcache"), pp_size, pp_rank, tp_size,
                                            model_name, num_layers)
        src.publish(report, {rank: nbytes})
        if dashboard_port is not None:
            att._start_dashboard(dashboard_host, dashboard_port + rank)
        if strict and not report.ok:
            raise StageMappingInvalid(report.all_errors)
        host_pool_group, controller = original(*args, **kwargs)
        att._restorers.append(wrap_controller(controller, src, rank, sync_transfers))
        return host_pool_group, controller

    hybrid_pool_assembler.build_deepseek_v4_hicache_stack = build
    return att


@contextlib.contextmanager
def attach(**kwargs: Any) -> Iterator[SglangSource]:
    """``install(**kwargs)`` for the duration of a ``with`` block; yields the source."""
    att = install(**kwargs)
    try:
        yield att.source
    finally:
        att.detach()


#: Environment of the sglang plugin (sglang gives plugins no arguments).
PLUGIN_ENV = {
    "STAGECACHE_SGLANG": "1 to install the hook in every sglang process (default: off)",
    "STAGECACHE_SGLANG_STRICT": "0 to let sglang build an invalid stage anyway (default 1)",
    "STAGECACHE_SGLANG_DASHBOARD_PORT": "serve each stage's dashboard on PORT + pp_rank",
    "STAGECACHE_SGLANG_SYNC_TRANSFERS": "1 to time transfers by their CUDA events (slow)",
}

_PLUGIN: Attachment | None = None


def sglang_plugin() -> Attachment | None:
    """Entry point ``sglang.srt.plugins: stagecache``; sglang runs it in every process
    (``run_scheduler_process`` calls ``load_plugins()`` first).  Off unless
    ``STAGECACHE_SGLANG=1``, so installing stagecache never changes sglang silently."""
    global _PLUGIN
    if os.environ.get("STAGECACHE_SGLANG", "0") != "1" or _PLUGIN is not None:
        return _PLUGIN
    port_text = os.environ.get("STAGECACHE_SGLANG_DASHBOARD_PORT")
    try:
        port = int(port_text) if port_text else None
    except ValueError:
        raise ConfigError(
            f"STAGECACHE_SGLANG_DASHBOARD_PORT must be an integer port, got {port_text!r}"
        ) from None
    _PLUGIN = install(
        strict=os.environ.get("STAGECACHE_SGLANG_STRICT", "1") != "0",
        sync_transfers=os.environ.get("STAGECACHE_SGLANG_SYNC_TRANSFERS", "0") == "1",
        dashboard_port=port,
    )
    return _PLUGIN
