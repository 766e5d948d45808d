"""``stagecache bench policies``: every eviction policy at 8 sizes, timed against the replay.

``advise --policies`` runs the trace once per (policy, size) through the model of sglang's
radix tree (``sizing/policies.py``).  This benchmark times, in one process pinned to one CPU
core, the model at ``sizes`` device sizes x the five policies (reading the trace, its page keys
and the LRU curve that picks the sizes included),
and beside it what an operator would run instead: stagecache's own metadata-only replay
(``HiCache.metadata_only``, LRU, device tier alone, one request in flight) at the same sizes,
the trace parsed once for all of them.  Both report wall and CPU seconds and the process's
peak RSS; the model's LRU runs are compared with the replay's (they differ only where sglang's
whole-leaf eviction frees more than a page-exact LRU).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from typing import Any

from .advise import _rss_mib, _trace_file, geometric_sizes, one_core

log = logging.getLogger(__name__)

DEFAULT_SIZES = 8


def run_bench(args: Any, factory: Callable[[Any], Any], source: str) -> dict[str, Any]:
    with one_core() as core:
        return _measure(args, core, factory, source)


def _measure(args: Any, core: int | None, factory: Callable[[Any], Any], source: str) -> dict[str, Any]:
    from ..sizing.curves import page_views, trace_curves
    from ..sizing.policies import policy_specs, run_policy
    from ..traces.readers import load_requests
    from .advise import replay_at

    specs = policy_specs(None)
    rss0 = _rss_mib()
    with tempfile.TemporaryDirectory(prefix="stagecache-bench-policies-") as tmp:  # 0700
        path, info = _trace_file(args, tmp)
        t0, c0 = time.perf_counter(), time.process_time()
        trace = load_requests(path, fmt=args.trace_format, block_tokens=args.block_tokens)
        page = args.block_tokens if trace.format == "mooncake" else args.page_size
        views = page_views(trace.requests, page)
        read_s = time.perf_counter() - t0
    curves = trace_curves(views)
    longest = max(v.pages for v in views)
    sizes = geometric_sizes(longest, curves.device.full_pages, args.sizes)
    rates: dict[str, list[float]] = {}
    lru_hits: list[int] = []
    for spec in specs:
        row = []
        for cap in sizes:
            hits = run_policy(views, factory(spec), cap, "device", page, spec.name == "tlru").hit_tokens
            row.append(hits / curves.input_tokens)
            if spec.name == "lru":
                lru_hits.append(hits)
        rates[spec.label] = row
        log.info("[bench policies] %s at %d sizes", spec.label, len(sizes))
    model_s, model_cpu = time.perf_counter() - t0, time.process_time() - c0  # read, curve, runs
    rss_model = _rss_mib()
    t2 = time.perf_counter()
    replays = [replay_at(views, page, cap, 0) for cap in sizes]
    replay_s = time.perf_counter() - t2
    diff = max(abs(r["device_hit_tokens"] - h) for r, h in zip(replays, lru_hits, strict=True))
    return {
        "trace": {**info, "format": trace.format, "requests": len(views),
                  "lookup_pages": curves.lookup_pages, "distinct_pages": curves.distinct_pages,
                  "page_size": page, "longest_request_pages": longest},
        "cpu_core": core,
        "order": source,
        "sizes": sizes,
        "policies": {"runs": len(specs) * len(sizes), "seconds": round(model_s, 3),
                     "cpu_seconds": round(model_cpu, 3), "read_seconds": round(read_s, 3),
                     "hit_rate": rates, "peak_rss_mib": rss_model, "rss_before_mib": rss0},
        "replay_lru": {"runs": len(sizes), "seconds": round(replay_s, 3),
                       "cpu_seconds": round(sum(r["cpu_seconds"] for r in replays), 3),
                       "hit_rate": [r["device_hit_tokens"] / curves.input_tokens for r in replays]},
        "lru_model_vs_replay_max_pp": round(100 * diff / curves.input_tokens, 4),
        "seconds_per_run": {"policies": round(model_s / (len(specs) * len(sizes)), 4),
                            "replay": round(replay_s / len(sizes), 4)},
        "ratio_replay_run_vs_policy_run": round((replay_s / len(sizes))
                                                / max(model_s / (len(specs) * len(sizes)), 1e-9), 2),
        "peak_rss_mib": _rss_mib(),
    }
