"""``stagecache bench hicache``: replay a chat trace through each stage's HiCache, three ways.

One run, same trace, same page size, same device pages per stage:

* ``hicache``     -- device tier + host tier (the configuration under test);
* ``device_only`` -- the same device pages, no host tier (what HiCache adds is the difference);
* ``ceiling``     -- an infinite cache: every page-aligned prefix ever computed is reusable.
  No real cache can beat it, so hit tokens are also reported as a share of it.

With ``--verify`` every reused page (device hit or reloaded from host) is
compared, in every pool and every local layer, with the bytes the simulated
forward pass wrote for that prefix (``kv_writer``); any difference is reported
with stage, pool, layer and page, and the run exits 1.
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..transfer.stats import gbps

DEFAULT_DEVICE_PAGES = 96
DEFAULT_HICACHE_RATIO = 4.0
DEFAULT_REQUESTS = 2000


# -- the infinite cache (ceiling) ----------------------------------------------------------------
class CeilingCache:
    """Every page-aligned prefix ever inserted stays reusable; same begin/finish order as HiCache."""

    def __init__(self, page_size: int):
        from ..cache.stats import CacheStats

        self.page_size = page_size
        self.seen: set[int] = set()
        self.stats = CacheStats(stage=-1, page_size=page_size)

    def begin(self, request: Any) -> Any:
        import numpy as np

        from ..cache.kv_writer import page_hashes

        tokens = np.concatenate([np.asarray(request.input_ids), np.asarray(request.output_ids)])
        hashes = page_hashes(tokens, self.page_size)
        limit = (len(request.input_ids) - 1) // self.page_size
        hit = 0
        while hit < limit and int(hashes[hit]) in self.seen:
            hit += 1
        self.stats.record_lookup(0, hit * self.page_size, len(request.input_ids) - hit * self.page_size)
        return hashes[:len(tokens) // self.page_size]

    def finish(self, full_hashes: Any) -> None:
        self.seen.update(int(h) for h in full_hashes)


# -- replay ---------------------------------------------------------------------------------------
@dataclass
class ReplayResult:
    requests: int = 0
    seconds: float = 0.0
    pages_verified: int = 0
    bytes_verified: int = 0
    bytes_written: int = 0
    mismatch_count: int = 0
    stalls: int = 0  # begins that had to wait for a running request to finish (pages)
    mismatches: list[Any] = field(default_factory=list)  # the first few, as Mismatch

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "seconds": round(self.seconds, 3),
                "pages_verified": self.pages_verified, "bytes_verified": self.bytes_verified,
                "bytes_written": self.bytes_written, "stalls": self.stalls,
                "mismatch_count": self.mismatch_count,
                "mismatches": [str(m) for m in self.mismatches]}


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
    t0 = time.perf_counter()
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
    return out


# -- the benchmark --------------------------------------------------------------------------------
def _load_requests(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any]]:
    from ..cache.traces import WorkloadConfig, generate, load_trace, write_trace
    from ..errors import ConfigError

    if args.trace:
        trace = load_trace(args.trace, skip_bad=args.skip_bad_lines)
        reqs = list(trace.requests)
        if args.requests is not None:
            if args.requests > len(reqs):
                raise ConfigError(f"--requests {args.requests}: trace {args.trace} has only "
                                  f"{len(reqs)} good requests")
            reqs = reqs[:args.requests]
        info = {"source": str(args.trace), "skipped_lines": [str(e) for e in trace.errors]}
    else:
        cfg = WorkloadConfig(seed=args.seed, requests=args.requests or DEFAULT_REQUESTS,
                             think_time_s=args.think_time, session_gap_s=args.session_gap)
        reqs = generate(cfg)
        info = {"source": "generated", "seed": args.seed, "think_time_s": args.think_time,
                "session_gap_s": args.session_gap, "sessions": len({r.session for r in reqs})}
    if args.save_trace:
        write_trace(args.save_trace, reqs)
        info["saved_to"] = args.save_trace
    info.update(requests=len(reqs),
                input_tokens=sum(r.input_len for r in reqs),
                output_tokens=sum(r.output_len for r in reqs))
    return reqs, info


def _stage_run(la: Any, stage_map: Any, reqs: Sequence[Any], args: argparse.Namespace,
               host: bool) -> dict[str, Any]:
    import torch

    from ..cache.hicache import HiCache
    from ..cache.kv_writer import KvWriter
    from ..memory.pools import StagePools

    pools = StagePools(la.spec, stage_map, la.page_size, args.device_pages, args.device,
                       la.faults, la.layout.pp_size, swa_ratio=1.0)  # one page-id space
    host_pools = controller = None
    if host:
        from ..memory.host_pools import HostPools
        from ..transfer.controller import TransferController
        from ..transfer.stats import TransferStats

        host_pools = HostPools(pools, hicache_ratio=args.hicache_ratio, layout=args.hicache_layout)
        controller = TransferController(pools, host_pools, TransferStats())
    cache = HiCache(pools, host_pools, controller, write_policy=args.write_policy)
    writer = KvWriter(pools, seed=args.seed)
    result = replay(reqs, cache, writer, verify=args.verify, concurrency=args.concurrency,
                    check_every=args.check_every)
    if controller is not None:
        controller.synchronize()
    if pools.device.type == "cuda":
        torch.cuda.synchronize(pools.device)
    stats = cache.stats.to_dict()
    stats.update(device_pages=args.device_pages,
                 host_pages=host_pools.num_pages if host_pools is not None else 0,
                 token_page_bytes=pools.token_page_bytes(), replay=result.to_dict())
    return stats


def _sum(rows: list[dict[str, Any]], key: str) -> int:
    return sum(r[key] for r in rows)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ..errors import ConfigError
    from ..validation.inputs import resolve_layout

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        dev = torch.device(args.device)
    except RuntimeError as exc:
        raise ConfigError(f"--device {args.device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: CUDA is not available on this machine")
    la = resolve_layout(args.model, args.pp_size, args.tp_size, args.pp_partition,
                        args.page_size, args.fault)
    reqs, trace_info = _load_requests(args)
    longest = max(-(-(r.input_len + r.output_len) // la.page_size) for r in reqs)
    if args.device_pages < longest:
        raise ConfigError(
            f"--device-pages {args.device_pages} cannot hold the trace's longest request "
            f"({longest} pages of {la.page_size} tokens); use at least {longest}")
    for s in args.stage or ():
        if not 0 <= s < la.layout.pp_size:
            raise ConfigError(f"--stage {s} out of range for --pp-size {la.layout.pp_size}")
    stages = [la.layout.stages[s] for s in (args.stage or range(la.layout.pp_size))]
    t0 = time.perf_counter()
    modes: dict[str, list[dict[str, Any]]] = {"hicache": [], "device_only": []}
    for sm in stages:
        modes["hicache"].append(_stage_run(la, sm, reqs, args, host=True))
        modes["device_only"].append(_stage_run(la, sm, reqs, args, host=False))
    ceiling = CeilingCache(la.page_size)
    replay(reqs, ceiling)
    c = ceiling.stats

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        # every stage sees the same requests and makes the same decisions: report stage 0's
        # tokens, and check the others agree (the pipeline's cache-decision digest relies on it)
        r0 = rows[0]
        agree = all((r["device_hit_tokens"], r["host_hit_tokens"]) ==
                    (r0["device_hit_tokens"], r0["host_hit_tokens"]) for r in rows)
        hit = r0["device_hit_tokens"] + r0["host_hit_tokens"]
        d2h = _sum(rows, "transfer_bytes_d2h")
        h2d = _sum(rows, "transfer_bytes_h2d")
        d2h_s = sum(r["transfer_seconds"]["d2h"] for r in rows)
        h2d_s = sum(r["transfer_seconds"]["h2d"] for r in rows)
        return {
            "hit_tokens": hit, "device_hit_tokens": r0["device_hit_tokens"],
            "host_hit_tokens": r0["host_hit_tokens"], "miss_tokens": r0["miss_tokens"],
            "hit_ratio": round(r0["hit_ratio"], 4), "host_hit_ratio": round(r0["host_hit_ratio"], 4),
            "share_of_ceiling": round(hit / c.host_hit_tokens, 4) if c.host_hit_tokens else 0.0,
            "host_share_of_ceiling": round(r0["host_hit_tokens"] / c.host_hit_tokens, 4)
            if c.host_hit_tokens else 0.0,
            "stages_agree": agree,
            "evicted_pages": {"device": _sum(rows, "device_evicted_pages"),
                              "host": _sum(rows, "host_evicted_pages"),
                              "dropped": _sum(rows, "dropped_pages")},
            "transfer_bytes": {"d2h": d2h, "h2d": h2d},
            "transfer_seconds": {"d2h": round(d2h_s, 4), "h2d": round(h2d_s, 4)},
            "bandwidth_gbps": {"d2h": round(gbps(d2h, d2h_s), 3), "h2d": round(gbps(h2d, h2d_s), 3)},
            "mismatches": sum(r["replay"]["mismatch_count"] for r in rows),
            "pages_verified": sum(r["replay"]["pages_verified"] for r in rows),
            "bytes_verified": sum(r["replay"]["bytes_verified"] for r in rows),
            "replay_seconds": round(sum(r["replay"]["seconds"] for r in rows), 3),
        }

    for rows in modes.values():
        for r in rows:
            r["transfer_bytes_d2h"] = r["transfer_bytes"]["d2h"]
            r["transfer_bytes_h2d"] = r["transfer_bytes"]["h2d"]
    hi, dev = summary(modes["hicache"]), summary(modes["device_only"])
    for rows in modes.values():
        for r in rows:
            del r["transfer_bytes_d2h"], r["transfer_bytes_h2d"]
    return {
        "bench": "hicache",
        "model": la.spec.name, "pp_size": la.layout.pp_size, "stages": [s.stage for s in stages],
        "page_size": la.page_size, "device": str(args.device), "device_pages": args.device_pages,
        "hicache_ratio": args.hicache_ratio, "host_pages": modes["hicache"][0]["host_pages"],
        "write_policy": args.write_policy, "host_layout": args.hicache_layout,
        "concurrency": args.concurrency, "verify": args.verify,
        "trace": trace_info,
        "ceiling": {"hit_tokens": c.host_hit_tokens, "hit_ratio": round(c.hit_ratio, 4),
                    "looked_up_tokens": c.looked_up_tokens},
        "summary": {
            "hicache": hi, "device_only": dev,
            "ratio_hit_tokens_hicache_vs_device_only":
                round(hi["hit_tokens"] / dev["hit_tokens"], 3) if dev["hit_tokens"] else None,
        },
        "per_stage": modes,
        "seconds": round(time.perf_counter() - t0, 2),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s, c = res["summary"], res["ceiling"]
    t = Table(title=(f"HiCache replay: {res['trace']['requests']} requests, {res['model']} "
                     f"pp={res['pp_size']}, page {res['page_size']}, {res['device_pages']} device + "
                     f"{res['host_pages']} host pages/stage, {res['write_policy']} "
                     f"(tokens of stage {res['stages'][0]}; every stage decides the same)"))
    for col in ("", "device hit", "host hit", "miss", "hit %", "of ceiling", "d2h GB/s", "h2d GB/s",
                "bad pages"):
        t.add_column(col, justify="right" if col else "left")
    for name in ("device_only", "hicache"):
        r = s[name]
        t.add_row(name.replace("_", " "), str(r["device_hit_tokens"]), str(r["host_hit_tokens"]),
                  str(r["miss_tokens"]), f"{r['hit_ratio']:.1%}", f"{r['share_of_ceiling']:.1%}",
                  f"{r['bandwidth_gbps']['d2h']:.2f}", f"{r['bandwidth_gbps']['h2d']:.2f}",
                  str(r["mismatches"]) if res["verify"] else "-")
    t.add_row("ceiling", "-", str(c["hit_tokens"]), str(c["looked_up_tokens"] - c["hit_tokens"]),
              f"{c['hit_ratio']:.1%}", "100%", "-", "-", "-")
    con = Console()
    con.print(t)
    hi = s["hicache"]
    con.print(f"host-tier hits = {hi['host_share_of_ceiling']:.1%} of what the ceiling reuses; "
              f"hit tokens x{s['ratio_hit_tokens_hicache_vs_device_only']} vs device only; "
              f"stages agree: {hi['stages_agree'] and s['device_only']['stages_agree']}; "
              + (f"{hi['pages_verified'] + s['device_only']['pages_verified']} reused pages verified; "
                 if res["verify"] else "not verified (--verify); ")
              + f"{res['seconds']} s")
