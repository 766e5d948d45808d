"""Every Prometheus family stagecache exposes, as declarative tables.

A family is a name, a type, a help text, its label names and a function that turns one input into
samples; the collector (``metrics.py``) walks the tables and docs/metrics.md is generated from
them (``reference.py``), so adding a family is adding one ``Family`` to a table.  Per-stage
families carry ``STAGE_LABELS`` first (sglang's own label names), so stagecache series join
sglang's ``on (model_name, pp_rank, tp_rank)``.  Counters count since the stage started; ratios
and bandwidths are left to ``rate()`` in recording rules (docker/alerts.yml).  Gauges hold states.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

from stagecache.runtime.live.numbers import STAGE_PHASES, StageLive
from stagecache.runtime.memory.host_tier import HOST_TIER_STATUSES
from stagecache.runtime.transfer.stats import DIRECTIONS, TransferKind
from stagecache.runtime.validation.report import StageReport, StartupReport

from .divergence_families import (
    DIVERGENCE_FAMILIES,
    DIVERGENCE_LABEL_VALUES,
    DIVERGENCE_LABELS,
    INCOMPLETE_FAMILIES,
)
from .family import Family, Samples, cumulative_buckets, one, per
from .insight_families import CACHE_INSIGHT_FAMILIES, INSIGHT_LABEL_VALUES, INSIGHT_LABELS
from .l3_families import L3_FAMILIES, L3_LABEL_VALUES, L3_LABELS

#: Labels of every per-stage family, in this order (sglang's vocabulary).
STAGE_LABELS: tuple[str, ...] = ("model_name", "pp_rank", "tp_rank")

TIERS = ("device", "host")
#: Where a prefix hit was found: the two memory tiers and L3.
HIT_TIERS = (*TIERS, "storage")
#: ``StageLive.cache_pages`` field -> ``operation`` label value.
HICACHE_OPERATIONS = {"backup": "backup", "load": "load", "dropped": "drop",
                      "backup_skipped": "backup_skip"}
#: Phases a stage reports (``StageLive.phase``).
PHASES = tuple(p.value for p in STAGE_PHASES)

#: Label name -> its one meaning (and its values where they are a closed set).
LABELS: dict[str, str] = {
    "model_name": "served model: the preset name or the config's model name (sglang's label)",
    "pp_rank": "pipeline-parallel rank, i.e. the stage, 0-based (sglang's label)",
    "tp_rank": "tensor-parallel rank whose numbers these are; stagecache reports rank 0 "
               "(KV is replicated across TP) (sglang's label)",
    "pool": "KV pool kind, named by the stage's own inventory (swa, c4, c128, ...); on transfer "
            "families `all` where the source reports no per-kind split (sglang hooks)",
    "tier": "memory tier: `device` or `host` (where pages or bytes live); where a prefix hit was "
            "found also `storage` (L3)",
    "direction": "host<->device copy direction: `d2h` (backup to host) or `h2d` (load from host)",
    "space": "page-id space: pages shared by every pool drawing on it (`device`, `host`)",
    "operation": "HiCache page operation: `backup`, `load`, `drop`, `backup_skip`",
    "version": "stagecache package version",
    "pp_size": "pipeline-parallel size (stages)",
    "tp_size": "tensor-parallel size",
    "page_size": "tokens per KV page",
    "num_layers": "model layers over all stages",
    "stagecache_stage_phase": "a stage phase (state set): " + ", ".join(PHASES),
    "stagecache_host_tier_status": "a host-tier status (state set): " + ", ".join(HOST_TIER_STATUSES),
    **INSIGHT_LABELS,
    **L3_LABELS,
    **DIVERGENCE_LABELS,
}

#: Closed value sets, checked by the tests for every exposed sample.
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "tier": HIT_TIERS, "direction": DIRECTIONS, "operation": tuple(HICACHE_OPERATIONS.values()),
    **INSIGHT_LABEL_VALUES, **L3_LABEL_VALUES, **DIVERGENCE_LABEL_VALUES,
}

# -- the startup report ------------------------------------------------------------------------


def _model_info(r: StartupReport) -> Samples:
    return [((r.model, str(r.pp_size), str(r.tp_size), str(r.page_size), str(r.num_layers)), 1)]


RUN_FAMILIES: tuple[Family, ...] = (
    Family("stagecache_model_info", "info", "The run's model and parallel layout (value 1)",
           ("model_name", "pp_size", "tp_size", "page_size", "num_layers"), _model_info),
    Family("stagecache_startup_ok", "gauge",
           "1 if every stage's pools and layer map validated at startup, 0 if not (absent while "
           "starting)", ("model_name",), lambda r: [((r.model,), 1 if r.ok else 0)]),
    Family("stagecache_cross_stage_errors", "gauge",
           "Cross-stage validation errors at startup (partition gaps/overlaps)", ("model_name",),
           lambda r: [((r.model,), len(r.cross_errors))]),
)


def _pools(s: StageReport) -> list[str]:
    """Pool names as the stage's report has them (data, never a hard-coded list)."""
    return sorted(set(s.buffers) | set(s.expected))


