"""``stagecache bench transfer``: device<->host page transfer speed against same-run baselines.

Same process, same bytes, per pool kind (big SWA pages down to 1 KiB C128 pages):

* ``ceiling``   -- one contiguous copy of the same total bytes between a device
  tensor and a pinned host tensor (what the link can do at all);
* ``loop``      -- a Python loop copying one page of one layer at a time (the naive
  way; measured on up to ``--loop-copies`` copies, rate extrapolated);
* ``stagecache``-- ``TransferController.backup`` / ``load`` in each mode
  (``auto``, ``direct``, ``staged``), wall time including id checks and launch;
* ``stats overhead`` -- the same transfer with and without ``TransferStats``,
  plus the cost of one ``record`` call relative to one transfer.

Device pages are a random half of a pool twice the transfer size (scattered);
host pages are either what the host allocator hands a backup (``run``: ``alloc(n)``
on the fresh host pool, lowest free ids ascending = one run) or a random sample
(``scattered``: a cache hit's pages); loads read back the pages the backup wrote.
Prints JSON; ``--out`` also writes it to a file.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from typing import Any

from ..model.layer_map import build_stage_map
from ..model.pool_kinds import HOST_CACHED, KINDS, kind_table
from ..model.spec import ModelSpec, load_spec, spec_from_config

MIB = 1 << 20


def single_kind_spec(base: ModelSpec, pool: str, layers: int) -> ModelSpec:
    """A model of ``layers`` layers that all carry a buffer of ``pool`` (same row sizes as ``base``)."""
    ratio = KINDS[pool].owner_ratio or 0
    cfg = {
        "num_hidden_layers": layers, "compress_ratios": [ratio] * layers,
        "sliding_window": base.sliding_window, "head_dim": base.head_dim,
        "qk_rope_head_dim": base.qk_rope_head_dim, "index_head_dim": base.index_head_dim,
    }
    return spec_from_config(cfg, name=f"{base.name}/{pool}x{layers}")


class _Clock:
    """Wall-clock timing that waits for the device (``torch.cuda.synchronize``) on CUDA."""

    def __init__(self, cuda: bool):
        import torch

        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def median(self, fn, repeat: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        samples = []
        for _ in range(repeat):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


#: (words per program, warps) tried by ``--sweep`` for the direct kernel.
SWEEP = ((1024, 4, True), (1024, 4, False), (256, 2, True), (4096, 8, True))


def _measure(clock: _Clock, total: int, repeat: int, fn) -> dict[str, Any]:
    """Median wall time (ids checked, launched, finished), GPU event time and CPU issue time of ``fn``.

    ``fn`` returns a ``TransferResult`` without waiting; wall time runs until its
    ``synchronize()`` returns, exactly what ``blocking=True`` costs a caller.
    """
    fn().synchronize()
    walls, gpus, issues, path = [], [], [], None
    for _ in range(repeat):
        clock.sync()
        t0 = time.perf_counter()
        r = fn()  # ids checked and every copy queued: the CPU's part
        t1 = time.perf_counter()
        r.synchronize()  # = blocking=True
        walls.append(time.perf_counter() - t0)
        issues.append(t1 - t0)
        gpus.append(r.seconds or 0.0)
        path = r.path
    wall, gpu = statistics.median(walls), statistics.median(gpus)
    return {"gbps": _gbps(total, wall), "gpu_gbps": _gbps(total, gpu), "ms": round(wall * 1e3, 4),
            "gpu_ms": round(gpu * 1e3, 4), "issue_ms": round(statistics.median(issues) * 1e3, 4),
            "path": path}


def _ceiling(clock: _Clock, total: int, device: str, cuda: bool, repeat: int) -> tuple[float, float]:
    """Seconds of one contiguous copy of ``total`` bytes, device->pinned host and back."""
    import torch

    flat_dev = torch.empty(total, dtype=torch.uint8, device=device)
    flat_host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    d2h = clock.median(lambda: flat_host.copy_(flat_dev, non_blocking=True), repeat)
    h2d = clock.median(lambda: flat_dev.copy_(flat_host, non_blocking=True), repeat)
    return d2h, h2d


def bench_kind(base: ModelSpec, pool: str, layers: int, page_size: int, pages: int | None,
               target_bytes: int, device: str, repeat: int, loop_copies: int, layouts: list[str],
               patterns: list[str], modes: list[str], seed: int, sweep: bool = False) -> list[dict[str, Any]]:
    import torch

    from ..memory.host_pools import HostPools
    from ..memory.pools import StagePools
    from ..transfer.controller import TransferController
    from ..transfer.stats import TransferStats

    spec = single_kind_spec(base, pool, layers)
    stage = build_stage_map(spec, 0, 0, layers)
    pb = kind_table(spec, page_size).page_bytes(pool)
    n = pages or max(1, -(-target_bytes // (layers * pb)))
    total = n * layers * pb
    cuda = device.startswith("cuda")
    clock = _Clock(cuda)
    rng = random.Random(seed)

    dp = StagePools(spec, stage, page_size, 2 * n, device=device, kinds=[pool], swa_ratio=1.0)
    for b in dp.buffers[pool]:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=device))
    order = rng.sample(range(2 * n), 2 * n)  # scattered, and the two halves are disjoint
    dev_pages, dev_pages_back = order[:n], order[n:]

    # (a) ceiling: one contiguous copy of the same bytes
    ceil_d2h, ceil_h2d = _ceiling(clock, total, device, cuda, repeat)

    rows = []
    for layout in layouts:
        hp = HostPools(dp, num_pages=2 * n, layout=layout, pin_memory=cuda)
        # (b) baseline: one page of one layer per copy_, on a subset of the copies
        pairs = [(i, d, h) for i in range(layers) for d, h in zip(dev_pages, range(n), strict=True)]
        subset = pairs[:loop_copies]
        dbufs, hbufs = dp.buffers[pool], hp.buffers[pool]

        def loop_d2h(subset=subset, dbufs=dbufs, hbufs=hbufs):
            for i, d, h in subset:
                hbufs[i][h].copy_(dbufs[i][d], non_blocking=True)

        def loop_h2d(subset=subset, dbufs=dbufs, hbufs=hbufs):
            for i, d, h in subset:
                dbufs[i][d].copy_(hbufs[i][h], non_blocking=True)

        loop_bytes = len(subset) * pb
        loop = {"d2h": _gbps(loop_bytes, clock.median(loop_d2h, max(1, repeat // 2))),
                "h2d": _gbps(loop_bytes, clock.median(loop_h2d, max(1, repeat // 2))),
                "copies_measured": len(subset), "copies_total": len(pairs)}

        for pattern in patterns:
            # run: what the host allocator hands a backup (lowest free ids, ascending; here the
            # fresh host pool gives one run); scattered: a random sample (a cache hit's pages).
            # Loads read back the host pages the backup wrote.
            if pattern == "run":
                host_pages = hp.allocator.alloc(n)
                hp.allocator.free(host_pages)
            else:
                host_pages = rng.sample(range(2 * n), n)
            # ids as CPU int64 tensors, the way sglang's HiCache hands them over
            dev_ids, back_ids, host_ids = (torch.tensor(x) for x in (dev_pages, dev_pages_back, host_pages))
            row: dict[str, Any] = {
                "pool": pool, "page_bytes": pb, "layers": layers, "pages": n, "bytes": total,
                "mib": round(total / MIB, 2), "layout": layout, "host_pattern": pattern,
                "ceiling_gbps": {"d2h": _gbps(total, ceil_d2h), "h2d": _gbps(total, ceil_h2d)},
                "loop_gbps": loop, "stagecache": {},
            }
            back_dev = torch.tensor(dev_pages_back, device=device)
            exact: dict[str, bool] = {}

            def round_trip_ok(host_pages=host_pages, hbufs=hbufs, dbufs=dbufs):
                """Host pages hold the device pages, and the load put them back elsewhere bit-exact."""
                return all(torch.equal(hbufs[i][host_pages].to(device), dbufs[i][dev_pages])
                           and torch.equal(dbufs[i][dev_pages_back], dbufs[i][dev_pages]) for i in range(layers))

            for mode in modes:
                if not cuda and mode != "auto":
                    continue
                c = TransferController(dp, hp, stats=None, mode=mode)
                dmas = n * (layers if layout == "layer_first" else 1)
                if mode == "staged" and pattern == "scattered" and dmas > 20000:
                    row["stagecache"][mode] = {"skipped": f"{dmas} DMAs (one per host run and buffer)"}
                    continue
                for i in range(layers):  # clear both destinations: every mode must write them itself
                    hbufs[i][host_ids] = 0
                    dbufs[i][back_dev] = 0
                row["stagecache"][mode] = {
                    "d2h": _measure(clock, total, repeat,
                                    lambda c=c, hpg=host_ids, dpg=dev_ids: c.backup(dpg, hpg)),
                    "h2d": _measure(clock, total, repeat,
                                    lambda c=c, hpg=host_ids, dpg=back_ids: c.load(hpg, dpg)),
                }
                exact[mode] = round_trip_ok()
            if sweep and cuda and pattern == "scattered":
                row["direct_sweep"] = []
                from ..transfer import kernels

                for block_words, warps, align16 in SWEEP:
                    c = TransferController(dp, hp, stats=None, mode="direct")
                    c.kernel_config = (block_words, warps)
                    kernels.USE_ALIGN16 = align16
                    row["direct_sweep"].append({
                        "block_words": block_words, "num_warps": warps, "align16": align16,
                        "d2h": _measure(clock, total, repeat,
                                        lambda c=c, hpg=host_ids, dpg=dev_ids: c.backup(dpg, hpg)),
                        "h2d": _measure(clock, total, repeat,
                                        lambda c=c, hpg=host_ids, dpg=back_ids: c.load(hpg, dpg)),
                    })
            row["bit_exact_by_mode"] = exact
            row["bit_exact"] = bool(exact) and all(exact.values())
            # (d) stats overhead, auto mode
            stats = TransferStats()
            with_s = TransferController(dp, hp, stats=stats, mode="auto")
            without = TransferController(dp, hp, stats=None, mode="auto")
            t_without = clock.median(
                lambda c=without, hpg=host_ids, dpg=dev_ids: c.backup(dpg, hpg, blocking=True), repeat)
            t_with = clock.median(
                lambda c=with_s, hpg=host_ids, dpg=dev_ids: c.backup(dpg, hpg, blocking=True), repeat)
            t0 = time.perf_counter()
            for _ in range(1000):
                stats.record("d2h", total, t_with, n, layers, "bench")
            record_s = (time.perf_counter() - t0) / 1000
            row["stats_overhead"] = {
                "with_ms": round(t_with * 1e3, 4), "without_ms": round(t_without * 1e3, 4),
                "measured_pct": round((t_with - t_without) / t_without * 100, 3),
                "record_us": round(record_s * 1e6, 3),
                "record_pct_of_transfer": round(record_s / t_without * 100, 4),
            }
            auto = row["stagecache"].get("auto", {})
            best = {}
            for d in ("d2h", "h2d"):
                cands = [(v[d]["gbps"], m) for m, v in row["stagecache"].items() if d in v]
                best[d] = max(cands) if cands else (0.0, None)
            row["best"] = {d: {"gbps": g, "mode": m} for d, (g, m) in best.items()}
            row["ratios"] = {
                f"{d}_auto_vs_ceiling": round(auto[d]["gbps"] / row["ceiling_gbps"][d], 3)
                for d in ("d2h", "h2d") if d in auto and row["ceiling_gbps"][d]
            } | {
                f"{d}_auto_vs_loop": round(auto[d]["gbps"] / loop[d], 2)
                for d in ("d2h", "h2d") if d in auto and loop[d]
            }
            row["mode_ratios"] = {
                m: {f"{d}_vs_ceiling": round(v[d]["gbps"] / row["ceiling_gbps"][d], 3)
                    for d in ("d2h", "h2d") if d in v and row["ceiling_gbps"][d]}
                for m, v in row["stagecache"].items()
            }
            rows.append(row)
        del hp
        if cuda and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
    del dp
    if cuda:
        torch.cuda.empty_cache()
    return rows


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        from ..errors import ConfigError

        raise ConfigError("--device cuda: no CUDA device is available here")
    base = load_spec(args.model)
    kinds = args.pool or list(HOST_CACHED)
    modes = ["auto", "direct", "staged"] if device.startswith("cuda") else ["auto"]
    results = []
    for pool in kinds:
        results += bench_kind(base, pool, args.layers, args.page_size, args.pages, int(args.mib * MIB), device,
                              args.repeat, args.loop_copies, args.layout or ["layer_first", "page_first"],
                              args.pattern or ["run", "scattered"], modes, args.seed, args.sweep)
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "host": platform.node()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    big = [r for r in results if r["bytes"] >= 64 * MIB]
    summary = {}
    for d in ("d2h", "h2d"):
        vs_ceiling = [r["ratios"].get(f"{d}_auto_vs_ceiling") for r in big]
        vs_loop = [r["ratios"].get(f"{d}_auto_vs_loop") for r in big]
        vs_ceiling = [v for v in vs_ceiling if v is not None]
        vs_loop = [v for v in vs_loop if v is not None]
        summary[d] = {
            "min_auto_vs_ceiling": min(vs_ceiling) if vs_ceiling else None,
            "min_auto_vs_loop": min(vs_loop) if vs_loop else None,
            "meets_90pct_ceiling": bool(vs_ceiling) and min(vs_ceiling) >= 0.9,
            "meets_5x_loop": bool(vs_loop) and min(vs_loop) >= 5.0,
        }
    overheads = [r["stats_overhead"]["record_pct_of_transfer"] for r in results]
    summary["max_stats_record_pct"] = max(overheads) if overheads else None
    return {"bench": "transfer", "model": base.name, "device": device, "page_size": args.page_size,
            "layers": args.layers, "repeat": args.repeat, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "env": info, "results": results, "summary": summary}
