"""A live sglang PP deployment as one instrument: records exchanged, one endpoint, sglang's own numbers.

sglang loads plugins first thing in each scheduler process, before its distributed state
exists, so nothing can be exchanged then.  ``Deployment.register()`` instead registers hooks
(``HOOKS``) with sglang's ``HookRegistry`` -- the one way stagecache hooks sglang -- on calls
every PP rank reaches in ``Scheduler.__init__`` in the same order (the first two at load, the
rest once the pools exist, only those the server reaches: ``armed_hooks``): the token capacity
(the capacity ledger), then the stack build (or the pool build without HiCache), where each rank reads
its live pool into a ``StageRecord`` (``reader``), the ranks exchange records
(``record_exchange``) and every rank validates the whole deployment; rank 0 then serves the one
endpoint the others push to (``push``).  At run time the prefix match, the transfer submissions
and the per-step ack checks feed the stage's numbers (``rank_source``) and the records rank 0
compares (``agreement``, ``live.divergence``).  docs/sglang.md describes each hook.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import operator
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from ...defaults import (
    HOST,
    SGLANG_DASHBOARD_PORT,
    SGLANG_EXCHANGE_TIMEOUT_S,
    SGLANG_PUSH_INTERVAL_S,
    SGLANG_PUSH_TIMEOUT_S,
)
from ...errors import ConfigError, StageMappingInvalid
from ...live.numbers import CapacityLive, PageSpace, PoolBytes, StageLive
from ...live.remote import host_id, start_ticks
from ...model.spec import ModelSpec
from ...validation.deployment import deployment_report
from ...validation.record import StageRecord
from ...validation.report import StartupReport
from .agreement import FAULT_ENV, RankAgreement, TransferPlan, parse_live_fault
from .push import Pusher, PushReceiver
from .rank_source import Moves, SglangSource
from .reader import (
    PoolView,
    model_num_layers,
    pool_family,
    read_family_pool,
    read_pool,
    sglang_model_spec,
)
from .record_exchange import exchange_records

log = logging.getLogger(__name__)

_KVC = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator."
_HPA = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler."
_URC = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache."
_HCC = "sglang.srt.managers.cache_controller.HiCacheController."
_STRATEGY = ("self", "cache", "kvcache", "params")
_PREFETCH = ("self", "operation", "storage_hit_count")


class Hook(NamedTuple):
    """One sglang function the deployment hooks (a ``HookRegistry`` target)."""

    target: str
    method: str  # the deployment's hook for it, a dotted attribute path
    params: tuple[str, ...] = ("self",)  # the leading parameters it relies on (tested releases)
    after: bool = False  # HookType.AFTER, else AROUND


#: sglang functions the deployment hooks, by name.
HOOKS = {
    "capacity": Hook(_KVC + "_apply_token_constraints", "around_token_constraints", ("self", "token_capacity")),
    "pools": Hook(_KVC + "_init_pools", "around_init_pools"),
    "stack": Hook(_HPA + "build_deepseek_v4_hicache_stack", "around_stack_build", ("params", "kvcache")),
    # every other family's HiCache stack: its assembler strategy's build (kvcache=, params=)
    "stack_mamba": Hook(_HPA + "_MambaStrategy.build", "around_strategy_build", _STRATEGY),
    "stack_swa": Hook(_HPA + "_SwaStrategy.build", "around_strategy_build", _STRATEGY),
    "stack_dsa": Hook(_HPA + "_DsaStrategy.build", "around_strategy_build", _STRATEGY),
    "stack_kv": Hook(_HPA + "_PlainKvStrategy.build", "around_strategy_build", _STRATEGY),
    "match": Hook(_URC + "match_prefix", "after_match_prefix", ("self", "params"), after=True),
    "write": Hook(_HCC + "start_writing", "around_start_writing"),
    "load": Hook(_HCC + "start_loading", "around_start_loading"),
    "step": Hook(_URC + "check_hicache_events", "agreement.around_check_hicache_events"),
    "write_check": Hook(_URC + "writing_check", "agreement.around_writing_check"),
    "load_check": Hook(_URC + "loading_check", "agreement.around_loading_check"),
    "prefetch": Hook(_HCC + "_sync_prefetch_hit_query", "agreement.around_prefetch_hit_query", _PREFETCH),
    # the hybrid controller (DeepSeek V4's) overrides it without calling the base: hooked too
    "prefetch_hybrid": Hook("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController."
                            "_sync_prefetch_hit_query", "agreement.around_prefetch_hit_query", _PREFETCH),
}
#: Each hook's sglang target, by name.
TARGETS = {name: hook.target for name, hook in HOOKS.items()}
#: The hooks registered when sglang loads the plugin: the first calls of every rank's start-up,
#: before any pool exists.  The others are registered once the stage's pools are built
#: (``armed_hooks``): sglang's ``HookRegistry`` walks every loaded module for each target it
#: applies (about 30 ms a target in a scheduler process), so a rank patches only what its flags
#: and its pool reach -- one stack build of five: 11 targets for a HiCache rank, not all 15.
AT_LOAD = ("capacity", "pools")
#: The HiCache stack build of each pool family (stagecache's name: ``reader.pool_family``): the
#: assembler strategy sglang selects for that pool.
STACK_HOOK = {"deepseek_v4": "stack", "linear_hybrid": "stack_mamba", "swa_hybrid": "stack_swa",
              "dsa": "stack_dsa", "mla": "stack_kv", "mha": "stack_kv"}


def armed_hooks(family: str | None, hicache: bool) -> tuple[str, ...]:
    """The hooks a stage needs beyond ``AT_LOAD``, by what its server runs: the prefix match
    always; with HiCache its family's stack build (a pool stagecache does not read: none), the
    transfer submissions, the per-step ack checks and the L3 prefetch hit query (both
    controllers': the hybrid one overrides it; an L3 store can also be attached while serving)."""
    names = ["match"]
    if hicache:
        names += [STACK_HOOK[family]] if family in STACK_HOOK else []
        names += ["write", "load", "step", "write_check", "load_check", "prefetch", "prefetch_hybrid"]
    return tuple(names)


def changed_targets() -> list[str]:
    """What of sglang's hooked functions is not as the hooks expect, one phrase each (empty:
    every target exists with the parameters the hooks read)."""
    import inspect
    import pkgutil

    changed = []
    for hook in HOOKS.values():
        target = hook.target
        path, attr = target.rsplit(".", 1)
        try:
            fn = getattr(pkgutil.resolve_name(path), attr)
            params = tuple(inspect.signature(fn).parameters)
        except Exception as exc:  # noqa: BLE001 - gone, renamed, not introspectable: all "changed"
            changed.append(f"{target} is missing ({type(exc).__name__})")
            continue
        want = hook.params
        if params[:len(want)] != want:
            changed.append(f"{target} takes ({', '.join(params)}), expected ({', '.join(want)}, ...)")
    return changed
#: The sglang releases the plugin was tested with (tests/integrations: the live suites run on each).
SGLANG_TESTED_VERSIONS = ("0.5.22", "0.5.23")
#: Requests whose first match was counted, remembered so a request re-matched while it waits
#: is not counted again (bounded: the oldest are forgotten).
MATCHED_REQUESTS = 8192


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name)
    try:
        value = float(text) if text else default
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {text!r}") from None
    if not 0 < value <= 86_400:
        raise ConfigError(f"{name} must be in (0, 86400] seconds, got {text!r}")
    return value


