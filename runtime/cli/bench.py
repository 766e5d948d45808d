"""``stagecache bench ...``: the argument tables and output of the benchmarks.

The benchmarks themselves live in ``stagecache.runtime.bench``; this module only
parses flags, calls them and prints (JSON, tables), so the benchmark code stays
importable without argparse.
"""

from __future__ import annotations

import argparse
import json
import sys

from .. import defaults
from ..bench import check as bench_check
from ..bench import hicache as bench_hicache
from ..bench import insight_overhead
from ..errors import ConfigError
from ..model.families.deepseek_v4 import HOST_CACHED
from . import bench_http, bench_sglang, bench_trace
from .common import (
    add_host_tier_args,
    add_layout_command,
    add_trace_args,
    bench_device,
    device_name,
    fault_spec,
    int_range,
    nonneg_float,
    nonneg_int,
    output_file,
    positive_float,
    positive_int,
)
from .l3_args import add_l3_args, l3_options


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure startup checks, page transfers or a HiCache replay (JSON on stdout, "
                       "each figure with its ratio to a baseline measured in the same run)")
    bench_sub = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    _register_check(bench_sub)
    _register_transfer(bench_sub)
    _register_transfer_split(bench_sub)
    _register_hicache(bench_sub)
    _register_l3(bench_sub)
    bench_http.register(bench_sub)
    bench_trace.register(bench_sub)
    bench_sglang.register(bench_sub)


def _register_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="time the startup validation for pp sizes 1..N")
    p.add_argument("--model", default=defaults.MODEL,
                   help="preset name or path to a config.json (default %(default)s)")
    p.add_argument("--layers", type=int_range(1, 4096), default=None,
                   help="time a synthetic DeepSeek-V4-shaped model of this many layers instead of --model")
    p.add_argument("--max-pp", type=int_range(1, 4096), default=8, help="largest pp size to time (default %(default)s)")
    p.add_argument("--repeat", type=positive_int, default=50, help="timed runs per pp size (default %(default)s)")
    p.add_argument("--fault", action="append", default=[], metavar="NAME[@STAGE]", type=fault_spec,
                   help="time the check on stages built the way a known bug did (repeatable)")
    p.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")
    p.set_defaults(func=lambda a: print(json.dumps(
        bench_check.run_bench(a.model, a.layers, a.max_pp, a.repeat, a.fault), indent=2)) or 0)


def _register_transfer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transfer", help="time device<->host page moves against the peer techniques (same run, same pages)")
    p.add_argument("--model", default=defaults.MODEL,
                   help="preset name or config.json whose page sizes are copied (default %(default)s; "
                   "the committed H200 report uses deepseek-v4-flash)")
    p.add_argument("--pp-size", "--pp", dest="pp", type=int_range(1, 4096), default=defaults.PP_SIZE,
                   help="pipeline stages of the stage-mix layout (default %(default)s)")
    p.add_argument("--stage", type=nonneg_int, default=1,
                   help="stage whose pools form the stage mix (default %(default)s)")
    p.add_argument("--mix-pages", type=positive_int, nargs="*", default=None,
                   help="stage-mix token pages per move (default 1 4 16 64 256, on CPU 1 4 16 64; "
                        "none: skip the stage mix)")
    p.add_argument("--kind-mib", type=positive_float, nargs="*", default=None,
                   help="MiB per move of each pool kind alone (default 4 64 256, on CPU 4 64; "
                        "none: skip the one-kind cases)")
    p.add_argument("--kind", action="append", default=None, choices=HOST_CACHED,
                   help="pool kind to move alone (repeatable; default: every host-cached kind)")
    p.add_argument("--layers", type=positive_int, default=11,
                   help="layer buffers of a one-kind case (default %(default)s, a deepseek-v4-flash stage at pp 4)")
    p.add_argument("--page-size", type=positive_int, default=defaults.PAGE_SIZE,
                   help="tokens per page (default %(default)s)")
    p.add_argument("--hicache-layout", "--layout", dest="layout", choices=defaults.HOST_LAYOUTS,
                   default=defaults.HOST_LAYOUT, help="host pool memory layout (default %(default)s)")
    p.add_argument("--device", type=device_name, default=None,
                   help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("--min-reps", type=positive_int, default=None, help="timed calls at least (cpu 3, cuda 10)")
    p.add_argument("--max-reps", type=positive_int, default=None, help="timed calls at most (cpu 40, cuda 100)")
    p.add_argument("--budget", type=positive_float, default=None,
                   help="seconds of timed calls per technique (cpu 0.1, cuda 0.3)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the scattered page pattern (default 0)")
    p.add_argument("--sweep", action="store_true", help="also time the device mover's launch shapes on every case")
    p.add_argument("--chunk-bytes", type=positive_int, default=None, help="launch shape: bytes per work item")
    p.add_argument("--programs-per-sm", type=positive_int, default=None,
                   help="launch shape: persistent programs per SM")
    p.add_argument("--num-warps", type=positive_int, default=None, help="launch shape: warps per program")
    p.add_argument("--lane-words", type=positive_int, default=None,
                   help="launch shape: 8-byte words per lane per step")
    p.add_argument("--fine-chunk-bytes", type=positive_int, default=None,
                   help="launch shape: bytes per item of small moves")
    p.add_argument("--probes", action="store_true",
                   help="also time link probes on the same pages: two hand-written CUDA copy kernels and one "
                   "copy-engine batch (cudaMemcpyBatchAsync, CUDA 12.8+): how close any copy of scattered pages "
                   "gets to the ceiling; CUDA, compute capability 9.0+")
    p.add_argument("--out", type=output_file("--out"), default=None,
                   help="also write the JSON report to this file (checked before the run)")
    p.add_argument("--json", action="store_true", help="print the JSON report (default: the markdown table)")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="no run: render a saved report as the docs' markdown table")
    p.add_argument("--into", type=output_file("--into"), default=None, metavar="DOC",
                   help="with --render: replace the table inside DOC")
    p.set_defaults(func=_run_transfer)


