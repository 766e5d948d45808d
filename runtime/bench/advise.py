"""``stagecache bench advise``: one pass for every size against one replay per size, same run.

Without ``advise`` an operator learns what a size buys by replaying the trace at that size
(``bench hicache --metadata-only``), once per size.  This benchmark times both on the same trace
in the same process, pinned to one CPU core: the one pass (read, page keys, both curves) against
the cheapest replay there is at ``sizes`` host sizes, each replay checked against the curves at
its sizes.  docs/advise.md ("Speed") describes the figures.
"""

from __future__ import annotations

import logging
import os
import resource
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_SIZES = 20


@contextmanager
def one_core() -> Iterator[int | None]:
    """Run on one CPU core while the block runs (the claim is per core), then on the cores as
    before; yields the core, or None where affinity is unknown."""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, before)


def _rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def timed_curve(path: str, fmt: str, page_size: int | None, block_tokens: int) -> dict[str, Any]:
    """Read ``path`` and compute its curves, timed; the views and curves come back too."""
    from ..sizing.curves import page_views, trace_curves
    from ..traces.readers import load_requests

    rss0 = _rss_mib()  # the interpreter, numpy, torch (the page keys import it): before any work
    t0, c0 = time.perf_counter(), time.thread_time()
    trace = load_requests(path, fmt=fmt, block_tokens=block_tokens)
    page = block_tokens if trace.format == "mooncake" else page_size
    views = page_views(trace.requests, page)
    t1 = time.perf_counter()
    curves = trace_curves(views)
    t2, c2 = time.perf_counter(), time.thread_time()
    return {"views": views, "curves": curves, "format": trace.format,
            "seconds": t2 - t0, "cpu_seconds": c2 - c0, "read_seconds": t1 - t0,
            "pass_seconds": t2 - t1, "rss_before_mib": rss0, "peak_rss_mib": _rss_mib()}


def geometric_sizes(longest: int, full_pages: int, sizes: int) -> list[int]:
    """``sizes`` page counts, geometric from twice the longest request to where the curve reaches
    the ceiling (fewer where they round to the same count)."""
    low = 2 * longest
    high = max(full_pages, low + sizes)
    return [int(x) for x in np.unique(np.rint(np.geomspace(low, high, sizes)).astype(np.int64))]


def replay_at(views: Sequence[Any], page_size: int, device_pages: int, host_pages: int
              ) -> dict[str, Any]:
    """One metadata-only replay (what a user would run per size), timed."""
    from ..cache.hicache import HiCache
    from .hicache import replay

    cache = HiCache.metadata_only(page_size, device_pages, host_pages, write_policy="write_through",
                                  eviction_policy="lru", insight=None)
    result = replay(views, cache, concurrency=1)
    s = cache.stats
    return {"device_pages": device_pages, "host_pages": host_pages,
            "device_hit_tokens": s.device_hit_tokens, "host_hit_tokens": s.host_hit_tokens,
            "seconds": round(result.seconds, 4), "cpu_seconds": round(result.cpu_seconds, 4)}


def _compare(rows: list[dict[str, Any]], curves: Any) -> dict[str, float]:
    """Each replay against the curves at its sizes, in percentage points of the prompt tokens."""
    total = curves.input_tokens
    worst = {"device": 0.0, "total": 0.0}
    for r in rows:
        r["curve_device_hit_tokens"] = curves.device.at(r["device_pages"])
        r["curve_hit_tokens"] = curves.total.at(r["host_pages"])
        replayed = r["device_hit_tokens"] + r["host_hit_tokens"]
        worst["device"] = max(worst["device"],
                              abs(r["device_hit_tokens"] - r["curve_device_hit_tokens"]) / total * 100)
        worst["total"] = max(worst["total"], abs(replayed - r["curve_hit_tokens"]) / total * 100)
    return worst


def _trace_file(args: Any, tmp: str) -> tuple[str, dict[str, Any]]:
    """The trace to time: ``--trace``, or a generated one written to ``tmp``."""
    from ..errors import ConfigError
    from ..traces.block_workload import BlockWorkloadConfig, generate_blocks
    from ..traces.readers import write_trace

    if args.trace:
        return args.trace, {"source": str(args.trace)}
    cfg = BlockWorkloadConfig(seed=args.seed, requests=args.requests, block_tokens=args.block_tokens)
    requests = generate_blocks(cfg)
    path = str(Path(tmp) / "generated.jsonl")
    write_trace(path, requests)
    if args.save_trace:
        try:
            write_trace(args.save_trace, requests)
        except OSError as exc:
            raise ConfigError(f"--save-trace {args.save_trace}: cannot write it: "
                              f"{exc.strerror or exc}") from None
    return path, {"source": "generated", "seed": args.seed, "saved_to": args.save_trace}


def run_bench(args: Any) -> dict[str, Any]:
    with one_core() as core:
        return _measure(args, core)


def _measure(args: Any, core: int | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="stagecache-bench-advise-") as tmp:  # 0700
        path, info = _trace_file(args, tmp)
        log.info("[bench advise] one pass over %s ...", info["source"])
        curve = timed_curve(path, args.trace_format, args.page_size, args.block_tokens)
    views, curves = curve.pop("views"), curve.pop("curves")
    longest = max(v.pages for v in views)
    # host pages at each size, device pages half of them (at least the longest request)
    sizes = [(max(longest, h // 2), h) for h in geometric_sizes(longest, curves.total.full_pages, args.sizes)]
    rows = []
    t0 = time.perf_counter()
    for i, (dev, host) in enumerate(sizes):
        log.info("[bench advise] replay %d/%d: %d device + %d host pages", i + 1, len(sizes), dev, host)
        rows.append(replay_at(views, curves.page_size, dev, host))
    replay_s = time.perf_counter() - t0
    worst = _compare(rows, curves)
    return {
        "trace": {**info, "format": curve.pop("format"), "requests": curves.requests,
                  "lookup_pages": curves.lookup_pages, "distinct_pages": curves.distinct_pages,
                  "page_size": curves.page_size, "longest_request_pages": longest},
        "cpu_core": core,
        "curve": {k: round(v, 4) if isinstance(v, float) else v for k, v in curve.items()},
        "replays": {"sizes": len(rows), "seconds": round(replay_s, 3),
                    "cpu_seconds": round(sum(r["cpu_seconds"] for r in rows), 3), "per_size": rows},
        "max_abs_diff_pp": {k: round(v, 6) for k, v in worst.items()},
        "ratio_replays_vs_curve": round(replay_s / curve["seconds"], 2),
        "ratio_replays_vs_curve_cpu": round(sum(r["cpu_seconds"] for r in rows)
                                            / max(curve["cpu_seconds"], 1e-9), 2),
        "peak_rss_mib": _rss_mib(),
    }
