"""Hook sglang's DeepSeek-V4 HiCache start-up: validate each stage's pool, count its transfers.

``install()`` patches the two sglang calls where a stage's pool and transfers
appear at server start-up: the HiCache stack build (validate + publish the
report) and the cache controller's transfer submissions (bytes, seconds,
host-hit tokens), feeding a ``SglangSource`` that stagecache's exporters and
dashboard read -- one process's view, for an embedded engine or a test.  A served
deployment uses ``deployment.Deployment`` (the ``sglang_plugin`` entry point), which
reuses ``SglangSource`` and ``wrap_controller`` from here.

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
from stagecache.runtime.live.numbers import PageSpace, PoolBytes, RunInfo, StageLive

from ...errors import ConfigError, MappingError, StageMappingInvalid
from ...validation.report import StageReport, StartupReport
from .reader import inspect_pool, model_num_layers, pp_rank_of, read_pool

#: Hot counters per stage: d2h bytes, seconds, count; h2d bytes, seconds, count; device-hit,
#: host-hit and missed tokens; time of the last update.
_HOT = 10


class SglangSource:
    """A ``SnapshotSource`` fed by the sglang hooks of ``attach()`` (thread-safe).

    One per process: with PP each rank's scheduler process reports its own stage.
    With ``install()`` (one process, no exchange) ``cache_tokens.host`` counts tokens
    loaded host->device.  In a deployment (``deployment.Deployment``) the cache tokens
    come from sglang's own prefix matches instead (``record_lookup``), rank 0's source
    holds every stage (``publish_deployment``, ``put_remote``) and ``run()`` makes a stage
    that stopped pushing for ``push_timeout_s`` not ready.
    """

    def __init__(self, model_name: str = "sglang", push_timeout_s: float | None = None):
        self.model_name = model_name
        self._lock = threading.Lock()
        self._reports: dict[int, StageReport] = {}
        self._meta: dict[str, Any] = {}
        self._cross: list[MappingError] = []
        self._live: dict[int, StageLive] = {}
        #: per stage, counters the hooks bump (see ``_HOT``); folded into ``_live`` on read
        self._hot: dict[int, list[float]] = {}
        #: the deployment's endpoint (rank 0): every stage must push within this many seconds
        self._push_timeout_s = push_timeout_s
        self._own: int | None = None  # the stage of this process, once the deployment is known
        self._pp_size = 0
        self.on_read: Callable[[], None] | None = None
        #: without match results (``install()``), tokens loaded host->device stand for host hits
        self.count_loads_as_hits = True

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
        """One HiCache transfer: ``direction`` is ``d2h`` (write/backup) or ``h2d`` (load).

        On sglang's scheduler thread: plain counters under the lock, folded into the stage's
        ``StageLive`` only when someone reads it (``_fold``), so a transfer costs microseconds."""
        if direction not in ("d2h", "h2d"):
            raise ConfigError(f"transfer direction must be 'd2h' or 'h2d', got {direction!r}")
        self.add_transfer(stage, 0 if direction == "d2h" else 3, num_bytes, seconds, tokens)

    def add_transfer(self, stage: int, base: int, num_bytes: int, seconds: float, tokens: int) -> None:
        """``record_transfer`` with the direction as its counter offset (0 d2h, 3 h2d), unchecked:
        the controller hook's path."""
        with self._lock:
            c = self._hot.get(stage) or self._hot.setdefault(stage, [0.0] * _HOT)
            c[base] += num_bytes
            c[base + 1] += seconds
            c[base + 2] += 1
            if base == 3 and self.count_loads_as_hits:  # a deployment counts sglang's matches
                c[7] += tokens
            c[9] = time.time()

    def publish_deployment(self, report: StartupReport, lives: dict[int, StageLive], own: int) -> None:
        """The whole deployment's report (every stage) and the stages' start-up numbers."""
        with self._lock:
            self._meta = {
                "model": report.model, "num_layers": report.num_layers, "pp_size": report.pp_size,
                "tp_size": report.tp_size, "page_size": report.page_size,
            }
            self._reports = {s.stage_map.stage: s for s in report.stages}
            self._cross = list(report.cross_errors)
            self._own, self._pp_size = own, report.pp_size
            for stage, live in lives.items():
                mine = self._stage(stage)
                for name in ("start_layer", "end_layer", "local_layers", "pool_bytes", "capacity",
                             "page_spaces"):
                    setattr(mine, name, getattr(live, name))
                mine.phase = "serving" if report.ok else "refused"

    def put_remote(self, stage: int, live: StageLive) -> None:
        """Another rank's numbers, pushed to this (rank 0's) endpoint."""
        with self._lock:
            live.model_name = live.model_name or self.model_name
            self._live[stage] = live

    def record_lookup(self, stage: int, device: int, host: int, miss: int) -> None:
        """Tokens of one sglang prefix match (``match_prefix``; see ``deployment``)."""
        with self._lock:
            c = self._hot.get(stage) or self._hot.setdefault(stage, [0.0] * _HOT)
            c[6] += device
            c[7] += host
            c[8] += miss
            c[9] = time.time()

    def _fold(self, stage: int, live: StageLive) -> StageLive:
        """``live`` (a copy) with the stage's hot counters in it (caller holds the lock)."""
        c = self._hot.get(stage)
        if c is None:
            return live
        for base, d in ((0, "d2h"), (3, "h2d")):
            nbytes, secs, count = int(c[base]), c[base + 1], int(c[base + 2])
            setattr(live.transfer_bytes, d, nbytes)
            setattr(live.transfer_seconds, d, secs)
            setattr(live.transfer_count, d, count)
            setattr(live.bandwidth_bytes_per_second, d, nbytes / secs if secs > 0 else 0.0)
        tokens = live.cache_tokens
        tokens.device, tokens.host, tokens.miss = int(c[6]), int(c[7]), int(c[8])
        looked = tokens.device + tokens.host + tokens.miss
        live.host_hit_ratio = tokens.host / looked if looked > 0 else 0.0
        live.time = max(live.time, c[9])
        return live

    def set_host_used(self, stage: int, used: int, total: int) -> None:
        """Host tokens in use of the full-KV host pool (sglang's ``logical_size - available_size()``;
        ``page_spaces["host"]`` counts tokens here, as sglang's ``hicache_host_used_tokens``)."""
        with self._lock:
            spaces = self._stage(stage).page_spaces
            if "host" not in spaces:
                spaces["host"] = PageSpace(tier="host", pools=["full"])
            spaces["host"].used, spaces["host"].total = used, total

    def snapshot(self, stage: int) -> StageLive:
        """A copy of one stage's numbers, stamped now (what a rank pushes)."""
        with self._lock:
            live = self._fold(stage, self._stage(stage).model_copy(deep=True))
        live.time = live.heartbeat_at = time.time()
        live.pid = os.getpid()
        return live

    def run(self) -> RunInfo | None:
        """The deployment as ``liveness.assess`` reads it: every stage must report (rank 0 only)."""
        with self._lock:
            if self._push_timeout_s is None or self._own is None:
                return None
            phase = "serving" if all(r.ok for r in self._reports.values()) and not self._cross else "refused"
            return RunInfo(phase=phase, pp_size=self._pp_size, model=self.model_name,
                           heartbeat_timeout_s=self._push_timeout_s, started_at=0.0, time=time.time())

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
        if self.on_read is not None:  # the deployment refreshes what it reads on demand (host use)
            self.on_read()
        now = time.time()
        with self._lock:
            for k in self._hot:
                self._stage(k)
            out = {k: self._fold(k, v.model_copy(deep=True)) for k, v in self._live.items()}
        if self._own is not None and self._own in out:  # this process answers: its stage is alive
            out[self._own].heartbeat_at = now
            out[self._own].pid = os.getpid()
        return out


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

        def wrapped(*a, _orig=original, _q=queue_name, _base=0 if direction == "d2h" else 3, **k):
            # on sglang's scheduler thread at every call, most of which queue nothing: kept lean
            queue = getattr(controller, _q)
            before = len(queue)
            t0 = time.perf_counter()
            result = _orig(*a, **k)
            queued = len(queue) - before
            if queued > 0:
                acks = queue[before:]  # only the acks this call queued
                measured = [_ack_seconds(ack) for ack in acks] if sync else None
                share = (time.perf_counter() - t0) / queued  # after the waits when sync
                for i, ack in enumerate(acks):
                    secs = measured[i] if measured is not None and measured[i] is not None else share
                    source.add_transfer(stage, _base, ack.num_bytes, secs, ack.num_tokens)
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
