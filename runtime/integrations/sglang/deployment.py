"""A live sglang PP deployment as one instrument: plans exchanged, one endpoint, sglang's own numbers.

sglang loads plugins first thing in each scheduler process, before its distributed state
exists, so nothing can be exchanged then.  ``Deployment.register()`` instead registers hooks
with sglang's ``HookRegistry`` (applied by ``load_plugins`` right after), on calls every PP
rank reaches in ``Scheduler.__init__`` in the same order:

* ``KVCacheConfigurator._apply_token_constraints`` (AROUND): its argument is the token
  capacity this stage's budget fits alone, its result the deployment's (sglang's MIN over
  the ranks) -- the capacity ledger;
* ``build_deepseek_v4_hicache_stack`` (AROUND), or ``KVCacheConfigurator._init_pools`` when
  HiCache is off: the rank reads its live pool into a ``StageRecord``, the ranks exchange
  records over ``get_pp_group().cpu_group`` (``exchange.py``), and every rank validates the
  whole deployment (``record.deployment_report``).  Strict: every rank raises the same
  ``StageMappingInvalid``; otherwise the errors are published and sglang goes on.
  Then rank 0 serves the one dashboard (every stage, ``/readyz``, ``/metrics`` with
  ``pp_rank``) and the other ranks push their numbers to it (``push.py``);
* ``UnifiedRadixCache.match_prefix`` (AFTER): device-hit, host-hit and miss tokens of each
  request's first match; the controller's ``start_writing``/``start_loading`` acks (wrapped
  on the instance the stack build returns): backup and load bytes and seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...defaults import (
    HOST,
    SGLANG_DASHBOARD_PORT,
    SGLANG_EXCHANGE_TIMEOUT_S,
    SGLANG_PUSH_INTERVAL_S,
    SGLANG_PUSH_TIMEOUT_S,
)
from ...errors import ConfigError, StageMappingInvalid
from ...live.numbers import CapacityLive, PageSpace, PoolBytes, StageLive
from ...validation.report import StartupReport
from .exchange import exchange_records
from .hooks import SglangSource, wrap_controller
from .push import Pusher, PushReceiver
from .reader import model_num_layers
from .record import StageRecord, deployment_report, parse_records, stage_record, stranded_bytes

log = logging.getLogger(__name__)

#: sglang 0.5.23 functions the deployment hooks (``HookRegistry`` targets).
TARGETS = {
    "capacity": "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._apply_token_constraints",
    "pools": "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._init_pools",
    "stack": "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler.build_deepseek_v4_hicache_stack",
    "match": "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.match_prefix",
}
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


def _is_dsv4_pool(pool: Any) -> bool:
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return isinstance(pool, DeepSeekV4TokenToKVPool)


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


def stage_live(rec: StageRecord, model_name: str) -> StageLive:
    """A stage's start-up numbers from its record: layers, pool bytes, capacity, host pages."""
    cap = rec.capacity
    used = sum(rec.pool_bytes.values())
    spaces = {}
    if rec.host_pages.get("full"):
        spaces["host"] = PageSpace(tier="host", used=0, total=rec.host_pages["full"] * rec.fingerprint.page_size,
                                   pools=["full"])
    return StageLive(
        stage=rec.stage, model_name=model_name, start_layer=rec.start, end_layer=rec.end,
        local_layers=rec.end - rec.start,
        pool_bytes={p: PoolBytes(device=b) for p, b in rec.pool_bytes.items()},
        capacity=CapacityLive(tokens_alone=cap.tokens_alone, tokens=cap.tokens, used_bytes=used,
                              stranded_bytes=stranded_bytes(rec)) if cap else CapacityLive(used_bytes=used),
        page_spaces=spaces,
    )