@dataclass(frozen=True)
class DeploymentOptions:
    """The plugin's settings (sglang gives plugins no arguments: ``from_env``)."""

    strict: bool = True
    port: int | None = SGLANG_DASHBOARD_PORT
    host: str = HOST
    advertise: str | None = None
    per_rank: bool = False
    exchange_timeout_s: float = SGLANG_EXCHANGE_TIMEOUT_S
    push_interval_s: float = SGLANG_PUSH_INTERVAL_S
    push_timeout_s: float = SGLANG_PUSH_TIMEOUT_S
    sync_transfers: bool = False
    model_name: str = "sglang"
    #: a PP divergence or an incomplete transfer makes /readyz 503 (default: a warning)
    strict_agreement: bool = False
    #: ``STAGECACHE_FAULT``: a planted live fault (``agreement.parse_live_fault``), None: none
    fault: tuple[str, int | None] | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DeploymentOptions:
        env = os.environ if env is None else env
        text = env.get("STAGECACHE_SGLANG_DASHBOARD_PORT")
        if text is not None and not (text.isdigit() and 0 <= int(text) < 65536):
            raise ConfigError(f"STAGECACHE_SGLANG_DASHBOARD_PORT must be a port (0..65535), got {text!r}")
        return cls(
            strict=env.get("STAGECACHE_SGLANG_STRICT", "1") != "0",
            port=int(text) if text else None,
            host=env.get("STAGECACHE_SGLANG_DASHBOARD_HOST", HOST),
            advertise=env.get("STAGECACHE_SGLANG_ADVERTISE_HOST") or None,
            per_rank=env.get("STAGECACHE_SGLANG_PER_RANK", "0") == "1",
            exchange_timeout_s=_env_float(env, "STAGECACHE_SGLANG_EXCHANGE_TIMEOUT_S", SGLANG_EXCHANGE_TIMEOUT_S),
            push_interval_s=_env_float(env, "STAGECACHE_SGLANG_PUSH_INTERVAL_S", SGLANG_PUSH_INTERVAL_S),
            push_timeout_s=_env_float(env, "STAGECACHE_SGLANG_PUSH_TIMEOUT_S", SGLANG_PUSH_TIMEOUT_S),
            sync_transfers=env.get("STAGECACHE_SGLANG_SYNC_TRANSFERS", "0") == "1",
            model_name=env.get("STAGECACHE_SGLANG_MODEL_NAME", "sglang"),
            strict_agreement=env.get("STAGECACHE_SGLANG_STRICT_AGREEMENT", "0") == "1",
            fault=parse_live_fault(env.get(FAULT_ENV)),
        )