def _run_transfer(args: argparse.Namespace) -> int:
    from ..bench import transfer_report

    if args.render:
        return _render_transfer(args)
    import torch  # here, not at import: every command's --help and flag errors stay torch-free

    from ..bench import transfer as bench_transfer
    from ..model.families import load_spec

    device = bench_device(args.device)
    cuda = device.startswith("cuda")
    if args.probes:
        from ..bench.transfer_probes import unavailable

        reason = unavailable(torch.device(device))
        if reason:
            raise ConfigError(f"--probes on {device}: {reason}")
    base = load_spec(args.model)
    if not 0 <= args.stage < args.pp:
        raise ConfigError(f"--stage {args.stage}: stages of --pp-size {args.pp} are 0..{args.pp - 1}")
    mix = args.mix_pages if args.mix_pages is not None else bench_transfer.mix_pages(cuda)
    kind_mib = args.kind_mib if args.kind_mib is not None else bench_transfer.kind_mib(cuda)
    cases = bench_transfer.grid(base, args.pp, args.stage, args.page_size, args.layers, mix, kind_mib, args.kind)
    settings = bench_transfer.Settings(
        device=device, page_size=args.page_size, layout=args.layout, seed=args.seed,
        min_reps=args.min_reps or (10 if cuda else 3), max_reps=args.max_reps or (100 if cuda else 40),
        budget_s=args.budget if args.budget is not None else (0.3 if cuda else 0.1), sweep=args.sweep,
        probes=args.probes,
        shape=bench_transfer.launch_shape(args.chunk_bytes, args.programs_per_sm, args.num_warps,
                                          args.lane_words, args.fine_chunk_bytes))
    report = bench_transfer.run_bench(cases, settings, base.name)
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text if args.json else transfer_report.render(report, args.out or "this run"))
    return 0


def _render_transfer(args: argparse.Namespace) -> int:
    from ..bench import transfer_report
    from ..bounded_io import read_bounded_text

    text = read_bounded_text(args.render, 16 << 20, f"--render {args.render}", "a bench transfer report")
    try:
        report = json.loads(text)
        section = transfer_report.render(report, args.render)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ConfigError(f"--render {args.render}: not a bench transfer report "
                          f"({str(e)[:200]})") from None
    if not args.into:
        print(section, end="")
        return 0
    doc = read_bounded_text(args.into, 16 << 20, f"--into {args.into}", "a Markdown document")
    try:
        new = transfer_report.replace_section(doc, section)
    except ValueError as e:
        raise ConfigError(f"--into {args.into}: {e}") from None
    with open(args.into, "w") as f:
        f.write(new)
    return 0


