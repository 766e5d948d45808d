"""``stagecache bench ...``: the argument tables and output of the benchmarks.

The benchmarks themselves live in ``stagecache.runtime.bench``; this module only
parses flags, calls them and prints (JSON, tables), so the benchmark code stays
importable without argparse.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..bench import check as bench_check
from ..bench import hicache as bench_hicache
from ..bench import transfer as bench_transfer
from ..model.layer_map import POOLS
from .common import add_layout_args, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (JSON output, ratios vs a same-run baseline)")
    bench_sub = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    _register_check(bench_sub)
    _register_transfer(bench_sub)
    _register_hicache(bench_sub)


def _register_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="time the startup check for pp 1..N")
    p.add_argument("--model", default=None, help="preset or config.json (default: synthetic 61-layer)")
    p.add_argument("--layers", type=int, default=61, help="layers of the synthetic model")
    p.add_argument("--max-pp", type=int, default=8)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--fault", action="append", default=[])
    p.add_argument("--json", action="store_true", help="(always JSON; kept for symmetry)")
    p.set_defaults(func=lambda a: print(json.dumps(
        bench_check.run_bench(a.model, a.layers, a.max_pp, a.repeat, a.fault), indent=2)) or 0)


def _register_transfer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transfer", help="device<->host page transfers vs contiguous copy and per-page loop")
    p.add_argument("--model", default="deepseek-v4-flash", help="preset or config.json (row sizes)")
    p.add_argument("--pages", type=positive_int, default=None,
                   help="pages per transfer (default: enough for --mib per pool kind)")
    p.add_argument("--mib", type=float, default=256.0, help="bytes per transfer when --pages is not given")
    p.add_argument("--layers", type=positive_int, default=11, help="layer buffers per transfer (flash pp4: 11)")
    p.add_argument("--page-size", type=positive_int, default=256, help="tokens per page")
    p.add_argument("--pool", action="append", choices=POOLS, help="pool kind(s) to measure (default all)")
    p.add_argument("--layout", action="append", choices=["layer_first", "page_first"])
    p.add_argument("--pattern", action="append", choices=["run", "scattered"], help="host page pattern")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--repeat", type=positive_int, default=5)
    p.add_argument("--loop-copies", type=positive_int, default=4000,
                   help="per-page loop baseline: copies actually timed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", action="store_true", help="also try several direct-kernel block sizes")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--json", action="store_true", help="(always JSON; kept for symmetry)")
    p.set_defaults(func=_run_transfer)


def _run_transfer(args: argparse.Namespace) -> int:
    report = bench_transfer.run_bench(args)
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


def _register_hicache(sub: argparse._SubParsersAction) -> None:
    from ..cache.eviction import DEFAULT_POLICY, POLICIES
    from ..cache.mooncake import DEFAULT_BLOCK_TOKENS
    from .common import DEFAULT_PAGE_SIZE

    p = sub.add_parser("hicache", help="replay a trace: HiCache vs device only vs the Belady bound "
                                       "and the infinite cache")
    add_layout_args(p, default_model="tiny-v4")
    # tokens traces: --page-size (default below); Mooncake traces: the page is a block
    p.set_defaults(page_size=None, default_page_size=DEFAULT_PAGE_SIZE)
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="JSONL trace, stagecache tokens or Mooncake format (docs/hicache.md); "
                        "default: a generated multi-turn chat trace")
    p.add_argument("--trace-format", choices=("auto", "tokens", "mooncake"), default="auto",
                   help="format of --trace (default: detected from the first line)")
    p.add_argument("--block-tokens", type=positive_int, default=DEFAULT_BLOCK_TOKENS,
                   help=f"tokens per Mooncake hash id; one block = one page (default {DEFAULT_BLOCK_TOKENS})")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed trace lines (reported) instead of refusing the whole file")
    p.add_argument("--save-trace", default=None, metavar="FILE", help="write the replayed trace as JSONL")
    p.add_argument("--requests", type=positive_int, default=None,
                   help=f"requests to generate (default {bench_hicache.DEFAULT_REQUESTS}), or the first N "
                        "of --trace (reading stops there)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--think-time", type=float, default=30.0, help="mean seconds between a session's turns")
    p.add_argument("--session-gap", type=float, default=1.5, help="mean seconds between session starts")
    p.add_argument("--device-pages", type=positive_int, default=bench_hicache.DEFAULT_DEVICE_PAGES,
                   help=f"device token pages per stage (default {bench_hicache.DEFAULT_DEVICE_PAGES})")
    p.add_argument("--hicache-ratio", type=float, default=bench_hicache.DEFAULT_HICACHE_RATIO,
                   help=f"host pages per device page (default {bench_hicache.DEFAULT_HICACHE_RATIO})")
    p.add_argument("--hicache-write-policy", "--write-policy", dest="write_policy",
                   choices=("write_back", "write_through", "write_through_selective"),
                   default="write_through", help="when device pages are copied to host (sglang's flag)")
    p.add_argument("--eviction-policy", choices=tuple(POLICIES), default=DEFAULT_POLICY,
                   help=f"which evictable page goes first, both tiers (default {DEFAULT_POLICY})")
    p.add_argument("--metadata-only", action="store_true",
                   help="no tensors: tree, tiers, eviction and counted transfers only (any capacity)")
    p.add_argument("--hicache-layout", choices=("layer_first", "page_first"), default="layer_first")
    p.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight (locked) at once")
    p.add_argument("--stage", type=int, action="append", default=None,
                   help="replay only this stage (repeatable; default all stages)")
    p.add_argument("--device", default="cpu", help="torch device of the device pools (cpu, cuda)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: small copies are fastest single-threaded)")
    p.add_argument("--verify", action="store_true", help="check every reused page byte for byte")
    p.add_argument("--check-every", type=int, default=0, metavar="N",
                   help="check tree invariants and page accounting every N requests")
    p.add_argument("--json", action="store_true", help="print the full JSON result")
    p.set_defaults(func=_run_hicache)


def _run_hicache(args: argparse.Namespace) -> int:
    from ..bench import hicache_report
    from ..errors import ConfigError

    if args.verify and args.metadata_only:
        raise ConfigError("--verify checks page bytes; --metadata-only has none: use one of them")
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
