"""``stagecache bench policies``: flags of the eviction-policy benchmark (runtime/bench/policies.py)."""

from __future__ import annotations

import argparse

from ..bench import policies as bench_policies
from .common import add_bench_trace_args, int_range, print_json_result


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "policies", help="time advise --policies (5 policies x N sizes) against the replay (JSON)",
        description="Run sglang's five radix eviction policies at --sizes device sizes through "
        "advise's tree model, then stagecache's metadata-only LRU replay at the same sizes, in one "
        "process pinned to one CPU core; prints JSON with both times and the peak RSS. Default "
        "trace: a generated one the size of the Mooncake FAST'25 synthetic trace.")
    add_bench_trace_args(p, requests_default=4_000)
    p.add_argument("--sizes", type=int_range(1, 100), default=bench_policies.DEFAULT_SIZES,
                   help="device sizes (default %(default)s)")
    p.add_argument("--policy-order", choices=("auto", "sglang", "stagecache"), default="auto",
                   help="whose strategy classes rank the leaves (as advise --policy-order)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .advise import _strategy_factory

    factory, source = _strategy_factory(args.policy_order)
    res = bench_policies.run_bench(args, factory, source)
    print_json_result(res, args.out)
    return 0