STARTUP_FAMILIES: tuple[Family, ...] = (
    Family("stagecache_stage_local_layers", "gauge", "Layers this PP stage owns",
           samples=one(lambda s: s.local_layers)),
    Family("stagecache_stage_buffers", "gauge",
           "Buffers the stage's pool really holds (None slots included)", ("pool",),
           lambda s: [((p,), s.buffers.get(p, 0)) for p in _pools(s)]),
    Family("stagecache_stage_expected_buffers", "gauge",
           "Buffers the stage's pool must hold: its local layers of that pool's kind", ("pool",),
           lambda s: [((p,), s.expected.get(p, 0)) for p in _pools(s)]),
    Family("stagecache_stage_mapping_ok", "gauge", "1 if the stage validated at startup, else 0",
           samples=one(lambda s: 1 if s.ok else 0)),
    Family("stagecache_stage_mapping_errors", "gauge", "Validation errors of the stage at startup",
           samples=one(lambda s: len(s.errors))),
)


# -- a stage's live numbers ---------------------------------------------------------------------


def _phase(s: StageLive) -> Samples:
    return [((), {p: s.phase.value == p for p in PHASES})]


# -- transfers: queue wait vs DMA time, per direction and pool kind ----------------------------

#: ``pool`` label of a source that reports transfers without a per-kind split (the sglang hooks):
#: its direction totals, every kind of the stage together.
UNSPLIT_POOL = "all"


def _transfer_kinds(s: StageLive, direction: str) -> dict[str, TransferKind]:
    """The direction's per-kind split; a source without one gets its totals as pool ``all``."""
    kinds = getattr(s.transfer_split, direction)
    if kinds or not (getattr(s.transfer_count, direction) or getattr(s.transfer_bytes, direction)):
        return dict(kinds)
    return {UNSPLIT_POOL: TransferKind(
        bytes=getattr(s.transfer_bytes, direction), moves=getattr(s.transfer_count, direction),
        queue_seconds=getattr(s.transfer_split.queue_seconds, direction),
        dma_seconds=getattr(s.transfer_seconds, direction))}


def _per_kind(fn: Callable[[StageLive, TransferKind], Any]) -> Callable[[StageLive], Samples]:
    return lambda s: [((d, pool), fn(s, k)) for d in DIRECTIONS
                      for pool, k in sorted(_transfer_kinds(s, d).items())]