@dataclass(frozen=True)
class Rank:
    """Where this scheduler process sits (from sglang's runtime context)."""

    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int


def _this_rank() -> Rank:
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    tp_rank = int(p.tp_rank) if p.tp_size > 1 else 0
    return Rank(int(p.pp_rank), int(p.pp_size), tp_rank, int(p.tp_size))


def _pp_cpu_group() -> Any:
    from sglang.srt.distributed.parallel_state import get_pp_group

    return get_pp_group().cpu_group


def _host_pages(params: Any, kvcache: Any) -> dict[str, int]:
    """sglang's own host page counts for the stack (full, SWA, C128 state); {} if it cannot say."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa

    try:
        full, swa, c128 = hpa._deepseek_v4_num_host_pages(
            params=params, kvcache=kvcache, page_size=params.page_size, swa_page_size=kvcache.swa_page_size)
    except Exception as exc:  # a private sglang helper: its absence must not stop a server
        log.warning("stagecache: sglang's host page count is unavailable (%s)", exc)
        return {}
    return {"full": int(full), "swa": int(swa), "c128": int(c128)}


def _ack_seconds(ack: Any) -> float | None:
    """Wait for a ``HiCacheAck``'s copy; its device-measured time when the events record one."""
    try:
        ack.finish_event.synchronize()
        if getattr(ack, "timing_enabled", False):
            return float(ack.start_event.elapsed_time(ack.finish_event)) / 1000.0
    except (AttributeError, RuntimeError):
        return None
    return None


def stage_live(rec: StageRecord, model_name: str) -> StageLive:
    """A stage's start-up numbers from its record: layers, pool bytes, capacity, host pages."""
    cap = rec.capacity
    used = sum(rec.device_bytes.values())
    spaces = {}
    page_size = rec.fingerprint.page_size if rec.fingerprint is not None else 0
    if rec.host_pages.get("full"):
        spaces["host"] = PageSpace(tier="host", used=0, total=rec.host_pages["full"] * page_size, pools=["full"])
    m = rec.layer_map
    return StageLive(
        stage=rec.stage, model_name=model_name, start_layer=m.start, end_layer=m.end,
        local_layers=m.local_layers,
        pool_bytes={p: PoolBytes(device=b) for p, b in rec.device_bytes.items()},
        capacity=CapacityLive(tokens_alone=cap.tokens_alone, tokens=cap.tokens, used_bytes=used,
                              stranded_bytes=rec.stranded_bytes()) if cap else CapacityLive(used_bytes=used),
        page_spaces=spaces,
    )


