"""stagecache for a live sglang DeepSeek-V4 pool: inspect, validate, export.

sglang builds one ``DeepSeekV4TokenToKVPool`` per PP rank and hands it to the
HiCache assembler (``build_deepseek_v4_hicache_stack``).  The PP + HiCache bug
stagecache exists for lived exactly between those two: the pool and the host
stack disagreed about how many layers a stage owns.  This module reads the
*real* pool -- its ``start_layer``/``end_layer``, ``layer_mapping``, SWA /
C4 / C128 / indexer buffers and compress-state pools -- into stagecache's
``StageLayerMap`` + ``PoolInventory`` and runs the same validation as
``stagecache check``, so an operator sees every mapping error of the stage at
start-up instead of sglang's first ``ValueError``.

``attach()`` hooks the two sglang calls where this information appears at
server start-up: the HiCache stack build (validate + publish the report) and
the cache controller's transfer submissions (bytes, seconds, host-hit tokens),
feeding a ``SglangSource`` that stagecache's exporters and dashboard read.

Tested against sglang 0.5.23 (``pip install 'stagecache[sglang]'``).  Names
used from sglang, all verified in that version's source:
``sglang.srt.distributed.utils.get_pp_indices``,
``sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.build_deepseek_v4_hicache_stack``
/ ``_resolve_deepseek_v4_layer_mappings``, and the controller methods
``start_writing`` / ``start_loading`` with their ``HiCacheAck`` acks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

try:  # the integration is optional; the core package never imports sglang
    from sglang.srt.distributed.utils import get_pp_indices
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
except ImportError as exc:  # pragma: no cover - exercised in the no-sglang environment
    raise ImportError(
        "stagecache.runtime.integrations.sglang needs sglang: pip install 'stagecache[sglang]' "
        f"(import failed: {exc})"
    ) from exc

from stagecache.runtime.serve.live import PoolBytes, StageLive

from ...errors import ConfigError, MappingError, StageMappingInvalid
from ...model.layer_map import LayerEntry, ModelLayout, StageLayerMap, build_stage_map
from ...model.partition import parse_partition, partition_layers
from ...model.spec import SUPPORTED_RATIOS, ModelSpec
from ...validation.checks import PoolInventory, validate_stage, validate_tiling
from ...validation.report import StageReport, StartupReport, build_report

#: The sglang release this module was written and tested against.
SGLANG_TESTED_VERSION = "0.5.23"

#: The env var sglang's ``get_pp_indices`` reads for an explicit partition.
PARTITION_ENV = "SGLANG_PP_LAYER_PARTITION"


# ---------------------------------------------------------------------------------------------
# Reading a pool
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolView:
    """Everything stagecache reads from one live ``DeepSeekV4TokenToKVPool``, read once."""

    spec: ModelSpec
    stage_map: StageLayerMap
    inventory: PoolInventory
    pool_bytes: dict[str, int]  # device bytes per stagecache pool
    findings: tuple[MappingError, ...]  # problems the generic validation cannot see


def spec_from_pool(kvcache: Any, name: str = "sglang") -> ModelSpec:
    """The model spec a pool was built for; ratios sglang has but stagecache lacks are ConfigError."""
    ratios = tuple(int(r) for r in kvcache.compression_ratios)
    for i, r in enumerate(ratios):
        if r not in SUPPORTED_RATIOS:
            raise ConfigError(
                f"sglang pool: compression_ratios[{i}] = {r} is not supported by stagecache "
                f"(supported: {', '.join(map(str, SUPPORTED_RATIOS))}); DeepSeek-V4.1 low ratios "
                "1/2 are not modelled"
            )
    return ModelSpec(
        name=name,
        num_layers=len(ratios),
        compress_ratios=ratios,
        sliding_window=int(kvcache.sliding_window),
        head_dim=int(kvcache.qk_nope_head_dim) + int(kvcache.qk_rope_head_dim),
        qk_rope_head_dim=int(kvcache.qk_rope_head_dim),
        index_head_dim=int(kvcache.indexer_head_dim),
    )


def stage_map_from_pool(kvcache: Any, stage: int) -> tuple[StageLayerMap, list[MappingError]]:
    """The stage map the pool *really* uses (from its ``layer_mapping``), plus holes found.

    ``c4_state_id`` is the position among the stage's C4 layers -- what sglang's
    assembler uses (``_resolve_deepseek_v4_layer_mappings``: ``c4_state``).
    """
    start, end = int(kvcache.start_layer), int(kvcache.end_layer)
    ratios = list(kvcache.compression_ratios)
    mapping = list(kvcache.layer_mapping)
    errors: list[MappingError] = []
    entries = []
    c4_seen = 0
    for local, global_id in enumerate(range(start, end)):
        item = mapping[global_id] if global_id < len(mapping) else None
        if item is None:
            errors.append(MappingError(
                stage, "layer_map", f"a layer_mapping item for global layer {global_id}", None,
                f"layer_mapping[{global_id}] is None although the stage owns layers "
                f"[{start}, {end})",
            ))
            ratio, cid = ratios[global_id], None
        else:
            ratio, cid = int(item.compress_ratio), int(item.compress_layer_id)
            if ratio != ratios[global_id]:
                errors.append(MappingError(
                    stage, "layer_map", ratios[global_id], ratio,
                    f"layer_mapping[{global_id}].compress_ratio disagrees with "
                    f"compression_ratios[{global_id}]",
                ))
        c4_state_id = None
        if ratio == 4:
            c4_state_id = c4_seen
            c4_seen += 1
        entries.append(LayerEntry(
            local, global_id, ratio, cid if ratio in (4, 128) else None, c4_state_id,
        ))
    return StageLayerMap(stage, start, end, tuple(entries), model_num_layers=len(ratios)), errors


def _buffers(pool: Any, attr: str) -> list | None:
    if pool is None:
        return None
    bufs = getattr(pool, attr, None)
    return None if bufs is None else list(bufs)


def _nbytes(obj: Any) -> int:
    if obj is None:
        return 0
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes)
    inner = getattr(obj, "kv_score_buffer", None)  # CompressStatePool -> KVAndScore
    if inner is not None:
        return int(inner.kv_score.nbytes)
    return 0


def inventory_from_pool(kvcache: Any, stage_map: StageLayerMap) -> tuple[PoolInventory, dict[str, int], list[MappingError]]:
    """Per pool, the buffers the stage really holds -- the lists the HiCache assembler reads."""
    s = stage_map.stage
    if getattr(kvcache, "_unified_kv", False) or kvcache.swa_kv_pool is None:
        raise ConfigError(
            f"stage {s}: this DeepSeekV4TokenToKVPool keeps SWA in a unified or per-request "
            "window (no paged swa_kv_pool); stagecache inspects paged pools only"
        )
    indexer = getattr(kvcache, "c4_indexer_kv_pool", None)
    index_bufs = _buffers(indexer, "index_k_with_scale_buffer")
    if index_bufs is None and indexer is not None:
        index_bufs = _buffers(indexer, "index_k_payload_buffer")
    states = list(getattr(kvcache, "compress_state_pools", []) or [])
    indexer_states = list(getattr(kvcache, "indexer_compress_state_pools", []) or [])

    def state_list(pool_states: list, ratio: int) -> list:
        # The assembler's state_pools: one entry per stage layer of that ratio, by global id.
        return [
            pool_states[e.global_id] if e.global_id < len(pool_states) else None
            for e in stage_map.layers if e.compress_ratio == ratio
        ]

    buffers: dict[str, list | None] = {
        "swa": _buffers(kvcache.swa_kv_pool, "kv_buffer"),
        "c4": _buffers(getattr(kvcache, "c4_kv_pool", None), "kv_buffer"),
        "c128": _buffers(getattr(kvcache, "c128_kv_pool", None), "kv_buffer"),
        "c4_state": state_list(states, 4),
        "c128_state": state_list(states, 128),
        "indexer": index_bufs,
    }
    errors: list[MappingError] = []
    missing = [
        e.global_id for e in stage_map.layers
        if e.compress_ratio == 4
        and (e.global_id >= len(indexer_states) or indexer_states[e.global_id] is None)
    ]
    if missing:
        errors.append(MappingError(
            s, "indexer", "no None buffers", f"None at global layers {missing}",
            f"deepseek_v4_c4_indexer_state state_pools must not contain None: global layer(s) "
            f"{missing} have no indexer compress state",
        ))
    nbytes = {pool: sum(_nbytes(b) for b in (bufs or ())) for pool, bufs in buffers.items()}
    return PoolInventory.from_buffers(s, buffers), nbytes, errors


def pp_rank_of(kvcache: Any, pp_size: int) -> int | None:
    """The PP rank whose ``get_pp_indices`` range is the pool's ``[start_layer, end_layer)``."""
    n = len(kvcache.compression_ratios)
    want = (int(kvcache.start_layer), int(kvcache.end_layer))
    for rank in range(pp_size):
        if tuple(get_pp_indices(n, rank, pp_size)) == want:
            return rank
    return None