TRANSFER_FAMILIES: tuple[Family, ...] = (
    Family("stagecache_transfers_total", "counter",
           "Device<->host transfers (calls); one transfer moves one or more pool kinds", ("direction",),
           per(DIRECTIONS, lambda s, d: getattr(s.transfer_count, d))),
    Family("stagecache_transfer_bytes_total", "counter",
           "Bytes copied between device and host pools, by pool kind", ("direction", "pool"),
           _per_kind(lambda s, k: k.bytes)),
    Family("stagecache_transfer_queue_wait_seconds", "histogram",
           "Seconds from a transfer's call until its copy started on the stream (CUDA events on GPU, "
           "host clock on CPU); every pool kind the transfer moved observes the whole wait",
           ("direction", "pool"),
           _per_kind(lambda s, k: (cumulative_buckets(s.transfer_split.le, k.queue_buckets, k.moves),
                                   k.queue_seconds))),
    Family("stagecache_transfer_dma_seconds", "histogram",
           "Copy time of a transfer, start to finish (CUDA events on GPU, host clock on CPU), split over "
           "the pool kinds it moved by bytes: rate(bytes_total) / rate(_sum) is the copy bandwidth",
           ("direction", "pool"),
           _per_kind(lambda s, k: (cumulative_buckets(s.transfer_split.le, k.dma_buckets, k.moves),
                                   k.dma_seconds))),
)


def _spaces(fn: Callable[[Any], float]) -> Callable[[StageLive], Samples]:
    return lambda s: [((name, sp.tier), fn(sp)) for name, sp in sorted(s.page_spaces.items())]


#: Counters that are one ``StageLive`` field each: (family, field, help).
FIELD_COUNTERS = (
    ("stagecache_kv_verified_pages_total", "kv_verified_pages", "Host-loaded pages whose KV bytes were verified"),
    ("stagecache_computed_tokens_total", "computed_rows",
     "Tokens the stage computed (activation rows through its layers)"),
    ("stagecache_stage_busy_seconds_total", "stage_seconds",
     "Seconds the stage spent on its own work (cache, KV writes, transfers, layer compute)"),
    ("stagecache_stage_bubble_seconds_total", "bubble_seconds",
     "Seconds the stage waited on a peer (activation, credit, send drain): the pipeline bubble"),
    ("stagecache_stage_idle_seconds_total", "idle_seconds",
     "Seconds the stage waited for requests to arrive, not counted as bubble"),
    ("stagecache_activation_sent_bytes_total", "activation_bytes_sent",
     "Activation bytes (with headers) sent to the next stage"),
    ("stagecache_activation_received_bytes_total", "activation_bytes_received",
     "Activation bytes (with headers) received from the previous stage"),
)