def _register_transfer_split(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transfer-split", help="queue wait vs DMA time of a load alone and queued behind a long "
                       "backup, and the per-call cost of recording them (JSON)")
    p.add_argument("--model", default=defaults.MODEL, help="preset name or config.json (default %(default)s)")
    p.add_argument("--pp-size", "--pp", dest="pp", type=int_range(1, 4096), default=defaults.PP_SIZE,
                   help="pipeline stages (default %(default)s)")
    p.add_argument("--stage", type=nonneg_int, default=1, help="stage whose pools move (default %(default)s)")
    p.add_argument("--page-size", type=positive_int, default=defaults.PAGE_SIZE,
                   help="tokens per page (default %(default)s)")
    p.add_argument("--big-pages", type=positive_int, default=128,
                   help="pages of the long backup the small load queues behind (default %(default)s)")
    p.add_argument("--calls", type=positive_int, default=200, help="calls per timed block (default %(default)s)")
    p.add_argument("--device", type=device_name, default=None,
                   help="cuda, cuda:N or cpu (default: cuda if available)")
    p.set_defaults(func=_run_transfer_split)


def _run_transfer_split(args: argparse.Namespace) -> int:

    from ..bench import transfer_split
    from ..model.families import load_spec

    device = bench_device(args.device)
    if not 0 <= args.stage < args.pp:
        raise ConfigError(f"--stage {args.stage}: stages of --pp-size {args.pp} are 0..{args.pp - 1}")
    settings = transfer_split.SplitSettings(device=device, pp=args.pp, stage=args.stage, page_size=args.page_size,
                                            big_pages=args.big_pages, calls=args.calls)
    print(json.dumps(transfer_split.run_bench(load_spec(args.model), settings), indent=2))
    return 0


def _register_hicache(sub: argparse._SubParsersAction) -> None:
    from ..cache.eviction import DEFAULT_POLICY, POLICIES

    p = add_layout_command(sub, "hicache", help="replay a trace: prefix-cache hits with HiCache vs device only "
                                                "vs the Belady bound and an infinite cache")
    add_trace_args(p, "JSONL trace, stagecache tokens or Mooncake format (docs/hicache.md); "
                      "default: a generated multi-turn chat trace", required=False)
    p.add_argument("--save-trace", type=output_file("--save-trace"), default=None, metavar="FILE",
                   help="write the replayed trace as JSONL")
    p.add_argument("--requests", type=int_range(1, bench_hicache.MAX_REQUESTS), default=None,
                   help=f"requests to generate (default {bench_hicache.DEFAULT_REQUESTS}), or the first N "
                        f"of --trace (reading stops there); at most {bench_hicache.MAX_REQUESTS}")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the generated trace (default 0)")
    p.add_argument("--think-time", type=nonneg_float, default=30.0, help="mean seconds between a session's turns (default %(default)s)")
    p.add_argument("--session-gap", type=nonneg_float, default=1.5, help="mean seconds between session starts (default %(default)s)")
    p.add_argument("--device-pages", type=positive_int, default=defaults.DEVICE_PAGES,
                   help="device token pages per stage (default %(default)s)")
    add_host_tier_args(p)
    p.add_argument("--eviction-policy", choices=tuple(POLICIES), default=DEFAULT_POLICY,
                   help=f"which evictable page goes first, both tiers (default {DEFAULT_POLICY})")
    p.add_argument("--metadata-only", action="store_true",
                   help="no tensors: tree, tiers, eviction and counted transfers only (any capacity)")
    p.add_argument("--concurrency", type=int_range(1, 4096), default=4, help="requests in flight at once, their pages locked (default %(default)s)")
    p.add_argument("--stage", type=nonneg_int, action="append", default=None,
                   help="replay only this stage (repeatable; default all stages)")
    p.add_argument("--device", type=device_name, default="cpu",
                   help="torch device of the device pools: cpu, cuda or cuda:N (default %(default)s)")
    p.add_argument("--threads", type=int_range(1, 1024), default=1,
                   help="torch CPU threads (default 1: small copies are fastest single-threaded)")
    p.add_argument("--verify", action="store_true", help="check every reused page byte for byte")
    p.add_argument("--check-every", type=nonneg_int, default=0, metavar="N",
                   help="check tree invariants and page accounting every N requests")
    p.add_argument("--no-insight", action="store_true",
                   help="keep no miss reasons or lifetimes (docs/hicache.md, cache insight)")
    p.add_argument("--insight-sample", type=positive_int, default=insight_overhead.DEFAULT_INSIGHT_SAMPLE,
                   metavar="K", help="lifetimes: watch the entries of every K-th lookup (default "
                   "%(default)s; miss reasons are exact whatever K)")
    p.add_argument("--seen-keys", type=int_range(1, 1 << 26), default=1 << 18, metavar="N",
                   help="evicted keys remembered to tell them from never-seen ones (default %(default)s)")
    p.add_argument("--insight-overhead", type=int_range(0, 200), metavar="R", default=None,
                   help="what the insight costs the replay: R pairs of metadata-only replays with and "
                   "without it, the median difference as a share of the replay time (default "
                   f"{insight_overhead.DEFAULT_OVERHEAD_REPEATS}, with --metadata-only 0; 0: not measured)")
    p.add_argument("--json", action="store_true", help="print the full JSON result instead of the table")
    add_l3_args(p, defaults.BENCH_L3_BACKEND)
    p.set_defaults(func=_run_hicache)


