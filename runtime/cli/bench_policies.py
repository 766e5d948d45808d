"""``stagecache bench policies``: flags of the eviction-policy benchmark (runtime/bench/policies.py)."""

from __future__ import annotations

import argparse
import json

from .. import defaults
from ..bench import policies as bench_policies
from .common import int_range, nonneg_int, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    from ..traces.mooncake_trace import DEFAULT_BLOCK_TOKENS

    p = sub.add_parser(
        "policies", help="time advise --policies (5 policies x N sizes) against the replay (JSON)",
        description="Run sglang's five radix eviction policies at --sizes device sizes through "
        "advise's tree model, then stagecache's metadata-only LRU replay at the same sizes, in one "
        "process pinned to one CPU core; prints JSON with both times and the peak RSS. Default "
        "trace: a generated one the size of the Mooncake FAST'25 synthetic trace.")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="JSONL trace, tokens or Mooncake format (default: generated)")
    p.add_argument("--trace-format", choices=("auto", "tokens", "mooncake"), default="auto",
                   help="format of --trace (default: detected from the first line)")
    p.add_argument("--page-size", type=positive_int, default=defaults.PAGE_SIZE,
                   help="tokens per page of a tokens trace (default %(default)s; Mooncake: one block)")
    p.add_argument("--block-tokens", type=positive_int, default=DEFAULT_BLOCK_TOKENS,
                   help=f"tokens per Mooncake hash id (default {DEFAULT_BLOCK_TOKENS})")
    p.add_argument("--requests", type=int_range(1, 10_000_000), default=4_000,
                   help="requests of the generated trace (default %(default)s)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the generated trace (default 0)")
    p.add_argument("--save-trace", default=None, metavar="FILE",
                   help="also write the generated trace here (Mooncake format)")
    p.add_argument("--sizes", type=int_range(1, 100), default=bench_policies.DEFAULT_SIZES,
                   help="device sizes (default %(default)s)")
    p.add_argument("--policy-order", choices=("auto", "sglang", "stagecache"), default="auto",
                   help="whose strategy classes rank the leaves (as advise --policy-order)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from .advise import _strategy_factory

    factory, source = _strategy_factory(args.policy_order)
    res = bench_policies.run_bench(args, factory, source)
    text = json.dumps(res, indent=2)
    if args.out:
        try:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        except OSError as exc:
            raise ConfigError(f"--out {args.out}: cannot write it: {exc.strerror or exc}") from None
    print(text)
    return 0