LIVE_FAMILIES: tuple[Family, ...] = (
    # states
    Family("stagecache_stage_phase", "stateset",
           "The stage's phase: 1 for the phase it is in, 0 for the others", samples=_phase),
    Family("stagecache_stage_planned_requests", "gauge",
           "Requests the stage will serve in this run (the trace length); 0 until known",
           samples=one(lambda s: s.total_requests)),
    Family("stagecache_page_space_used_pages", "gauge",
           "Pages in use in a page-id space (each space counted once, whatever pools share it)",
           ("space", "tier"), _spaces(lambda sp: sp.used)),
    Family("stagecache_page_space_capacity_pages", "gauge", "Pages a page-id space holds",
           ("space", "tier"), _spaces(lambda sp: sp.total)),
    Family("stagecache_page_space_usage_ratio", "gauge", "Used / capacity pages of a page-id space",
           ("space", "tier"), _spaces(lambda sp: sp.used / sp.total if sp.total else 0.0)),
    Family("stagecache_pool_page_space_info", "info",
           "Which page-id space a pool kind draws its pages from (value 1)", ("pool", "space"),
           lambda s: [((p, name), 1) for name, sp in sorted(s.page_spaces.items()) for p in sp.pools]),
    Family("stagecache_capacity_tokens_alone", "gauge",
           "Full tokens the stage's own memory budget fits (0: unknown)", (),
           one(lambda s: s.capacity.tokens_alone)),
    Family("stagecache_capacity_tokens", "gauge",
           "The deployment's token capacity: the minimum over PP stages (0: unknown)", (),
           one(lambda s: s.capacity.tokens)),
    Family("stagecache_capacity_stranded_bytes", "gauge",
           "Device bytes the deployment's minimum capacity leaves unused on the stage", (),
           one(lambda s: s.capacity.stranded_bytes)),
    Family("stagecache_pool_bytes", "gauge", "Bytes a pool kind occupies on the stage, by tier",
           ("pool", "tier"),
           lambda s: [((p, t), getattr(b, t)) for p, b in sorted(s.pool_bytes.items()) for t in TIERS]),
    # counters
    Family("stagecache_requests_total", "counter", "Requests the stage has finished",
           samples=one(lambda s: s.requests)),
    Family("stagecache_micro_batches_total", "counter", "Micro-batches the stage has finished",
           samples=one(lambda s: s.steps)),
    Family("stagecache_prefix_lookup_tokens_total", "counter",
           "Prompt tokens looked up in the prefix cache", samples=one(lambda s: s.cache_tokens.looked_up)),
    Family("stagecache_prefix_hit_tokens_total", "counter",
           "Looked-up tokens the prefix cache found, by the tier they were found in", ("tier",),
           per(HIT_TIERS, lambda s, t: getattr(s.cache_tokens, t))),
    Family("stagecache_evicted_pages_total", "counter",
           "Pages evicted from a tier (device: to host or dropped; host: dropped)", ("tier",),
           per(TIERS, lambda s, t: getattr(s.evictions, t))),
    Family("stagecache_hicache_pages_total", "counter", "Pages HiCache backed up, loaded, dropped or "
           "did not back up (already on host)", ("operation",),
           lambda s: [((op,), getattr(s.cache_pages, f)) for f, op in HICACHE_OPERATIONS.items()]),
    *TRANSFER_FAMILIES,
    *(Family(name, "counter", text, samples=one(attrgetter(attr))) for name, attr, text in FIELD_COUNTERS),
)

# -- host-tier sanity and pool occupancy (a stage's ``StageLive``) -----------------------------------


def _host_tier_states(s: StageLive) -> Samples:
    """Every known status, true where it holds; nothing before the stage has checked."""
    if not s.host_tier.status:
        return []
    states = {st: st in s.host_tier.status for st in HOST_TIER_STATUSES}
    states.update({st: True for st in s.host_tier.status})
    return [((), states)]


def _optional(value: int | None) -> Samples:
    return [] if value is None else [((), value)]


def _occupancy(unit: str, fn: Callable[[Any], float]) -> Callable[[StageLive], Samples]:
    """One series per (pool, tier) of the stage's occupancy rows (``unit``: page, slot or any)."""
    return lambda s: [((o.pool, o.tier), fn(o)) for o in s.pool_occupancy
                      if unit in ("any", o.unit)]


HOST_TIER_FAMILIES: tuple[Family, ...] = (
    Family("stagecache_host_tier_status", "stateset",
           "The stage's host-tier sanity (1 where a status holds): ok, smaller_than_device and "
           "pin_refused (warnings, still ready), exceeds_ram (not ready)",
           samples=_host_tier_states),
    Family("stagecache_host_memory_available_bytes", "gauge",
           "The host's MemAvailable at the stage's last check (re-read every few seconds)",
           samples=lambda s: _optional(s.host_tier.mem_available_bytes)),
    Family("stagecache_host_memory_reserve_bytes", "gauge",
           "RAM the host tiers must leave available; below it the status is exceeds_ram",
           samples=lambda s: _optional(s.host_tier.reserve_bytes)),
)

