"""``stagecache bench http``: flags of the dashboard server's load benchmark (runtime/bench/http_load.py)."""

from __future__ import annotations

import argparse

from .common import int_range, output_file, positive_int, print_json_result


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "http", help="dashboard/metrics server latency and throughput under concurrent clients",
        description="Start a real `stagecache serve` (or use --url), then measure /healthz latency "
        "(keep-alive and fresh connections), N clients x M requests over /metrics, /api/* and "
        "/healthz, and the idle keep-alive timeout; prints JSON. Exit 0 when every target of "
        "docs/serve.md holds, 1 when one does not.")
    p.add_argument("--url", default=None, help="measure this running server instead of starting one")
    p.add_argument("--clients", type=int_range(1, 256), default=16, help="concurrent clients (default 16)")
    p.add_argument("--requests", type=int_range(1, 10_000_000), default=10_000,
                   help="requests of the mixed load, all clients together (default 10000)")
    p.add_argument("--idle-requests", type=positive_int, default=1000,
                   help="sequential /healthz requests per connection mode (default 1000)")
    p.add_argument("--while-serving", action="store_true",
                   help="load the server while its stages serve a paced trace (default: after it)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the same-run baseline (the app on a socket without TCP_NODELAY)")
    p.add_argument("--no-keep-alive-check", action="store_true",
                   help="skip timing how long an idle keep-alive connection stays open")
    p.add_argument("--out", type=output_file("--out"), default=None, help="also write the JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench.http_load import HttpBenchOptions, check_url, run_bench

    if args.url is not None:
        check_url(args.url)
    res = run_bench(HttpBenchOptions(
        url=args.url, clients=args.clients, requests=args.requests, idle_requests=args.idle_requests,
        while_serving=args.while_serving, baseline=not args.no_baseline,
        keep_alive_check=not args.no_keep_alive_check))
    print_json_result(res, args.out)
    return 0 if res["ok"] else 1
