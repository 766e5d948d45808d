"""``stagecache bench sglang-hooks``: what the deployment's hooks cost sglang's own cache work.

One PP stage of a family's model, built with sglang's own objects on CPU (``cpu_stage``), replays
a multi-turn trace through two arms alternated round by round on fresh radix caches: plain
(sglang's match, insert, a page's backup and load, one ``check_hicache_events`` step) and hooked
(the same, wrapped by sglang's ``HookRegistry`` wrapper as a served rank runs it).  Each arm runs
with and without the page copies: on a GPU host the copies run on the copy engine beside the
scheduler thread, so the target is judged on the copy-free arm.  docs/sglang.md ("What the hooks
cost") describes the figures.  Needs sglang (``.venv-sglang``).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PAGE = 256
#: the stage's device rows the backups read and the loads write (inside a 16,384-token pool)
SRC_ROW, DST_ROW = 256, 512


class _Stage:
    """sglang's host pool group and controller of one stage, and one page's backup + load."""

    def __init__(self, group: Any, controller: Any, pools: tuple[str, ...] | None = None,
                 states: tuple[str, ...] = ()):
        import torch

        from ..integrations.sglang.cpu_stage import COMPRESSED_POOLS, StepLedger

        self.group, self.ctl = group, controller
        self.pools = COMPRESSED_POOLS if pools is None else pools
        # pools that move by request slot (a Mamba hybrid's state): slot 1 backed up, loaded into slot 2
        self.states = {name: (torch.tensor([1]), torch.tensor([2])) for name in states}
        self.src = torch.arange(SRC_ROW, SRC_ROW + PAGE)
        self.dst = torch.arange(DST_ROW, DST_ROW + PAGE)
        self.ledger = StepLedger(controller)
        self.page_bytes = 0
        self.tokens_by_pool: dict[str, int] = {}

    def backup_and_load(self, node: int) -> None:
        """One page to host and back, then sglang's step (its ack checks); the host slots are freed again."""
        from ..integrations.sglang.cpu_stage import round_trip

        host, hosts = round_trip(self.group, self.ctl, self.src, self.dst, node, self.pools, self.states)
        ack = self.ctl.ack_write_queue[-1]
        self.page_bytes, self.tokens_by_pool = ack.num_bytes, dict(ack.num_tokens_by_pool or {})
        self.ledger.step()
        self.group.free(host)
        for name, idx in hosts.items():
            self.group.free(idx, pool=name)


#: The families the bench runs (``--family``), DeepSeek V4 first.
FAMILIES = ("deepseek_v4", "linear_hybrid", "dsa", "swa_hybrid")
#: Tokens of another family's stage: the rows the backups read and the loads write, and room.
FAMILY_TOKENS = 2048


@contextlib.contextmanager
def _sglang_stage(family: str = "deepseek_v4") -> Iterator[_Stage]:
    """One PP-1 stage of the family's model built by sglang on CPU (DeepSeek-V4-Flash: 16,384
    tokens; another family's model: ``FAMILY_TOKENS``), with the HiCache stack of the assembler's
    own strategy for its pool."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as hpa

    from ..integrations.sglang.agreement import PAGE_POOLS
    from ..integrations.sglang.cpu_stage import (
        FAMILY_MODELS,
        build_family_pools,
        build_stage,
        cache_params,
        family_stack,
        gpu_gates,
        model_dir,
        on_cpu,
        published,
    )

    with tempfile.TemporaryDirectory(prefix="stagecache-bench-") as tmp, on_cpu():
        if family == "deepseek_v4":
            with published(model_dir(Path(tmp)), max_total_tokens=16_384, max_running_requests=4,
                           hicache_io_backend="direct", hicache_mem_layout="layer_first") as (sa, mc):
                stage = build_stage(sa, mc, 0, 1, device="cpu")
                group, ctl = hpa.build_deepseek_v4_hicache_stack(
                    params=cache_params(stage), kvcache=stage.kvcache, load_cache_event=None, storage_backend=None)
                yield _Stage(group, ctl)
            return
        model = FAMILY_MODELS[family]
        with gpu_gates(), published(model_dir(Path(tmp), model.preset), max_total_tokens=FAMILY_TOKENS,
                                    max_running_requests=4, hicache_io_backend="direct", **model.server) as (sa, mc):
            result = family_stack(build_family_pools(sa, mc), sa)
            yield _Stage(result.host_pool_group, result.cache_controller, tuple(PAGE_POOLS.get(family, {})),
                         states=("mamba",) if family == "linear_hybrid" else ())


@contextlib.contextmanager
def no_copies() -> Iterator[None]:
    """The page copies skipped (in every host pool module): what is left is the scheduler thread's
    part of a transfer."""
    from ..integrations.sglang.cpu_stage import COPY_OPS, copy_ops

    def skip(*a: Any, **k: Any) -> None:
        return None

    with copy_ops({module: dict.fromkeys(names, skip) for module, names in COPY_OPS.items()}):
        yield


def _trace(sessions: int, turns: int) -> list[tuple[str, array]]:
    """Multi-turn requests: each turn repeats its session's history and adds a page."""
    out = []
    for turn in range(1, turns + 1):
        for s in range(sessions):
            out.append((f"s{s}-t{turn}", array("q", (s * 1_000_000 + i for i in range(turn * PAGE)))))
    return out


