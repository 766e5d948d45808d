"""``stagecache bench hicache``: replay a trace through each stage's HiCache, with its bounds.

One run, same trace, same page size, same device pages per stage: ``hicache`` (device + host
tier, the configuration under test), ``device_only`` (no host tier: what HiCache adds is the
difference), ``ceiling`` (an infinite cache) and ``belady`` (the offline bound at the host tier's
capacity, ``sizing/bounds.py``).  docs/hicache.md describes the modes and flags.

``--metadata-only`` replays the cache once with no tensors: every stage sees the same requests
and has the same page-id space, so its decisions are the same, and each stage's bytes are its
pages moved times its bytes per page; the transfer time they imply uses a bandwidth measured in
the same run by real copies.  Payload mode replays each stage on its real pools (``--verify``:
every reused page checked against the bytes written for it; a mismatch exits 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import resource
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..plan.plan import RunPlan, Sizing, StagePlan
from ..transfer.stats import gbps
from .insight_overhead import (
    OVERHEAD_BUDGET_PERCENT,
    direct,
    insight_config,
    measure,
    timed,
    timer_floor,
)

DEFAULT_REQUESTS = 2000
#: The most requests one replay takes (generated, or read from a trace): every request's tokens
#: stay in memory for the whole replay, so the bound keeps a typo from exhausting RAM.  The
#: public Mooncake traces have at most ~24,000 lines.
MAX_REQUESTS = 100_000
#: Bytes per direction of the same-run bandwidth measurement.
BANDWIDTH_PROBE_BYTES = 32 << 20


# -- replay -------------------------------------------------------------------------------------
@dataclass
class ReplayResult:
    requests: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # the replaying thread's CPU time (other processes' load not counted)
    pages_verified: int = 0
    bytes_verified: int = 0
    bytes_written: int = 0
    stalls: int = 0  # begins that had to wait for a running request to finish (pages)
    mismatch_count: int = 0
    mismatches: list[Any] = field(default_factory=list)  # the first few, as Mismatch

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 3),
                "cpu_seconds": round(self.cpu_seconds, 6), "mismatches": [str(m) for m in self.mismatches]}


def replay(requests: Sequence[Any], cache: Any, writer: Any | None = None, verify: bool = False,
           concurrency: int = 1, check_every: int = 0, keep_mismatches: int = 20) -> ReplayResult:
    """Run ``requests`` through ``cache`` with up to ``concurrency`` requests in flight.

    Per request: ``begin`` (match, load, allocate, lock), optional check of the
    reused pages, the simulated forward pass (``writer.write`` of the new
    pages), and ``finish`` when the request leaves the in-flight window, so
    with ``concurrency > 1`` several requests hold locks at once.
    """
    from ..memory.allocator import OutOfPagesError

    out = ReplayResult()
    t0, c0 = time.perf_counter(), time.thread_time()
    window: deque[Any] = deque()
    token_page_bytes = writer.pools.token_page_bytes() if writer is not None else 0
    for i, req in enumerate(requests):
        if len(window) >= concurrency:
            cache.finish(window.popleft())
        while True:
            try:
                handle = cache.begin(req)
                break
            except OutOfPagesError:
                if not window:
                    raise  # nothing running to wait for: the request cannot fit at all
                cache.finish(window.popleft())  # as a scheduler would: wait for a running one
                out.stalls += 1
        if writer is not None:
            if verify and handle.matched_pages:
                bad = writer.verify(handle.prefix_hashes, handle.prefix_pages)
                out.pages_verified += handle.matched_pages
                out.bytes_verified += handle.matched_pages * token_page_bytes
                out.mismatch_count += len(bad)
                room = keep_mismatches - len(out.mismatches)
                out.mismatches.extend(bad[:max(room, 0)])
            out.bytes_written += writer.write(handle.new_hashes, handle.new_pages)
        window.append(handle)
        if check_every and (i + 1) % check_every == 0:
            cache.check()
        out.requests += 1
    while window:
        cache.finish(window.popleft())
    if check_every:
        cache.check()
    out.seconds = time.perf_counter() - t0
    out.cpu_seconds = time.thread_time() - c0
    return out


# -- inputs ---------------------------------------------------------------------------------------
def _load_requests(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    from ..errors import ConfigError
    from ..traces.readers import WorkloadConfig, generate, load_requests, write_trace

    if args.trace:
        trace = load_requests(args.trace, fmt=args.trace_format, limit=args.requests,
                              skip_bad=args.skip_bad_lines, block_tokens=args.block_tokens)
        reqs = list(trace.requests)
        if args.requests is not None and len(reqs) < args.requests:
            raise ConfigError(f"--requests {args.requests}: trace {args.trace} has only "
                              f"{len(reqs)} good requests")
        info = {"source": str(args.trace), "format": trace.format, "lines_read": trace.lines_read,
                "skipped_lines": [str(e) for e in trace.errors], "bad_lines": trace.bad_lines}
    else:
        cfg = WorkloadConfig(seed=args.seed, requests=args.requests or DEFAULT_REQUESTS,
                             think_time_s=args.think_time, session_gap_s=args.session_gap)
        reqs = generate(cfg)
        info = {"source": "generated", "format": "tokens", "seed": args.seed,
                "think_time_s": args.think_time, "session_gap_s": args.session_gap,
                "sessions": len({r.session for r in reqs})}
    if args.save_trace:
        write_trace(args.save_trace, reqs)
        info["saved_to"] = args.save_trace
    info.update(requests=len(reqs), input_tokens=sum(r.input_len for r in reqs),
                output_tokens=sum(r.output_len for r in reqs))
    return reqs, info


def page_size_for(args: argparse.Namespace, fmt: str) -> int:
    """Tokens format: ``--page-size``; Mooncake: one block is one page (``--block-tokens``)."""
    from ..errors import ConfigError

    if fmt != "mooncake":
        return args.page_size or args.default_page_size
    if args.page_size and args.page_size != args.block_tokens:
        raise ConfigError(f"--page-size {args.page_size}: in Mooncake format one block is one page; "
                          f"the page size is --block-tokens ({args.block_tokens})")
    return args.block_tokens


def check_stage_ram(plan: RunPlan, stages: Sequence[int], device_in_ram: bool, min_pages: int) -> None:
    """Before any pool exists: the largest stage's pools must fit this host's RAM.

    The payload replay builds one stage's pools at a time (and frees them), so the
    largest stage counts, not the sum; the error names --device-pages and
    --hicache-ratio with values that fit.
    """
    from ..memory.ram_check import check_ram, stages_ram_need

    needs = [stages_ram_need(plan, device_in_ram, stages=[i]) for i in stages]
    where = "device + host pools" if device_in_ram else "host pools"
    check_ram(lambda pages, r: max(n(pages, r) for n in needs), plan.stage(0).device_pages,
              plan.sizing.hicache_ratio, f"one stage's {where} (the largest of {len(stages)})",
              min_pages=min_pages)


def measure_bandwidth(plan: RunPlan, stage: int, device: str) -> dict[str, float]:
    """GB/s per direction of real page copies through the transfer controller, this run.

    A few pages (``BANDWIDTH_PROBE_BYTES``) copied device->host and back on the
    same kind of pools the payload mode uses; the rate is the transfer layer's
    own figure (``TransferStats``).
    """
    import torch

    from ..memory.host_pools import HostPools
    from ..memory.pools import StagePools
    from ..transfer.controller import TransferController
    from ..transfer.stats import TransferStats

    pages = max(1, min(256, BANDWIDTH_PROBE_BYTES // plan.stage(stage).token_page_bytes))
    pools = StagePools(plan.resized(Sizing.runtime(pages, host_pages=pages)).stage(stage), device)
    host = HostPools(pools)
    stats = TransferStats()
    ctrl = TransferController(pools, host, stats)
    ids = pools.allocator.alloc(pages)  # transfers move allocated pages only
    host_ids = host.allocator.alloc(pages)

    def sync() -> None:
        ctrl.synchronize()
        if pools.device.type == "cuda":
            torch.cuda.synchronize(pools.device)

    ctrl.backup(ids, host_ids)  # warm-up: first-touch page faults, kernel compilation
    ctrl.load(host_ids, ids)
    sync()
    before = stats.live()
    for _ in range(2):
        ctrl.backup(ids, host_ids)
        ctrl.load(host_ids, ids)
    sync()
    after = stats.live()
    return {d: gbps(getattr(after.transfer_bytes, d) - getattr(before.transfer_bytes, d),
                    getattr(after.transfer_seconds, d) - getattr(before.transfer_seconds, d))
            for d in ("d2h", "h2d")}


# -- runs -------------------------------------------------------------------------------------------
def _stats_row(cache: Any, result: Any, page_bytes: int, device_pages: int) -> dict[str, Any]:
    row = cache.stats.to_dict()
    if cache.insight is not None:
        row["insight"] = cache.insight.to_dict()
    row.update(device_pages=device_pages,
               host_pages=cache.host_alloc.num_pages if cache.host_alloc is not None else 0,
               token_page_bytes=page_bytes, replay=result.to_dict(),
               moved_bytes={d: n * page_bytes for d, n in row["moved_pages"].items()})
    return row


def _payload_run(stage: StagePlan, reqs: Sequence[Any], args: argparse.Namespace,
                 host: bool, insight: bool | None = None, l3: Any = None) -> dict[str, Any]:
    import torch

    from ..cache.hicache import HiCache
    from ..cache.kv_writer import KvWriter
    from ..memory.pools import StagePools

    pools = StagePools(stage, args.device)
    host_pools = controller = None
    if host:
        from ..memory.host_pools import HostPools
        from ..transfer.controller import TransferController
        from ..transfer.stats import TransferStats

        host_pools = HostPools(pools, layout=args.hicache_layout)
        controller = TransferController(pools, host_pools, TransferStats())
    storage = l3(stage.stage, host_pools) if l3 is not None and host_pools is not None else None
    cache = timed(HiCache(pools, host_pools, controller, write_policy=args.write_policy,
                          eviction_policy=args.eviction_policy, insight=insight_config(args, insight),
                          storage=storage))
    writer = KvWriter(pools, seed=args.seed)
    result = replay(reqs, cache, writer, verify=args.verify, concurrency=args.concurrency,
                    check_every=args.check_every)
    if controller is not None:
        controller.synchronize()
    if pools.device.type == "cuda":
        torch.cuda.synchronize(pools.device)
    row = _stats_row(cache, result, pools.token_page_bytes(), args.device_pages)
    if storage is not None:
        row["l3"] = storage.to_dict()
        storage.store.close()
    return row


def _metadata_run(views: Sequence[Any], page_size: int, host_pages: int,
                  args: argparse.Namespace, insight: bool | None = None) -> tuple[Any, Any]:
    from ..cache.hicache import HiCache

    cache = HiCache.metadata_only(page_size, args.device_pages, host_pages,
                                  write_policy=args.write_policy,
                                  eviction_policy=args.eviction_policy,
                                  insight=insight_config(args, insight))
    if insight is None:  # a reported run: the insight times its own calls
        timed(cache)
    result = replay(views, cache, concurrency=args.concurrency, check_every=args.check_every)
    return cache, result


def _run_modes(plan: RunPlan, stages: list[StagePlan], reqs: list[Any], views: list[Any], host_pages: int,
               args: argparse.Namespace, l3: Any = None) -> tuple[dict[str, list[dict[str, Any]]], dict[str, int]]:
    """Per mode, one row per stage; and the cached pages (tree nodes) each mode ended with."""
    modes: dict[str, list[dict[str, Any]]] = {"hicache": [], "device_only": []}
    nodes: dict[str, int] = {}
    if not args.metadata_only:
        for sm in stages:
            modes["hicache"].append(_payload_run(sm, reqs, args, host=True, l3=l3))
            modes["device_only"].append(_payload_run(sm, reqs, args, host=False))
        return modes, nodes
    for mode, pages in (("hicache", host_pages), ("device_only", 0)):
        cache, result = _metadata_run(views, plan.page_size, pages, args)
        for sm in stages:
            modes[mode].append(_stats_row(cache, result, sm.token_page_bytes, args.device_pages))
        nodes[mode] = cache.tree.num_nodes
    return modes, nodes


def _overhead(plan: RunPlan, views: list[Any], host_pages: int, args: argparse.Namespace,
              modes: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """What the insight costs the reported stage-0 replay (``insight_overhead.py``): its own
    calls in that replay, and the paired metadata-only cross-check; None when off."""
    row = modes["hicache"][0]
    if "insight" not in row:
        return None
    out = {"method": "the insight's own calls in the reported stage-0 replay (perf_counter, less "
                     "the timer's own cost per call), as a share of that replay without them",
           **direct(row, timer_floor()), "budget_percent": OVERHEAD_BUDGET_PERCENT, "paired": None}
    if getattr(args, "insight_overhead", 0):
        def run(on: bool) -> float:
            return _metadata_run(views, plan.page_size, host_pages, args, insight=on)[1].cpu_seconds

        out["paired"] = measure(run, args.insight_overhead, row["replay"]["cpu_seconds"])
    return out


@contextlib.contextmanager
def l3_tiers(args: argparse.Namespace, plan: RunPlan) -> Iterator[Any]:
    """``(stage, host pools) -> StorageTier`` for ``--l3``, over one store that starts empty (a
    private temporary directory, or a local mooncake_master), or None without ``--l3``."""
    from ..cache.storage_tier import StorageTier
    from ..storage.options import open_store
    from ..storage.views import HostPageViews

    opts = getattr(args, "l3_options", None)
    if opts is None or not opts.enabled:
        yield None
        return
    with contextlib.ExitStack() as stack:
        if opts.backend == "file" and not opts.dir:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="stagecache-bench-l3-"))
            opts = dataclasses.replace(opts, dir=os.path.join(tmp, "l3"))
        if opts.backend == "mooncake" and not opts.mooncake_master:
            from ..storage.master import MooncakeMaster

            master = stack.enter_context(MooncakeMaster())
            opts = dataclasses.replace(opts, mooncake_master=master.address)

        def tier(stage: int, host_pools: Any) -> StorageTier:
            store, space = open_store(opts, plan, stage)
            if opts.reset and stage == 0:
                store.reset()
            return StorageTier(store, space, HostPageViews(host_pools))

        yield tier


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ..cache.pages import page_view
    from ..errors import ConfigError
    from ..plan.inputs import resolve_plan
    from ..sizing.bounds import CeilingTracker, belady_hit_tokens
    from .hicache_report import build_report

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)  # a device this machine has: the command checked it
    t0 = time.perf_counter()
    reqs, trace_info = _load_requests(args)
    plan = resolve_plan(args.model, args.pp_size, args.tp_size, args.pp_partition,
                        page_size_for(args, trace_info["format"]), args.fault,
                        Sizing.runtime(args.device_pages, hicache_ratio=args.hicache_ratio))
    views = [page_view(r, plan.page_size) for r in reqs]
    trace_info["parse_seconds"] = round(time.perf_counter() - t0, 3)
    longest = max(v.pages for v in views)
    if args.device_pages < longest:
        raise ConfigError(
            f"--device-pages {args.device_pages} cannot hold the trace's longest request "
            f"({longest} pages of {plan.page_size} tokens); use at least {longest}")
    for s in args.stage or ():
        if not 0 <= s < plan.pp_size:
            raise ConfigError(f"--stage {s} out of range for --pp-size {plan.pp_size}")
    ranks = list(args.stage or range(plan.pp_size))
    stages = [plan.stage(s) for s in ranks]
    host_pages = plan.stage(0).host_pages
    if not args.metadata_only:
        check_stage_ram(plan, ranks, dev.type == "cpu", longest)
    t_bw = time.perf_counter()
    bandwidth = measure_bandwidth(plan, ranks[0], args.device)  # first: its tensors are freed
    bandwidth_s = time.perf_counter() - t_bw
    with l3_tiers(args, plan) as l3:
        modes, nodes = _run_modes(plan, stages, reqs, views, host_pages, args, l3)
    t_bounds = time.perf_counter()
    ceiling = CeilingTracker()
    for v in views:
        ceiling.observe(v)
    belady = belady_hit_tokens(views, host_pages)
    bounds_s = time.perf_counter() - t_bounds
    overhead = _overhead(plan, views, host_pages, args, modes)
    return build_report(args, plan, stages, modes, trace_info, ceiling, belady, host_pages, bandwidth,
                        {"insight_overhead": overhead,
                         "tree_nodes": nodes, "bounds_seconds": round(bounds_s, 3),
                         "bandwidth_probe_seconds": round(bandwidth_s, 3),
                         "seconds": round(time.perf_counter() - t0, 2),
                         "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                               / 1024, 1)})