@dataclass(frozen=True)
class Endpoint:
    """Where the other ranks push (rank 0's URL) and the push MAC key: sent with rank 0's record."""

    url: str
    secret: bytes


def _exchanged(record: StageRecord, endpoint: Endpoint | None) -> dict[str, Any]:
    pid = os.getpid()
    return {"record": record.to_json(), "push_url": endpoint.url if endpoint else None,
            "push_secret": endpoint.secret.hex() if endpoint else None,
            "process": {"pid": pid, "ticks": start_ticks(pid), "host": host_id()}}


def same_host_peers(raw: list[Any], own: int) -> dict[int, tuple[int, int | None]]:
    """The other ranks on this rank's host (pid, start ticks), from the exchanged ``process``
    entries: this rank can see their processes go (``remote.gone``); over the network a rank
    can only fall silent."""
    here = host_id()
    peers: dict[int, tuple[int, int | None]] = {}
    for rank, item in enumerate(raw):
        proc = item.get("process") if isinstance(item, dict) else None
        if rank == own or not isinstance(proc, dict) or proc.get("host") != here:
            continue
        pid, ticks = proc.get("pid"), proc.get("ticks")
        if isinstance(pid, int) and pid > 0 and (ticks is None or isinstance(ticks, int)):
            peers[rank] = (pid, ticks)
    return peers