def _round(trace: list[tuple[str, array]], match: Callable[..., Any], stage: _Stage) -> float:
    """Seconds of one arm over the trace, on a fresh radix cache."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    cache = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                              token_to_kv_pool_allocator=_Allocator(), page_size=PAGE,
                                              tree_components=(ComponentType.FULL,)))
    values = {len(k): torch.arange(len(k), dtype=torch.int64) for _, k in trace}
    gc.collect()
    gc.disable()  # a collection in one arm's round and not the other's is noise, not the hooks
    try:
        t0 = time.perf_counter()
        for node, (rid, key) in enumerate(trace):
            match(cache, MatchPrefixParams(key=RadixKey(key), req=_Req(rid)))
            cache.insert(InsertParams(key=RadixKey(key), value=values[len(key)]))
            stage.backup_and_load(2 * node)
        return time.perf_counter() - t0
    finally:
        gc.enable()


class _Allocator:
    """Takes back the duplicate indices ``insert`` frees (sglang's allocator would reuse them)."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed = 0

    def free_segment(self, indices: Any, start_pos: int = 0) -> None:
        self.freed += len(indices) - start_pos

    def free(self, indices: Any) -> None:
        self.freed += len(indices)


class _Req:
    """What ``match_prefix`` reads of a request outside a session: its id, no session."""

    __slots__ = ("rid", "session")

    def __init__(self, rid: str):
        self.rid = rid
        self.session = None


class _AckOnlyController:
    """Queues a prebuilt ack (the stage's real page: its pools' tokens and bytes) and does nothing
    else: what remains of a wrapped call is the wrapper, the ack's plan check included."""

    def __init__(self, tokens_by_pool: dict[str, int], num_bytes: int) -> None:
        from sglang.srt.managers.cache_controller import HiCacheAck

        self.ack_write_queue: list[Any] = []
        self.ack_load_queue: list[Any] = []
        self.write_queue: list[Any] = []
        self.load_queue: list[Any] = []
        self._ack = HiCacheAck(start_event=None, finish_event=None, node_ids=[0], num_tokens=PAGE,
                               num_bytes=num_bytes, num_tokens_by_pool=tokens_by_pool)

    def start_writing(self) -> None:
        self.ack_write_queue.append(self._ack)

    def start_loading(self) -> int:
        self.ack_load_queue.append(self._ack)
        return 0


@contextlib.contextmanager
def _hooked(obj: Any, cls: type, hooks: dict[str, tuple[str, Callable[..., Any]]]) -> Iterator[None]:
    """``obj``'s methods wrapped as sglang's ``HookRegistry`` wraps ``cls``'s in a served rank
    (AROUND; on the class there, on this instance for the block here, so the plain arm keeps the
    bare ones).  ``hooks``: attribute -> (the function of ``cls`` it runs, the hook)."""
    import types

    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    for attr, (name, hook) in hooks.items():
        setattr(obj, attr, types.MethodType(_wrap_fn(getattr(cls, name), hook, HookType.AROUND), obj))
    try:
        yield
    finally:
        for attr in hooks:
            obj.__dict__.pop(attr, None)


def _step_hooks(dep: Any) -> dict[str, tuple[str, Callable[..., Any]]]:
    """The agreement's hooks on a ``StepLedger``: its step (sglang's ``check_hicache_events``) and
    ack checks."""
    a = dep.agreement
    return {"step": ("check_hicache_events", a.around_check_hicache_events),
            "writing_check": ("writing_check", a.around_writing_check),
            "loading_check": ("loading_check", a.around_loading_check)}


def _submit_hooks(dep: Any) -> dict[str, tuple[str, Callable[..., Any]]]:
    """The deployment's hooks on a controller's backup and load submissions."""
    return {"start_writing": ("start_writing", dep.around_start_writing),
            "start_loading": ("start_loading", dep.around_start_loading)}


def _hooks_alone(trace: list[tuple[str, array]], dep: Any, stage: _Stage) -> float:
    """Seconds of the hooks' own work for the trace: the match hook on real match results (with its
    agreement record), a wrapped minus a bare backup + load submission per request (each ack
    checked against the stage's plan), and a wrapped minus a bare scheduler step of sglang's
    ``check_hicache_events`` (an A/B difference of whole requests drowns in the noise of the
    transfers)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from ..integrations.sglang.cpu_stage import StepLedger

    dep.forget_requests()
    dep.agreement.drain()
    calls = [(MatchResult(device_prefix_len=len(k) - PAGE, last_device_node=None, last_host_node=None,
                          best_match_node=None), MatchPrefixParams(key=RadixKey(k), req=_Req(rid)))
             for rid, k in trace]
    t0 = time.perf_counter()
    for result, params in calls:
        dep.after_match_prefix(result, None, params)
    match_s = time.perf_counter() - t0
    ctl = _AckOnlyController(stage.tokens_by_pool, stage.page_bytes)

    def acks() -> float:
        t = time.perf_counter()
        for _ in trace:
            ctl.start_writing()
            ctl.start_loading()
        ctl.ack_write_queue.clear()
        ctl.ack_load_queue.clear()
        return time.perf_counter() - t

    bare = min(acks() for _ in range(3))
    with _hooked(ctl, type(ctl), _submit_hooks(dep)):
        wrapped = min(acks() for _ in range(3))
    ledger = StepLedger(stage.ctl)

    def steps() -> float:
        dep.agreement.drain()  # what the rank's push takes every second
        t = time.perf_counter()
        for _ in trace:
            ledger.step()
        return time.perf_counter() - t

    bare_steps = min(steps() for _ in range(3))
    with _hooked(ledger, UnifiedRadixCache, _step_hooks(dep)):
        wrapped_steps = min(steps() for _ in range(3))
    return match_s + max(0.0, wrapped - bare) + max(0.0, wrapped_steps - bare_steps)


def _arms(trace: list[tuple[str, array]], stage: _Stage, dep: Any, rounds: int) -> dict[str, list[float]]:
    """Seconds per round of the plain and the hooked arm, alternated."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    plain_match = UnifiedRadixCache.match_prefix
    hooked_match = _wrap_fn(plain_match, dep.after_match_prefix, HookType.AFTER)

    def hooked_round() -> float:
        dep.forget_requests()  # every round's requests are new to the hook
        dep.agreement.drain()
        with _hooked(stage.ledger, UnifiedRadixCache, _step_hooks(dep)), \
                _hooked(stage.ctl, type(stage.ctl), _submit_hooks(dep)):
            return _round(trace, hooked_match, stage)

    _round(trace, plain_match, stage)  # warm-up, both arms
    hooked_round()
    plain, hooked = [], []
    for _ in range(rounds):
        plain.append(_round(trace, plain_match, stage))
        hooked.append(hooked_round())
    return {"plain_seconds": plain, "hooked_seconds": hooked}


def _ratios(arms: dict[str, list[float]], hooks_s: float) -> dict[str, Any]:
    plain, hooked = arms["plain_seconds"], arms["hooked_seconds"]
    base = min(plain)
    return {
        **arms, "plain_min_s": base, "hooked_min_s": min(hooked),
        "hooks_alone_ratio": hooks_s / base,
        "overhead_ratio_min": (min(hooked) - base) / base,
        "overhead_ratio_median": (statistics.median(hooked) - statistics.median(plain)) / statistics.median(plain),
    }


def run_bench(sessions: int = 32, turns: int = 8, rounds: int = 7, family: str = "deepseek_v4") -> dict[str, Any]:
    """Seconds of each arm per round, and the hooks' share of sglang's work, for one family's
    stage (JSON-able)."""
    import logging

    import torch

    from ..integrations.sglang.agreement import TransferPlan
    from ..integrations.sglang.deployment import Deployment, Rank

    logging.getLogger("sglang").setLevel(logging.WARNING)
    torch.set_num_threads(1)  # sglang's scheduler is one thread; a second copy thread is noise here
    trace = _trace(sessions, turns)
    dep = Deployment()
    dep.rank = Rank(pp_rank=0, pp_size=1, tp_rank=0, tp_size=1)
    from ..integrations.sglang.agreement import PAGE_POOLS

    with _sglang_stage(family) as stage:
        # the stage's plan: every page moves the rows of the family's page pools (DeepSeek V4's C4,
        # indexer and C128, DSA's indexer); the acks are checked against it
        dep.agreement.plan = TransferPlan.of(family, {k: [True] for k in PAGE_POOLS.get(family, {}).values()},
                                             stage.group, int(getattr(stage.ctl, "page_size", PAGE)))
        with_copies = _arms(trace, stage, dep, rounds)
        with no_copies():
            without = _arms(trace, stage, dep, rounds)
            live = dep.source.stages()[0]  # what the hooked arms counted (the next step counts more)
            records = dep.agreement.drain()
            hooks_s = min(_hooks_alone(trace, dep, stage) for _ in range(rounds))
        page_bytes = stage.page_bytes
    judged = _ratios(without, hooks_s)
    return {
        "family": family, "model": _model_of(family),
        "requests_per_round": len(trace), "rounds": rounds, "page_bytes_moved": page_bytes,
        "hooks_alone_s": hooks_s, "hooks_alone_us_per_request": 1e6 * hooks_s / len(trace),
        "without_copies": judged, "with_copies": _ratios(with_copies, hooks_s),
        "counted_tokens": live.cache_tokens.model_dump(),
        "counted_transfer_bytes": live.transfer_bytes.model_dump(),
        "agreement_records_last_round": {"requests": len(records.requests), "steps": len(records.steps),
                                         "incomplete_transfers": len(records.backups)},
        "target": "without_copies.hooks_alone_ratio < 0.01",
        "meets_target": judged["hooks_alone_ratio"] < 0.01,
        "note": f"sglang 0.5.23's own objects on CPU: one {_model_of(family)} stage, its UnifiedRadixCache "
                f"match/insert, its HybridCacheController backing up and loading each request's page of "
                f"{_MOVED[family]}, one check_hicache_events step per request (its ack sync and "
                "writing_check/loading_check). hooks_alone_ratio: the hooks' own seconds, PP agreement "
                "included (match hook and its record on real match results, wrapped minus bare ack "
                "submission with each ack's plan check, wrapped minus bare check_hicache_events step with "
                "its ack counts) over the plain arm's fastest round; overhead_ratio_*: the A/B difference "
                "(noisy on a shared machine). without_copies skips the page copies, which on a GPU run "
                "on the copy engine beside the scheduler thread: the target is judged there",
    }


#: What one request's backup moves, per family (the note of its report).
_MOVED = {"deepseek_v4": "the C4, indexer and C128 pools",
          "linear_hybrid": "the attention KV pool and of the request's Mamba state slot (conv + SSM, every layer)",
          "dsa": "the MLA KV and indexer pools", "swa_hybrid": "the full-attention KV sub-pool"}


def _model_of(family: str) -> str:
    from ..integrations.sglang.cpu_stage import FAMILY_MODELS, FLASH

    return FLASH if family == "deepseek_v4" else FAMILY_MODELS[family].preset


def run_families(families: tuple[str, ...] = FAMILIES, sessions: int = 32, turns: int = 8,
                 rounds: int = 7) -> dict[str, Any]:
    """``run_bench`` for each family, one after the other; the target must hold for every one."""
    reports = {f: run_bench(sessions, turns, rounds, family=f) for f in families}
    return {"families": reports, "meets_target": all(r["meets_target"] for r in reports.values()),
            "target": "every family: without_copies.hooks_alone_ratio < 0.01"}
