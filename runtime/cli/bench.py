"""``stagecache bench ...``: benchmarks that print JSON with ratios against a same-run baseline."""

from __future__ import annotations

import argparse
import importlib

#: One module per benchmark, each with ``register(subparsers)``.
BENCH_MODULES = (
    "stagecache.runtime.bench.check",
    "stagecache.runtime.bench.transfer",
    "stagecache.runtime.bench.hicache",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (JSON output, ratios vs a same-run baseline)")
    bench_sub = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    for name in BENCH_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(bench_sub)