class Deployment:
    """This scheduler process's part of the deployment (one per process: ``sglang_plugin``)."""

    def __init__(self, options: DeploymentOptions | None = None):
        self.options = options or DeploymentOptions()
        self.source = SglangSource(self.options.model_name,
                                   push_timeout_s=None if self.options.per_rank else self.options.push_timeout_s)
        self.source.count_loads_as_hits = False  # host hits come from sglang's match results
        self.capacity: tuple[int, int] | None = None
        self.rank: Rank | None = None
        self.report: StartupReport | None = None
        self.url: str | None = None
        self.pusher: Pusher | None = None
        self.host_pool: Any = None  # sglang's HostPoolGroup, once the stack is built
        self._matched: OrderedDict[str, None] = OrderedDict()
        self._stack = contextlib.ExitStack()
        self._restorers: list[Callable[[], None]] = []
        self._joined = False

    # -- registration ---------------------------------------------------------------------
    def register(self) -> Deployment:
        """Register the hooks with sglang's ``HookRegistry`` (``load_plugins`` applies them)."""
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(TARGETS["capacity"], self.around_token_constraints, HookType.AROUND)
        HookRegistry.register(TARGETS["pools"], self.around_init_pools, HookType.AROUND)
        HookRegistry.register(TARGETS["stack"], self.around_stack_build, HookType.AROUND)
        HookRegistry.register(TARGETS["match"], self.after_match_prefix, HookType.AFTER)
        return self

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
        if not get_server_args().enable_hierarchical_cache and _is_dsv4_pool(pool):
            self.join(pool, page_size=int(configurator.page_size), host_pages={})
        return pools

    def around_stack_build(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Exchange and validate before sglang builds host pools; count the controller's transfers."""
        kvcache, params = kwargs.get("kvcache"), kwargs.get("params")
        if kvcache is None or params is None:
            raise ConfigError("build_deepseek_v4_hicache_stack called without kvcache= and params=")
        self.join(kvcache, page_size=int(params.page_size), host_pages=_host_pages(params, kvcache))
        host_pool_group, controller = original(*args, **kwargs)
        stage = self.rank.pp_rank if self.rank else 0
        self._restorers.append(wrap_controller(controller, self.source, stage, self.options.sync_transfers))
        self.host_pool = host_pool_group
        self.source.on_read = self._refresh_host_used
        return host_pool_group, controller

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
        self.source.record_lookup(self.rank.pp_rank, device, host, max(0, len(params.key) - device - host))
        return None

    def forget_requests(self) -> None:
        """Count the next match of every request id again (a benchmark replays the same ids)."""
        self._matched.clear()

    # -- the exchange ------------------------------------------------------------------------
    def join(self, kvcache: Any, *, page_size: int, host_pages: dict[str, int]) -> StartupReport:
        """Record, exchange, validate, publish, serve; strict: every rank raises the same error."""
        if self._joined:
            raise ConfigError("stagecache: this sglang process built a second KV cache stack; "
                              "the plan exchange runs once per scheduler process")
        self._joined = True
        rank = self.rank = _this_rank()
        n = model_num_layers([kvcache], rank.pp_size)
        record = stage_record(kvcache, stage=rank.pp_rank, pp_size=rank.pp_size, tp_size=rank.tp_size,
                              num_layers=n, model_name=self.options.model_name, page_size=page_size,
                              capacity=self.capacity, host_pages=host_pages)
        push_secret = secrets.token_bytes(32) if rank.pp_rank == 0 else b""
        if self._serves_deployment(rank):
            host = self.options.advertise or self.options.host
            record = record.model_copy(update={"push_url": f"http://{host}:{self.options.port}",
                                               "push_secret": push_secret.hex()})
        raw = ([record.model_dump(mode="json")] if rank.pp_size == 1 else
               exchange_records(record.model_dump(mode="json"), _pp_cpu_group(), self.options.exchange_timeout_s))
        records = parse_records(raw, rank.pp_size)
        report = self.report = deployment_report(records, rank.tp_size)
        self.source.publish_deployment(
            report, {r.stage: stage_live(r, self.options.model_name) for r in records
                     if not self.options.per_rank or r.stage == rank.pp_rank}, rank.pp_rank)
        if not report.ok:
            for err in report.all_errors:
                log.error("stagecache: %s", err)
            if self.options.strict:
                raise StageMappingInvalid(report.all_errors)
        self._serve(rank, records, push_secret)
        return report

    def _serves_deployment(self, rank: Rank) -> bool:
        return (rank.pp_rank == 0 and rank.tp_rank == 0 and self.options.port is not None
                and not self.options.per_rank)

    def _serve(self, rank: Rank, records: list[StageRecord], push_secret: bytes) -> None:
        """Rank 0: the one endpoint; the others: push to it (or, per rank, each its own)."""
        opts = self.options
        if opts.port is None or rank.tp_rank != 0:
            return
        from stagecache.dashboard.server import dashboard_in_thread  # heavy: only when serving

        title = f"stagecache: {opts.model_name} (pp {rank.pp_size})"
        if opts.per_rank:
            self.url = self._stack.enter_context(dashboard_in_thread(
                self.source, opts.host, opts.port + rank.pp_rank, title=title))
        elif rank.pp_rank == 0:
            receiver = PushReceiver(push_secret, rank.pp_size, self.source.put_remote)
            extra = [opts.advertise] if opts.advertise else []
            self.url = self._stack.enter_context(dashboard_in_thread(
                self.source, opts.host, opts.port, title=title, configure=receiver.add_route,
                extra_hosts=extra))
        elif records[0].push_url and records[0].push_secret:
            self.pusher = Pusher(records[0].push_url, bytes.fromhex(records[0].push_secret), rank.pp_rank,
                                 self.snapshot, opts.push_interval_s).start()
            self._stack.callback(self.pusher.stop)
        log.info("stagecache: PP rank %d %s", rank.pp_rank,
                 f"serves the deployment on {self.url}" if self.url else f"pushes to {records[0].push_url}")

    def close(self) -> None:
        """Stop the endpoint or the pusher and unwrap the controllers (tests; sglang never calls it)."""
        self._stack.close()
        for restore in self._restorers:
            restore()
        self._restorers.clear()


#: Environment of the sglang plugin (sglang gives plugins no arguments).
PLUGIN_ENV = {
    "STAGECACHE_SGLANG": "1 to register the hooks in every sglang scheduler process (default: off)",
    "STAGECACHE_SGLANG_STRICT": "0 to publish mapping errors and let sglang start anyway (default 1: "
                                "every rank refuses with the same message)",
    "STAGECACHE_SGLANG_DASHBOARD_PORT": "the deployment's one port, served by PP rank 0 (unset: no endpoint)",
    "STAGECACHE_SGLANG_DASHBOARD_HOST": f"address rank 0 binds (default {HOST}; 0.0.0.0 across hosts)",
    "STAGECACHE_SGLANG_ADVERTISE_HOST": "address the other ranks push to (default: the bind address)",
    "STAGECACHE_SGLANG_PER_RANK": "1: every rank serves its own stage on PORT + pp_rank instead (no push)",
    "STAGECACHE_SGLANG_EXCHANGE_TIMEOUT_S": f"seconds to wait for every rank at the plan exchange "
                                            f"(default {SGLANG_EXCHANGE_TIMEOUT_S:g})",
    "STAGECACHE_SGLANG_PUSH_INTERVAL_S": f"seconds between pushes (default {SGLANG_PUSH_INTERVAL_S:g})",
    "STAGECACHE_SGLANG_PUSH_TIMEOUT_S": f"a rank silent this long is not ready (default {SGLANG_PUSH_TIMEOUT_S:g})",
    "STAGECACHE_SGLANG_SYNC_TRANSFERS": "1 to time transfers by their CUDA events (serialises copies)",
    "STAGECACHE_SGLANG_MODEL_NAME": "the model_name label (default sglang)",
}

_PLUGIN: Deployment | None = None


def sglang_plugin() -> Deployment | None:
    """Entry point ``sglang.srt.plugins: stagecache``: sglang runs it first thing in every
    scheduler process (``load_plugins()``, which then applies the registered hooks).  Off
    unless ``STAGECACHE_SGLANG=1``, so installing stagecache never changes sglang silently."""
    global _PLUGIN
    if os.environ.get("STAGECACHE_SGLANG", "0") != "1" or _PLUGIN is not None:
        return _PLUGIN
    _PLUGIN = Deployment(DeploymentOptions.from_env()).register()
    return _PLUGIN
