"""``stagecache bench advise``: flags of the one-pass-versus-replays benchmark (runtime/bench/advise.py)."""

from __future__ import annotations

import argparse

from ..bench import advise as bench_advise
from .common import add_bench_trace_args, int_range, print_json_result


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "advise", help="time advise's one pass over a trace against replaying it at N sizes (JSON)",
        description="Read a trace and compute its hit-rate curves at every size in one pass, then "
        "replay it (metadata-only HiCache, LRU, write-through) at --sizes sizes in the same run, "
        "pinned to one CPU core; prints JSON with both times, their ratio and how far each replay "
        "is from the curve. Default trace: a generated one sized like the public Mooncake "
        "conversation trace.")
    add_bench_trace_args(p, requests_default=12_000)
    p.add_argument("--sizes", type=int_range(1, 1000), default=bench_advise.DEFAULT_SIZES,
                   help="host sizes to replay at (default %(default)s)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    res = bench_advise.run_bench(args)
    print_json_result(res, args.out)
    return 0