def parse_exchanged(raw: list[Any], pp_size: int) -> tuple[list[StageRecord], Endpoint | None]:
    """Every rank's record, validated, and rank 0's endpoint; a malformed one is a ``ConfigError``
    naming its rank."""
    from ...validation.record import RECORD_VERSION

    if len(raw) != pp_size:
        raise ConfigError(f"expected {pp_size} stage records, got {len(raw)}")
    records = []
    for rank, item in enumerate(raw):
        try:
            rec = StageRecord.model_validate(item["record"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"PP rank {rank}'s stage record is malformed: {exc}") from None
        if rec.version != RECORD_VERSION:
            raise ConfigError(f"PP rank {rank} sent stage record version {rec.version}, this rank "
                              f"reads {RECORD_VERSION}: run one stagecache version on every rank")
        records.append(rec)
    url, key = raw[0].get("push_url"), raw[0].get("push_secret")
    endpoint = Endpoint(str(url)[:512], bytes.fromhex(str(key)[:128])) if url and key else None
    return records, endpoint


class Deployment:
    """This scheduler process's part of the deployment (one per process: ``sglang_plugin``)."""

    def __init__(self, options: DeploymentOptions | None = None):
        self.options = options or DeploymentOptions()
        self.source = SglangSource(self.options.model_name,
                                   push_timeout_s=None if self.options.per_rank else self.options.push_timeout_s)
        self.capacity: tuple[int, int] | None = None
        self.rank: Rank | None = None
        self.report: StartupReport | None = None
        self.url: str | None = None
        self.pusher: Pusher | None = None
        self.host_pool: Any = None  # sglang's HostPoolGroup, once the stack is built
        self._matched: OrderedDict[str, None] = OrderedDict()
        self._stack = contextlib.ExitStack()
        self.agreement = RankAgreement()
        self.agreement.fault = self.options.fault
        self.record: StageRecord | None = None
        self._armed = False  # the hooks beyond AT_LOAD registered and applied (``_arm``)

    # -- registration ---------------------------------------------------------------------
    def register(self, names: tuple[str, ...] = AT_LOAD) -> Deployment:
        """Register hooks with sglang's ``HookRegistry`` (``load_plugins`` applies those of
        ``AT_LOAD``; ``_arm`` applies the rest)."""
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        for name in names:
            hook = HOOKS[name]
            HookRegistry.register(hook.target, operator.attrgetter(hook.method)(self),
                                  HookType.AFTER if hook.after else HookType.AROUND)
        return self

    def _arm(self, family: str | None, hicache: bool) -> None:
        """Once per process, when the stage's pools exist (before the stack build and the first
        request): register and apply the hooks this stage reaches (``armed_hooks``)."""
        if self._armed:
            return
        self._armed = True
        from sglang.srt.plugins.hook_registry import HookRegistry

        self.register(armed_hooks(family, hicache))
        HookRegistry.apply_hooks()

    # -- hooks (HookRegistry signatures) -----------------------------------------------------
    def around_token_constraints(self, original: Callable[..., int], configurator: Any,
                                 token_capacity: int, *args: Any, **kwargs: Any) -> int:
        """sglang's MIN over the ranks: remember this stage's capacity alone and the result."""
        result = original(configurator, token_capacity, *args, **kwargs)
        self.capacity = (int(token_capacity), int(result))
        return result

    def around_init_pools(self, original: Callable[..., Any], configurator: Any,
                          *args: Any, **kwargs: Any) -> Any:
        """Without HiCache the KV pool build is the last common step: exchange there."""
        pools = original(configurator, *args, **kwargs)
        from sglang.srt.runtime_context import get_server_args

        pool = getattr(pools, "token_to_kv_pool", None)
        family, hicache = pool_family(pool), bool(get_server_args().enable_hierarchical_cache)
        self._arm(family, hicache)
        if not hicache:
            if family == "deepseek_v4":
                self.join(pool, page_size=int(configurator.page_size), host_pages={})
            elif family is not None:
                self._join_family(pool, int(configurator.page_size), getattr(pools, "req_to_token_pool", None))
        return pools

    def around_stack_build(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Exchange and validate before sglang builds host pools."""
        kvcache, params = kwargs.get("kvcache"), kwargs.get("params")
        if kvcache is None or params is None:
            raise ConfigError("build_deepseek_v4_hicache_stack called without kvcache= and params=")
        self.join(kvcache, page_size=int(params.page_size), host_pages=_host_pages(params, kvcache))
        host_pool_group, controller = original(*args, **kwargs)
        self._stack_built(host_pool_group, int(params.page_size))
        return host_pool_group, controller

    def around_strategy_build(self, original: Callable[..., Any], strategy: Any, *args: Any, **kwargs: Any) -> Any:
        """Every family but DeepSeek V4 (whose strategy calls ``build_deepseek_v4_hicache_stack``,
        hooked above): the assembler strategy's ``build`` gets the live pool (``kvcache=``) and the
        scheduler's cache parameters (``params=``, whose ``req_to_token_pool`` owns a Mamba pool).
        Exchange and validate before sglang builds host pools, as for DeepSeek V4."""
        kvcache, params = kwargs.get("kvcache"), kwargs.get("params")
        if kvcache is None or params is None:
            raise ConfigError(f"{type(strategy).__name__}.build called without kvcache= and params=")
        if pool_family(kvcache) not in (None, "deepseek_v4"):
            self._join_family(kvcache, int(params.page_size), getattr(params, "req_to_token_pool", None))
        result = original(strategy, *args, **kwargs)
        self._stack_built(result.host_pool_group, int(params.page_size))
        return result

    def _join_family(self, kvcache: Any, page_size: int, req_pool: Any) -> None:
        """Join with a pool of any family but DeepSeek V4, whose kinds come from the served
        config.json: a model stagecache does not read leaves the plugin off in this process, with
        one log line -- it never stops sglang (every rank reads the same config, so every rank
        stays off alike)."""
        try:
            spec = sglang_model_spec(self.options.model_name)
        except ConfigError as exc:
            log.warning("stagecache: sglang serves a model stagecache does not read (%s); the plugin stays off", exc)
            return
        self.join(kvcache, page_size=page_size, host_pages={}, req_pool=req_pool, spec=spec)

    def _stack_built(self, host_pool_group: Any, page_size: int) -> None:
        """sglang built the stage's host pools: the transfer plan's bytes, host use on each read."""
        self.host_pool = host_pool_group
        if self.record is not None:
            self.agreement.plan = TransferPlan.of(self.record.family, self.record.inventory, host_pool_group,
                                                  page_size)
            self.agreement.arm_fault(self.record.family, self.rank.pp_size if self.rank else 1)
        self.source.on_read = self._refresh_host_used

    def around_start_writing(self, original: Callable[..., Any], controller: Any, *a: Any, **k: Any) -> Any:
        """A backup submission: count the acks it queued (bytes, seconds)."""
        self.agreement.leave_out(controller)  # STAGECACHE_FAULT=backup-without-indexer only
        return self._count(original, controller, controller.ack_write_queue,
                           getattr(controller, "write_queue", ()), "d2h", a, k)

    def around_start_loading(self, original: Callable[..., Any], controller: Any, *a: Any, **k: Any) -> Any:
        """A load submission: count the acks it queued (bytes, seconds)."""
        return self._count(original, controller, controller.ack_load_queue,
                           getattr(controller, "load_queue", ()), "h2d", a, k)

    def _count(self, original: Callable[..., Any], controller: Any, queue: list[Any], ops: Any,
               direction: str, a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        """On sglang's scheduler thread at every call, most of which queue nothing: kept lean.

        Each call that submits a transfer appends one ``HiCacheAck`` (``num_bytes``); seconds
        are the submission's wall time, or -- with ``STAGECACHE_SGLANG_SYNC_TRANSFERS=1`` -- the
        copy itself (waits on the ack's CUDA event, which serialises transfers: debugging only).
        """
        before = len(queue)
        first = ops[0] if ops else None  # the first queued operation: where the transfer's pages are
        t0 = time.perf_counter()
        result = original(controller, *a, **k)
        queued = len(queue) - before
        if queued > 0:
            self._counted(queue[before:], direction, t0)
            for ack in queue[before:]:
                self.agreement.check_ack(ack, direction, first)
        return result

    def _counted(self, acks: list[Any], direction: str, t0: float) -> None:
        measured = [_ack_seconds(ack) for ack in acks] if self.options.sync_transfers else None
        share = (time.perf_counter() - t0) / len(acks)  # after the waits when sync
        counters = self.source.counters(self.rank.pp_rank if self.rank else 0)
        moves: Moves = getattr(counters, direction)
        with self.source.lock:
            for i, ack in enumerate(acks):
                secs = measured[i] if measured is not None and measured[i] is not None else share
                moves.bytes += ack.num_bytes
                moves.seconds += secs
                moves.count += 1
            counters.updated_at = time.time()

    def _refresh_host_used(self) -> None:
        used = self.host_used()
        if used is not None and self.rank is not None:
            self.source.set_host_used(self.rank.pp_rank, *used)

    def host_used(self) -> tuple[int, int] | None:
        """(used, total) host tokens, as sglang's ``hicache_host_used_tokens`` counts them:
        the host pool's ``logical_size - available_size()``."""
        pool = self.host_pool
        if pool is None:
            return None
        total = int(pool.logical_size)
        return total - int(pool.available_size()), total

    def snapshot(self) -> StageLive:
        """This stage's numbers now (what it pushes): host tokens in use read at push time."""
        self._refresh_host_used()
        return self.source.snapshot(self.rank.pp_rank if self.rank else 0)

    def after_match_prefix(self, result: Any, cache: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        """A request's first prefix match: its device-hit, host-hit and missed tokens.

        On sglang's scheduler thread for every match, so it is lean: sglang matches a waiting
        request again at each scheduling step and only the first match is the request's."""
        req = params.req
        if req is None or self.rank is None:
            return None  # a lookup for eviction, a session, a warm-up: not a request
        rid = req.rid
        matched = self._matched
        if rid in matched:
            return None
        matched[rid] = None
        if len(matched) > MATCHED_REQUESTS:
            matched.popitem(last=False)
        device = result.device_prefix_len
        host = result.host_hit_length
        counters = self.source.counters(self.rank.pp_rank)
        with self.source.lock:
            counters.device_tokens += device
            counters.host_tokens += host
            counters.miss_tokens += max(0, len(params.key) - device - host)
            counters.updated_at = time.time()
        self.agreement.request(rid, device, host)
        return None

    def forget_requests(self) -> None:
        """Count the next match of every request id again (a benchmark replays the same ids)."""
        self._matched.clear()

    # -- the exchange ------------------------------------------------------------------------
    def _read(self, kvcache: Any, rank: Rank, page_size: int, req_pool: Any, spec: ModelSpec | None) -> PoolView:
        """The rank's live pool, read once: DeepSeek V4's by ``read_pool``, any other family's by
        ``read_family_pool`` (its kinds and ids named by the family module)."""
        if pool_family(kvcache) == "deepseek_v4":
            n = model_num_layers([kvcache], rank.pp_size)
            return read_pool(kvcache, rank.pp_rank, n, self.options.model_name, page_size)
        return read_family_pool(kvcache, rank.pp_rank, rank.pp_size, req_pool=req_pool, spec=spec,
                                name=self.options.model_name, page_size=page_size)

    def join(self, kvcache: Any, *, page_size: int, host_pages: dict[str, int],
             req_pool: Any = None, spec: ModelSpec | None = None) -> StartupReport:
        """Record, exchange, validate, publish, serve; strict: every rank raises the same error."""
        if self.rank is not None:
            raise ConfigError("stagecache: this sglang process built a second KV cache stack; "
                              "the record exchange runs once per scheduler process")
        rank = self.rank = _this_rank()
        record = self._read(kvcache, rank, page_size, req_pool, spec).record(
            pp_size=rank.pp_size, tp_size=rank.tp_size, model_name=self.options.model_name,
            capacity=self.capacity, host_pages=host_pages, pool_tokens=int(getattr(kvcache, "size", 0) or 0))
        self.record = record
        self.agreement.stage = rank.pp_rank
        alone = self.options.per_rank or rank.pp_size == 1  # a deployment of size 1
        endpoint = self._endpoint(rank)
        if alone:
            records = [record]
        else:
            raw = exchange_records(_exchanged(record, endpoint), _pp_cpu_group(), self.options.exchange_timeout_s)
            records, endpoint = parse_exchanged(raw, rank.pp_size)
            self.source.watch_peers(same_host_peers(raw, rank.pp_rank))
        report = self.report = deployment_report(records, tp_size=rank.tp_size, page_size=page_size,
                                                 pp_size=rank.pp_size)
        self.source.publish(report, {r.stage: stage_live(r, self.options.model_name) for r in records},
                            rank.pp_rank)
        self._serve(rank, endpoint)  # first: the endpoint shows a refusal while the process exits
        if not report.ok:
            for err in report.all_errors:
                log.error("stagecache: %s", err)
            if self.options.strict:
                raise StageMappingInvalid(report.all_errors)
        return report

    def _endpoint(self, rank: Rank) -> Endpoint | None:
        """Rank 0 of a deployment with one endpoint: where the others push, and their key."""
        opts = self.options
        if rank.pp_rank != 0 or rank.tp_rank != 0 or opts.port is None or opts.per_rank:
            return None
        return Endpoint(f"http://{opts.advertise or opts.host}:{opts.port}", secrets.token_bytes(32))

    def _serve(self, rank: Rank, endpoint: Endpoint | None) -> None:
        """Rank 0: the one endpoint; the others: push to it (per rank: each its own)."""
        opts = self.options
        if opts.port is None or rank.tp_rank != 0:
            return
        from stagecache.dashboard.server import dashboard_in_thread  # heavy: only when serving

        title = f"stagecache: {opts.model_name} (pp {rank.pp_size})"
        # the endpoint's and the pusher's threads read sglang's pools (torch calls): stopped before
        # the interpreter finalizes, which would kill them mid-call and abort the process
        atexit.register(self.close)
        if opts.per_rank or rank.pp_rank == 0:  # the ranks this endpoint compares: itself, or all
            self.source.enable_agreement(1 if opts.per_rank else rank.pp_size, self.agreement.drain,
                                         strict=opts.strict_agreement)
        if opts.per_rank:
            self.url = self._stack.enter_context(dashboard_in_thread(
                self.source, opts.host, opts.port + rank.pp_rank, title=title))
        elif rank.pp_rank == 0 and endpoint is not None:
            receiver = PushReceiver(endpoint.secret, rank.pp_size, self.source.put_remote,
                                    on_agreement=self.source.put_agreement)
            extra = [opts.advertise] if opts.advertise else []
            self.url = self._stack.enter_context(dashboard_in_thread(
                self.source, opts.host, opts.port, title=title, configure=receiver.add_route,
                extra_hosts=extra))
        elif endpoint is not None:
            self.pusher = Pusher(endpoint.url, endpoint.secret, rank.pp_rank, self.snapshot,
                                 opts.push_interval_s, extra=self.agreement.take,
                                 sent=self.agreement.sent).start()
            self.agreement.on_fatal = self._push_now
            self._stack.callback(self.pusher.stop)
        log.info("stagecache: PP rank %d %s", rank.pp_rank,
                 f"serves on {self.url}" if self.url else f"pushes to {endpoint.url if endpoint else '-'}")

    def _push_now(self) -> None:
        """sglang raised inside a scheduler step: push the step's records now (the process may be
        going), best effort."""
        pusher = self.pusher
        if pusher is None:
            return
        try:
            pusher.push_once()
        except (OSError, ValueError) as exc:
            log.warning("stagecache: PP rank %d could not push its last records: %s",
                        self.rank.pp_rank if self.rank else -1, exc)

    def close(self) -> None:
        """Stop the endpoint or the pusher (at interpreter exit; sglang never calls it)."""
        atexit.unregister(self.close)
        self._stack.close()


#: Environment of the sglang plugin (sglang gives plugins no arguments).
PLUGIN_ENV = {
    "STAGECACHE_SGLANG": "1 to register the hooks in every sglang scheduler process (default: off)",
    "STAGECACHE_SGLANG_STRICT": "0 to publish mapping errors and let sglang start anyway (default 1: "
                                "every rank refuses with the same message)",
    "STAGECACHE_SGLANG_DASHBOARD_PORT": "the deployment's one port, served by PP rank 0 (unset: no endpoint)",
    "STAGECACHE_SGLANG_DASHBOARD_HOST": f"address rank 0 binds (default {HOST}; 0.0.0.0 across hosts)",
    "STAGECACHE_SGLANG_ADVERTISE_HOST": "address the other ranks push to (default: the bind address)",
    "STAGECACHE_SGLANG_PER_RANK": "1: every rank is a deployment of size 1: it validates its own stage "
                                  "and serves it on PORT + pp_rank (no exchange, no push)",
    "STAGECACHE_SGLANG_EXCHANGE_TIMEOUT_S": f"seconds to wait for every rank at the record exchange "
                                            f"(default {SGLANG_EXCHANGE_TIMEOUT_S:g})",
    "STAGECACHE_SGLANG_PUSH_INTERVAL_S": f"seconds between pushes (default {SGLANG_PUSH_INTERVAL_S:g})",
    "STAGECACHE_SGLANG_PUSH_TIMEOUT_S": f"a rank silent this long is not ready (default {SGLANG_PUSH_TIMEOUT_S:g})",
    "STAGECACHE_SGLANG_SYNC_TRANSFERS": "1 to time transfers by their CUDA events (serialises copies)",
    "STAGECACHE_SGLANG_STRICT_AGREEMENT": "1: a PP divergence or an incomplete HiCache transfer makes /readyz "
                                          "answer 503 (default 0: a warning on /readyz, the dashboard, the log)",
    "STAGECACHE_SGLANG_MODEL_NAME": "the model_name label (default sglang)",
    "STAGECACHE_FAULT": "NAME[@STAGE]: plant a live fault on the ranks of that stage (default: every stage); "
                        "backup-without-indexer: backups leave the indexer pools out (sglang #38031), for the "
                        "transfer check to flag",
}

_PLUGIN: Deployment | None = None


def sglang_plugin() -> Deployment | None:
    """Entry point ``sglang.srt.plugins: stagecache``: sglang runs it first thing in every
    scheduler process (``load_plugins()``, which then applies the registered hooks).  Off
    unless ``STAGECACHE_SGLANG=1``, so installing stagecache never changes sglang silently.

    sglang ships every few weeks and the hooks read its internals: when a hooked function is
    missing or takes other parameters than the hooks expect, the plugin stays off with one log
    line naming what changed -- it never stops a server from starting."""
    global _PLUGIN
    if os.environ.get("STAGECACHE_SGLANG", "0") != "1" or _PLUGIN is not None:
        return _PLUGIN
    changed = changed_targets()
    if changed:
        import sglang

        log.warning("stagecache: sglang %s is not the sglang the plugin was tested with (%s): %s; "
                    "the plugin stays off", getattr(sglang, "__version__", "unknown"),
                    ", ".join(SGLANG_TESTED_VERSIONS), "; ".join(changed))
        return None
    _PLUGIN = Deployment(DeploymentOptions.from_env()).register()
    return _PLUGIN
