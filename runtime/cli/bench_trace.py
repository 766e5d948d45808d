"""``stagecache bench advise`` and ``bench policies``: the two trace benchmarks (runtime/bench/advise.py,
runtime/bench/policies.py), which read a trace or generate one and time a model against a replay."""

from __future__ import annotations

import argparse

from ..bench import advise as bench_advise
from ..bench import policies as bench_policies
from .common import add_bench_trace_args, int_range, print_json_result


def register(sub: argparse._SubParsersAction) -> None:
    _parser(sub, "advise", "time advise's one pass over a trace against replaying it at N sizes (JSON)",
            "Read a trace and compute its hit-rate curves at every size in one pass, then replay it "
            "(metadata-only HiCache, LRU, write-through) at --sizes sizes in the same run, pinned to one "
            "CPU core; prints JSON with both times, their ratio and how far each replay is from the "
            "curve. Default trace: a generated one sized like the public Mooncake conversation trace.",
            12_000, int_range(1, 1000), bench_advise.DEFAULT_SIZES, "host sizes to replay at", _run_advise)
    p = _parser(sub, "policies", "time advise --policies (5 policies x N sizes) against the replay (JSON)",
                "Run sglang's five radix eviction policies at --sizes device sizes through advise's tree "
                "model, then stagecache's metadata-only LRU replay at the same sizes, in one process "
                "pinned to one CPU core; prints JSON with both times and the peak RSS. Default trace: a "
                "generated one the size of the Mooncake FAST'25 synthetic trace.",
                4_000, int_range(1, 100), bench_policies.DEFAULT_SIZES, "device sizes", _run_policies)
    p.add_argument("--policy-order", choices=("auto", "sglang", "stagecache"), default="auto",
                   help="whose strategy classes rank the leaves (as advise --policy-order)")


def _parser(sub: argparse._SubParsersAction, name: str, help: str, description: str, requests: int,
            sizes_type: object, sizes: object, sizes_help: str, run: object) -> argparse.ArgumentParser:
    """One trace benchmark's parser: the trace flags, ``--sizes`` and ``--out``."""
    p = sub.add_parser(name, help=help, description=description)
    add_bench_trace_args(p, requests_default=requests)
    p.add_argument("--sizes", type=sizes_type, default=sizes, help=f"{sizes_help} (default %(default)s)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON here")
    p.set_defaults(func=run)
    return p


def _run_advise(args: argparse.Namespace) -> int:
    print_json_result(bench_advise.run_bench(args), args.out)
    return 0


def _run_policies(args: argparse.Namespace) -> int:
    from .advise import _strategy_factory

    factory, source = _strategy_factory(args.policy_order)
    print_json_result(bench_policies.run_bench(args, factory, source), args.out)
    return 0
