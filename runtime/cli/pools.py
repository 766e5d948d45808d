"""``stagecache pools``: per stage, per pool byte accounting of device pools and host mirror.

Computed with the same ``pool_sizing`` functions ``StagePools`` allocates
with (a test checks the real tensors add up to these numbers), so what this
prints is what a stage will take, before any GPU is touched.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import ConfigError
from .common import add_layout_args, float_range, layout_from_args, positive_float, positive_int

DEFAULT_MAX_TOTAL_TOKENS = 262_144
GIB = 1 << 30


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pools",
        help="byte accounting of every stage's device pools and host (HiCache) mirror",
        description="Per PP stage and pool kind: buffers, bytes per page, device and host bytes.",
    )
    add_layout_args(p)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--max-total-tokens", type=positive_int, default=None,
                      help=f"tokens every stage's pools hold (default {DEFAULT_MAX_TOTAL_TOKENS})")
    size.add_argument("--mem-budget-gb", type=float_range(0.0, 1 << 20, low_open=True), default=None,
                      help="device memory per stage for KV pools, GiB; pages = budget // bytes per token page")
    host = p.add_mutually_exclusive_group()
    host.add_argument("--hicache-ratio", type=positive_float, default=None,
                      help="host pages = device pages x ratio (default 2.0, like sglang)")
    host.add_argument("--hicache-size-gb", type=float_range(0.0, 1 << 20, low_open=True), default=None,
                      help="host mirror size per stage, GiB (overrides the ratio)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def accounting(args: argparse.Namespace) -> dict[str, Any]:
    """The whole report as a dict (also the --json output)."""
    from ..memory.sizing import (
        host_pages_for,
        pages_for_budget,
        pages_for_tokens,
        stage_accounts,
        stage_token_page_bytes,
    )
    from ..validation.faults import buffer_plan

    la = layout_from_args(args)
    spec, page_size = la.spec, la.page_size
    from ..memory.sizing import check_layout_page_size

    check_layout_page_size(spec, page_size)
    max_tokens = args.max_total_tokens
    if max_tokens is None and args.mem_budget_gb is None:
        max_tokens = DEFAULT_MAX_TOTAL_TOKENS
    stages = []
    totals = {"device_bytes": 0, "host_bytes": 0}
    for m in la.layout.stages:
        counts = {p: len(s) for p, s in buffer_plan(m, spec.compress_ratios, la.faults, la.layout.pp_size).items()}
        per_page = stage_token_page_bytes(spec, m, page_size, counts)
        if max_tokens is not None:
            dev_pages = pages_for_tokens(max_tokens, page_size)
        else:
            dev_pages = pages_for_budget(spec, m, page_size, int(args.mem_budget_gb * GIB))
        size_b = int(args.hicache_size_gb * GIB) if args.hicache_size_gb is not None else None
        host_pages = host_pages_for(dev_pages, args.hicache_ratio, size_b, per_page)
        rows = stage_accounts(spec, m, page_size, dev_pages, host_pages, counts)
        dev_b = sum(r.device_bytes for r in rows)
        host_b = sum(r.host_bytes for r in rows)
        totals["device_bytes"] += dev_b
        totals["host_bytes"] += host_b
        stages.append({
            "stage": m.stage, "start_layer": m.start, "end_layer": m.end, "local_layers": m.local_layers,
            "device_pages": dev_pages, "host_pages": host_pages,
            "device_tokens": dev_pages * page_size, "host_tokens": host_pages * page_size,
            "token_page_bytes": per_page, "device_bytes": dev_b, "host_bytes": host_b,
            "pools": [r.to_dict() for r in rows],
        })
    if not stages:
        raise ConfigError("no stage to account for")
    return {
        "model": spec.name, "num_layers": spec.num_layers, "pp_size": la.layout.pp_size,
        "page_size": page_size, "faults": [f.name for f in la.faults],
        "sizing": ({"max_total_tokens": max_tokens} if max_tokens is not None
                   else {"mem_budget_gb": args.mem_budget_gb}),
        "hicache": ({"size_gb": args.hicache_size_gb} if args.hicache_size_gb is not None
                    else {"ratio": 2.0 if args.hicache_ratio is None else args.hicache_ratio}),
        "stages": stages, "totals": totals,
    }


def run(args: argparse.Namespace) -> int:
    report = accounting(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_accounting(report)
    return 0


def human(n: int) -> str:
    """Bytes in binary units, 3 significant digits (tables); JSON keeps exact bytes."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{n} B"


def print_accounting(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..model.layer_map import POOL_LABELS

    console = Console(width=140)
    sizing = ", ".join(f"{k}={v}" for k, v in report["sizing"].items())
    hic = ", ".join(f"hicache_{k}={v}" for k, v in report["hicache"].items())
    title = (f"{report['model']}: {report['num_layers']} layers, pp={report['pp_size']}, "
             f"page={report['page_size']} tokens, {sizing}, {hic}"
             + (f", faults={','.join(report['faults'])}" if report["faults"] else ""))
    table = Table(title=title)
    for col, just in (("stage", "right"), ("layers", "left"), ("pool", "left"), ("buffers", "right"),
                      ("rows/page", "right"), ("B/page", "right"), ("device pages", "right"),
                      ("device", "right"), ("host pages", "right"), ("host", "right")):
        table.add_column(col, justify=just)
    for s in report["stages"]:
        first = True
        for r in s["pools"]:
            if not r["buffers"]:
                continue
            table.add_row(
                str(s["stage"]) if first else "", f"[{s['start_layer']}, {s['end_layer']})" if first else "",
                POOL_LABELS[r["pool"]], str(r["buffers"]), str(r["rows_per_page"]), f"{r['page_bytes']:,}",
                f"{r['device_pages']:,}", human(r["device_bytes"]), f"{r['host_pages']:,}", human(r["host_bytes"]),
            )
            first = False
        table.add_row("", "", "[bold]stage total[/bold]", "", "", f"{s['token_page_bytes']:,}",
                      f"{s['device_pages']:,}", f"[bold]{human(s['device_bytes'])}[/bold]",
                      f"{s['host_pages']:,}", f"[bold]{human(s['host_bytes'])}[/bold]", end_section=True)
    t = report["totals"]
    table.add_row("", "", "[bold]all stages[/bold]", "", "", "", "", f"[bold]{human(t['device_bytes'])}[/bold]",
                  "", f"[bold]{human(t['host_bytes'])}[/bold]")
    console.print(table)