def read_pool(kvcache: Any, pp_rank: int, name: str = "sglang") -> PoolView:
    """Read one pool into stagecache's types; also diff its map against stagecache's own."""
    spec = spec_from_pool(kvcache, name)
    stage_map, findings = stage_map_from_pool(kvcache, pp_rank)
    inventory, nbytes, more = inventory_from_pool(kvcache, stage_map)
    findings += more
    if 0 <= stage_map.start <= stage_map.end <= spec.num_layers:
        expected = build_stage_map(spec, pp_rank, stage_map.start, stage_map.end)
        for got, want in zip(stage_map.layers, expected.layers, strict=True):
            if got.compress_layer_id != want.compress_layer_id:
                findings.append(MappingError(
                    pp_rank, "layer_map", want.compress_layer_id, got.compress_layer_id,
                    f"global layer {got.global_id} (ratio {got.compress_ratio}): sglang's "
                    f"compress_layer_id differs from the stage-local id stagecache computes",
                ))
    return PoolView(spec, stage_map, inventory, nbytes, tuple(findings))


# ---------------------------------------------------------------------------------------------
# Partition: sglang's get_pp_indices vs stagecache's partition_layers
# ---------------------------------------------------------------------------------------------
def sglang_partition(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Every rank's ``(start, end)`` as sglang computes it (it reads ``SGLANG_PP_LAYER_PARTITION``)."""
    return [tuple(get_pp_indices(num_layers, rank, pp_size)) for rank in range(pp_size)]


def partition_findings(num_layers: int, pp_size: int) -> list[MappingError]:
    """Compare sglang's partition with stagecache's, under the same env partition."""
    text = os.environ.get(PARTITION_ENV)
    partition = parse_partition(text) if text is not None and pp_size > 1 else None
    try:
        ours = [(s.start, s.end) for s in partition_layers(num_layers, pp_size, partition)]
    except ConfigError as exc:
        return [MappingError(None, "partition", "a valid partition", text, str(exc))]
    try:
        theirs = sglang_partition(num_layers, pp_size)
    except ValueError as exc:
        return [MappingError(None, "partition", ours, None, f"sglang get_pp_indices failed: {exc}")]
    return [
        MappingError(
            rank, "partition", list(mine), list(sg),
            f"stage {rank}: stagecache's partition_layers gives {list(mine)}, sglang's "
            f"get_pp_indices gives {list(sg)}",
        )
        for rank, (mine, sg) in enumerate(zip(ours, theirs, strict=True))
        if mine != sg
    ]


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------
def inspect_pools(
    kvcaches: Sequence[Any],
    *,
    pp_size: int,
    pp_ranks: Sequence[int] | None = None,
    tp_size: int = 1,
    page_size: int | None = None,
    model_name: str = "sglang",
) -> StartupReport:
    """Validate live pools (one per PP rank given) and report like ``stagecache check``.

    With every stage present the report is ``build_report`` over the whole layout
    (tiling checked too); with some stages present only those are validated.
    Either way sglang-vs-stagecache partition mismatches and pool holes the generic
    validation cannot see are added as findings.
    """
    if not kvcaches:
        raise ConfigError("inspect_pools: no pool given")
    if pp_ranks is None:
        pp_ranks = []
        for kv in kvcaches:
            rank = pp_rank_of(kv, pp_size)
            if rank is None:
                raise ConfigError(
                    f"pool with layers [{kv.start_layer}, {kv.end_layer}) matches no rank of "
                    f"get_pp_indices for pp_size={pp_size}; pass pp_rank explicitly"
                )
            pp_ranks.append(rank)
    views = [read_pool(kv, rank, model_name) for kv, rank in zip(kvcaches, pp_ranks, strict=True)]
    spec = views[0].spec
    page = int(page_size if page_size is not None else kvcaches[0].page_size)
    cross = partition_findings(spec.num_layers, pp_size)
    by_stage = {v.stage_map.stage: v for v in views}
    if sorted(by_stage) == list(range(pp_size)) and len(views) == pp_size:
        layout = ModelLayout(spec, pp_size, tp_size, tuple(by_stage[i].stage_map for i in range(pp_size)))
        report = build_report(layout, [by_stage[i].inventory for i in range(pp_size)], page)
        stages = tuple(
            StageReport(r.stage_map, r.buffers, r.expected, r.errors + by_stage[r.stage_map.stage].findings)
            for r in report.stages
        )
        cross = list(report.cross_errors) + cross
    else:
        stages = tuple(
            StageReport(
                v.stage_map, v.inventory.counts(), v.stage_map.expected_buffers(),
                tuple(validate_stage(v.stage_map, v.inventory)) + v.findings,
            )
            for v in sorted(views, key=lambda v: v.stage_map.stage)
        )
        cross += [
            e for e in validate_tiling([v.stage_map.slice for v in views], spec.num_layers)
            if e.stage is not None  # gaps are expected: the other stages live elsewhere
        ]
    return StartupReport(
        model=model_name, num_layers=spec.num_layers, pp_size=pp_size, tp_size=tp_size,
        page_size=page, stages=stages, cross_errors=tuple(cross),
    )


def inspect_pool(kvcache: Any, *, pp_size: int, pp_rank: int | None = None, **kw: Any) -> StartupReport:
    """One rank's pool: ``inspect_pools([kvcache], ...)``."""
    return inspect_pools(
        [kvcache], pp_size=pp_size, pp_ranks=None if pp_rank is None else [pp_rank], **kw
    )


# ---------------------------------------------------------------------------------------------
# Live numbers for the exporters / dashboard
# ---------------------------------------------------------------------------------------------
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
                live = self._live.setdefault(stage, StageLive(stage=stage))
                for pool, nbytes in (pool_bytes or {}).get(stage, {}).items():
                    live.pool_bytes[pool] = PoolBytes(device=nbytes)
            self._cross = [e for e in self._cross if e not in report.cross_errors] + list(report.cross_errors)

    def record_transfer(self, stage: int, direction: str, num_bytes: int, seconds: float, tokens: int) -> None:
        """One HiCache transfer: ``direction`` is ``d2h`` (write/backup) or ``h2d`` (load)."""
        if direction not in ("d2h", "h2d"):
            raise ConfigError(f"transfer direction must be 'd2h' or 'h2d', got {direction!r}")
        with self._lock:
            live = self._live.setdefault(stage, StageLive(stage=stage))
            live.time = time.time()
            nbytes = getattr(live.transfer_bytes, direction) + int(num_bytes)
            secs = getattr(live.transfer_seconds, direction) + float(seconds)
            setattr(live.transfer_bytes, direction, nbytes)
            setattr(live.transfer_seconds, direction, secs)
            setattr(live.transfer_count, direction, getattr(live.transfer_count, direction) + 1)
            setattr(live.bandwidth_bytes_per_second, direction, nbytes / secs if secs > 0 else 0.0)
            if direction == "h2d":
                live.cache_tokens.host += int(tokens)

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


# ---------------------------------------------------------------------------------------------
# Start-up hook
# ---------------------------------------------------------------------------------------------
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
) -> Attachment:
    """Hook sglang's DeepSeek-V4 HiCache stack build in this process until ``detach()``.

    Every ``build_deepseek_v4_hicache_stack(kvcache=..., ...)`` (sglang's
    ``_DeepSeekV4Strategy`` calls it through the module, so the hook sees it) first
    validates the pool and publishes the report; with ``strict`` an invalid stage raises
    ``StageMappingInvalid`` listing every error (stage, pool, expected vs got) instead of
    sglang's first ``ValueError``.  The controller it returns is wrapped to count
    transfers.  With ``dashboard_port`` the stage's dashboard (and ``/metrics``) is
    served on ``dashboard_port + pp_rank`` once the report exists.  ``pp_size=None``
    reads ``pp_size``/``pp_rank``/``tp_size`` from sglang's runtime context at build time.

    The hook must run in the scheduler processes, which sglang *spawns*: use the
    ``sglang.srt.plugins`` entry point (``sglang_plugin``), or call this at the top level
    of a launcher script (a spawned process re-runs it).  See docs/sglang.md.
    """
    src = source or SglangSource(model_name)
    original = hybrid_pool_assembler.build_deepseek_v4_hicache_stack
    att = Attachment(src, original)

    @functools.wraps(original)
    def build(*args: Any, **kwargs: Any):
        kvcache = kwargs.get("kvcache")
        if kvcache is None:
            raise ConfigError("build_deepseek_v4_hicache_stack called without kvcache=")
        size, rank, tp = pp_size, pp_rank, tp_size
        if size is None:  # a plugin in a scheduler process: sglang knows the topology
            size, live_rank, tp = _parallel_from_sglang()
            rank = rank if rank is not None else live_rank
        rank = rank if rank is not None else pp_rank_of(kvcache, size)
        if rank is None:
            raise ConfigError(
                f"kvcache layers [{kvcache.start_layer}, {kvcache.end_layer}) match no rank of "
                f"get_pp_indices for pp_size={size}; pass pp_rank=..."
            )
        report = inspect_pool(kvcache, pp_size=size, pp_rank=rank, tp_size=tp, model_name=model_name)
        nbytes = inventory_from_pool(kvcache, stage_map_from_pool(kvcache, rank)[0])[1]
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
