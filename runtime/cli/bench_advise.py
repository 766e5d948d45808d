"""``stagecache bench advise``: flags of the one-pass-versus-replays benchmark (runtime/bench/advise.py)."""

from __future__ import annotations

import argparse
import json

from .. import defaults
from ..bench import advise as bench_advise
from .common import int_range, nonneg_int, positive_int


def register(sub: argparse._SubParsersAction) -> None:
    from ..traces.mooncake_trace import DEFAULT_BLOCK_TOKENS

    p = sub.add_parser(
        "advise", help="time advise's one pass over a trace against replaying it at N sizes (JSON)",
        description="Read a trace and compute its hit-rate curves at every size in one pass, then "
        "replay it (metadata-only HiCache, LRU, write-through) at --sizes sizes in the same run, "
        "pinned to one CPU core; prints JSON with both times, their ratio and how far each replay "
        "is from the curve. Default trace: a generated one sized like the public Mooncake "
        "conversation trace.")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="JSONL trace, tokens or Mooncake format (default: generated)")
    p.add_argument("--trace-format", choices=("auto", "tokens", "mooncake"), default="auto",
                   help="format of --trace (default: detected from the first line)")
    p.add_argument("--page-size", type=positive_int, default=defaults.PAGE_SIZE,
                   help="tokens per page of a tokens trace (default %(default)s; Mooncake: one block)")
    p.add_argument("--block-tokens", type=positive_int, default=DEFAULT_BLOCK_TOKENS,
                   help=f"tokens per Mooncake hash id (default {DEFAULT_BLOCK_TOKENS})")
    p.add_argument("--requests", type=int_range(1, 10_000_000), default=12_000,
                   help="requests of the generated trace (default %(default)s)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the generated trace (default 0)")
    p.add_argument("--save-trace", default=None, metavar="FILE",
                   help="also write the generated trace here (Mooncake format)")
    p.add_argument("--sizes", type=int_range(1, 1000), default=bench_advise.DEFAULT_SIZES,
                   help="host sizes to replay at (default %(default)s)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError

    res = bench_advise.run_bench(args)
    text = json.dumps(res, indent=2)
    if args.out:
        try:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        except OSError as exc:
            raise ConfigError(f"--out {args.out}: cannot write it: {exc.strerror or exc}") from None
    print(text)
    return 0