def _register_l3(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("l3", help="time each L3 backend against the plain I/O beneath it: file store vs "
                       "sequential write/read on the same disk, Mooncake store vs direct Mooncake calls (JSON)")
    p.add_argument("--backend", choices=("file", "mooncake", "all"), default="all",
                   help="which backends to time (default %(default)s: every one installed; mooncake "
                   "needs the l3 extra, pip install '.[l3]', and is skipped with one line without it)")
    p.add_argument("--pages", type=int_range(1, 4096), default=32,
                   help="objects per batch (default %(default)s)")
    p.add_argument("--page-mib", type=positive_float, default=4.0,
                   help="MiB per object (default %(default)g, one page of a large stage)")
    p.add_argument("--rounds", type=int_range(1, 50), default=3,
                   help="interleaved rounds per technique; the median counts (default %(default)s)")
    p.add_argument("--dir", default=None, metavar="DIR",
                   help="file backend: where both the store and the plain file go (default: $TMPDIR)")
    p.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")
    p.set_defaults(func=_run_l3)


def _run_l3(args: argparse.Namespace) -> int:
    from ..bench import l3 as bench_l3
    from ..storage.base import StoreUnavailable
    from ..storage.mooncake import MOONCAKE_EXTRA, _import_store

    backends = ["file", "mooncake"] if args.backend == "all" else [args.backend]
    skipped: list[dict[str, str]] = []
    if "mooncake" in backends:
        try:
            _import_store(f"--backend {args.backend}")
        except StoreUnavailable as exc:
            if args.backend == "mooncake":  # asked for by name: bad input
                raise ConfigError(str(exc)) from None
            backends.remove("mooncake")
            skipped.append({"backend": "mooncake", "reason": str(exc)})
            print(f"bench l3: mooncake skipped, the Mooncake extra is not installed; to time it too: "
                  f"{MOONCAKE_EXTRA}, then --backend mooncake or all", file=sys.stderr, flush=True)
    try:
        res = bench_l3.run_bench(backends, args.pages, args.page_mib, args.rounds, args.dir)
    except StoreUnavailable as exc:
        raise ConfigError(str(exc)) from None
    res["skipped"] = skipped
    print(json.dumps(res, indent=2))
    return 0


def _run_hicache(args: argparse.Namespace) -> int:
    from ..bench import hicache_report

    bench_device(args.device)
    if args.verify and args.metadata_only:
        raise ConfigError("--verify checks page bytes; --metadata-only has none: use one of them")
    args.l3_options = l3_options(args)
    if args.l3_options.enabled and args.metadata_only:
        raise ConfigError(f"--l3 {args.l3}: L3 holds page bytes; --metadata-only has none: use one of them")
    if args.no_insight and args.insight_overhead:
        raise ConfigError("--insight-overhead compares runs with and without the insight; "
                          "--no-insight turns it off: use one of them")
    if args.insight_overhead is None:
        # a metadata-only bench is already the cheap replay the pairs would repeat, and a whole
        # public trace takes seconds per pair: the paired check is asked for there, not implied
        args.insight_overhead = 0 if args.no_insight or args.metadata_only else \
            insight_overhead.DEFAULT_OVERHEAD_REPEATS
    res = bench_hicache.run_bench(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        hicache_report.print_table(res)
    bad = res["summary"]["hicache"]["mismatches"] + res["summary"]["device_only"]["mismatches"]
    if bad:
        for mode in ("hicache", "device_only"):
            for r in res["per_stage"][mode]:
                for m in r["replay"]["mismatches"]:
                    print(f"stagecache bench hicache: MISMATCH ({mode}): {m}", file=sys.stderr)
        return 1
    return 0