POOL_OCCUPANCY_FAMILIES: tuple[Family, ...] = (
    Family("stagecache_pool_used_pages", "gauge",
           "Pages in use in a paged pool kind's own page space (kinds of one page-id space show the "
           "same count: do not sum over pools, sum stagecache_page_space_used_pages)",
           ("pool", "tier"), _occupancy("page", lambda o: o.used)),
    Family("stagecache_pool_capacity_pages", "gauge", "Pages a paged pool kind's own page space holds",
           ("pool", "tier"), _occupancy("page", lambda o: o.capacity)),
    Family("stagecache_pool_used_slots", "gauge",
           "Request slots in use in a per-request pool kind (c128_state)",
           ("pool", "tier"), _occupancy("slot", lambda o: o.used)),
    Family("stagecache_pool_capacity_slots", "gauge", "Request slots a per-request pool kind holds",
           ("pool", "tier"), _occupancy("slot", lambda o: o.capacity)),
    Family("stagecache_pool_used_bytes", "gauge",
           "Bytes of a pool kind's used pages or slots, all its buffers (the kind's own bytes: these "
           "sum over pools; capacity is stagecache_pool_bytes)",
           ("pool", "tier"), _occupancy("any", lambda o: o.used_bytes)),
    Family("stagecache_pool_usage_ratio", "gauge", "Used / capacity units of a pool kind",
           ("pool", "tier"), _occupancy("any", lambda o: o.used / o.capacity if o.capacity else 0.0)),
    Family("stagecache_pool_peak_usage_ratio", "gauge",
           "The most units of a pool kind in use at once since the stage started, / capacity",
           ("pool", "tier"), _occupancy("any", lambda o: o.peak / o.capacity if o.capacity else 0.0)),
)


LIVE_FAMILIES += HOST_TIER_FAMILIES + POOL_OCCUPANCY_FAMILIES + CACHE_INSIGHT_FAMILIES + L3_FAMILIES

#: One stage's liveness, ``(StageHealth, Liveness)`` of ``serve.liveness``: /readyz's verdict.
LIVENESS_FAMILIES: tuple[Family, ...] = (
    Family("stagecache_stage_up", "gauge",
           "1 if the stage process is alive and its heartbeat is newer than the heartbeat timeout, "
           "else 0", samples=one(lambda hv: 1 if hv[0].up else 0)),
    Family("stagecache_stage_last_heartbeat_timestamp_seconds", "gauge",
           "Unix time of the stage's last heartbeat (0: never)",
           samples=one(lambda hv: hv[0].heartbeat_at or 0.0)),
    Family("stagecache_stage_failed", "gauge",
           "1 for the stage the run's failure names (its error: /readyz, the dashboard), else 0",
           samples=one(lambda hv: 1 if hv[1].failed_stage == hv[0].stage else 0)),
)

#: The serving parent's own health (``RunDirSource.write_failures``; absent without a parent).
PARENT_FAMILIES: tuple[Family, ...] = (
    Family("stagecache_run_file_write_failures_total", "counter",
           "Failed writes of the serving parent's run.json / snapshot.json (disk full, read-only "
           "file system); each is logged and retried while the run and the dashboard go on",
           samples=one(lambda n: n)),
)

#: Not produced from a report or a stage: the package itself.
BUILD_INFO = Family("stagecache_build_info", "info", "stagecache's version (value 1)", ("version",))


def all_families() -> tuple[tuple[str, Family], ...]:
    """``(scope, family)`` in exposition order; scope is build, run, startup, live, liveness,
    parent, deployment (the PP ranks' agreement) or transfers (incomplete HiCache transfers)."""
    return (("build", BUILD_INFO), *(("run", f) for f in RUN_FAMILIES),
            *(("startup", f) for f in STARTUP_FAMILIES), *(("live", f) for f in LIVE_FAMILIES),
            *(("liveness", f) for f in LIVENESS_FAMILIES), *(("parent", f) for f in PARENT_FAMILIES),
            *(("deployment", f) for f in DIVERGENCE_FAMILIES), *(("transfers", f) for f in INCOMPLETE_FAMILIES))


def label_names(scope: str, fam: Family) -> tuple[str, ...]:
    """Every label of the family's series, as exposed (state sets add one named after the family)."""
    base = STAGE_LABELS + fam.labels if scope in ("startup", "live", "liveness") else fam.labels
    return base + ((fam.name,) if fam.kind == "stateset" else ())
