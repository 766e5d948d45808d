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
from ..model.pool_kinds import HOST_CACHED
from . import bench_http
from .common import (
    add_layout_args,
    fault_spec,
    int_range,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure startup checks, page transfers or a HiCache replay (JSON on stdout, "
                       "each figure with its ratio to a baseline measured in the same run)")
    bench_sub = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    _register_check(bench_sub)
    _register_transfer(bench_sub)
    _register_hicache(bench_sub)
    bench_http.register(bench_sub)


def _register_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="time the startup validation for pp sizes 1..N")
    p.add_argument("--model", default=None, help="preset name or path to a config.json (default: a synthetic model of --layers layers)")
    p.add_argument("--layers", type=int_range(1, 4096), default=61, help="layers of the synthetic model (default %(default)s)")
    p.add_argument("--max-pp", type=int_range(1, 4096), default=8, help="largest pp size to time (default %(default)s)")
    p.add_argument("--repeat", type=positive_int, default=50, help="timed runs per pp size (default %(default)s)")
    p.add_argument("--fault", action="append", default=[], metavar="NAME[@STAGE]", type=fault_spec,
                   help="time the check on stages built the way a known bug did (repeatable)")
    p.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")
    p.set_defaults(func=lambda a: print(json.dumps(
        bench_check.run_bench(a.model, a.layers, a.max_pp, a.repeat, a.fault), indent=2)) or 0)


def _register_transfer(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transfer", help="time device<->host page copies against one contiguous copy and a per-page loop")
    p.add_argument("--model", default="deepseek-v4-flash", help="preset name or config.json whose page sizes are copied (default %(default)s)")
    p.add_argument("--pages", type=positive_int, default=None,
                   help="pages per transfer (default: enough for --mib per pool kind)")
    p.add_argument("--mib", type=positive_float, default=256.0, help="MiB per transfer when --pages is not given (default %(default)s)")
    p.add_argument("--layers", type=positive_int, default=11, help="layers copied per transfer (default %(default)s, a deepseek-v4-flash stage at pp 4)")
    p.add_argument("--page-size", type=positive_int, default=256, help="tokens per page (default %(default)s)")
    p.add_argument("--pool", action="append", choices=HOST_CACHED,
                   help="pool kind to measure (repeatable; default: every host-cached kind)")
    p.add_argument("--layout", action="append", choices=["layer_first", "page_first"],
                   help="host pool memory layout (repeatable; default: both)")
    p.add_argument("--pattern", action="append", choices=["run", "scattered"], help="host pages contiguous (run) or spread out (scattered) (repeatable; default: both)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--repeat", type=positive_int, default=5, help="timed runs per case (default %(default)s)")
    p.add_argument("--loop-copies", type=positive_int, default=4000,
                   help="page copies timed for the per-page loop baseline (default %(default)s)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the scattered page pattern (default 0)")
    p.add_argument("--sweep", action="store_true", help="also time several block sizes of the direct copy kernel")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--json", action="store_true", help="accepted for symmetry: the output is always JSON")
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
    p = sub.add_parser("hicache", help="replay a chat trace: prefix-cache hits with HiCache vs device only vs an infinite cache")
    add_layout_args(p, default_model="tiny-v4")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="JSONL trace (docs/hicache.md); default: a generated multi-turn chat trace")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed trace lines (reported) instead of refusing the whole file")
    p.add_argument("--save-trace", default=None, metavar="FILE", help="write the replayed trace as JSONL")
    p.add_argument("--requests", type=positive_int, default=None,
                   help=f"requests to generate (default {bench_hicache.DEFAULT_REQUESTS}) or to take from --trace")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the generated trace (default 0)")
    p.add_argument("--think-time", type=nonneg_float, default=30.0, help="mean seconds between a session's turns (default %(default)s)")
    p.add_argument("--session-gap", type=nonneg_float, default=1.5, help="mean seconds between session starts (default %(default)s)")
    p.add_argument("--device-pages", type=positive_int, default=bench_hicache.DEFAULT_DEVICE_PAGES,
                   help=f"device token pages per stage (default {bench_hicache.DEFAULT_DEVICE_PAGES})")
    p.add_argument("--hicache-ratio", type=positive_float, default=bench_hicache.DEFAULT_HICACHE_RATIO,
                   help=f"host pages per device page (default {bench_hicache.DEFAULT_HICACHE_RATIO})")
    p.add_argument("--hicache-write-policy", "--write-policy", dest="write_policy",
                   choices=("write_back", "write_through", "write_through_selective"),
                   default="write_through", help="when device pages are copied to host (sglang's flag)")
    p.add_argument("--hicache-layout", choices=("layer_first", "page_first"), default="layer_first")
    p.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight at once, their pages locked (default %(default)s)")
    p.add_argument("--stage", type=nonneg_int, action="append", default=None,
                   help="replay only this stage (repeatable; default all stages)")
    p.add_argument("--device", default="cpu", help="torch device of the device pools: cpu or cuda (default %(default)s)")
    p.add_argument("--threads", type=int_range(1, 1024), default=1,
                   help="torch CPU threads (default 1: small copies are fastest single-threaded)")
    p.add_argument("--verify", action="store_true", help="check every reused page byte for byte")
    p.add_argument("--check-every", type=nonneg_int, default=0, metavar="N",
                   help="check tree invariants and page accounting every N requests")
    p.add_argument("--json", action="store_true", help="print the full JSON result instead of the table")
    p.set_defaults(func=_run_hicache)


def _run_hicache(args: argparse.Namespace) -> int:
    res = bench_hicache.run_bench(args)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        bench_hicache.print_table(res)
    bad = res["summary"]["hicache"]["mismatches"] + res["summary"]["device_only"]["mismatches"]
    if bad:
        for mode in ("hicache", "device_only"):
            for r in res["per_stage"][mode]:
                for m in r["replay"]["mismatches"]:
                    print(f"stagecache bench hicache: MISMATCH ({mode}): {m}", file=sys.stderr)
        return 1
    return 0
