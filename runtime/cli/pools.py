"""``stagecache pools``: per stage and pool kind, what sglang 0.5.23 allocates on device and host.

The numbers come from ``memory.accounting`` (pool-kind table + sglang's sizing
rules); tests/test_sglang_live.py checks them field by field against sglang's
own ``DeepSeekV4TokenToKVPool`` and HiCache assembler.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from ..memory.accounting import DEFAULT_MAX_TOTAL_TOKENS, SizingOptions, account
from ..memory.sizing import DSV4_MAX_RUNNING_REQUESTS, DSV4_PAGE_SIZE
from ..validation.inputs import LayoutArgs, resolve_layout
from .common import add_layout_command, float_range, int_range, positive_float, positive_int

GIB = 1 << 30


def register(sub: argparse._SubParsersAction) -> None:
    p = add_layout_command(
        sub, "pools",
        help="what sglang allocates for every stage's device pools and host (HiCache) mirror",
        description="Per PP stage and pool kind: buffers, bytes per page, device and host pages and bytes.",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--max-total-tokens", type=positive_int, default=None,
                      help=f"full-attention tokens per stage (default {DEFAULT_MAX_TOTAL_TOKENS})")
    size.add_argument("--mem-budget-gb", type=float_range(0.0, 1 << 20, low_open=True), default=None,
                      help="KV memory per stage, GiB; full tokens as sglang's configurator fits them "
                           "(the smallest stage's, as PP ranks agree on one)")
    p.add_argument("--swa-full-tokens-ratio", type=float_range(0.0, 1.0, low_open=True), default=None,
                   help="SWA tokens / full tokens (default 0.1, sglang's for DeepSeek-V4)")
    p.add_argument("--max-running-requests", type=int_range(1, 1 << 20), default=DSV4_MAX_RUNNING_REQUESTS,
                   help=f"request slots of the per-request pools (default {DSV4_MAX_RUNNING_REQUESTS}, "
                        "sglang's for DeepSeek-V4)")
    host = p.add_mutually_exclusive_group()
    host.add_argument("--hicache-ratio", type=positive_float, default=None,
                      help="host pages = device pages x ratio, per budget (default 2.0, like sglang)")
    host.add_argument("--hicache-size-gb", type=float_range(0.0, 1 << 20, low_open=True), default=None,
                      help="refused for DeepSeek-V4, as sglang refuses --hicache-size")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _gib(value: float | None) -> int | None:
    return int(value * GIB) if value is not None else None


def _layout(args: argparse.Namespace) -> LayoutArgs:
    """sglang sizes DeepSeek-V4 with 256-token pages whatever --page-size says; the layout is
    checked against that page size, and the report says when it overrode the flag."""
    return resolve_layout(args.model, args.pp_size, args.tp_size, args.pp_partition, DSV4_PAGE_SIZE, args.fault)


def _sizing(args: argparse.Namespace) -> SizingOptions:
    return SizingOptions(
        max_total_tokens=args.max_total_tokens,
        mem_budget_bytes=_gib(args.mem_budget_gb),
        swa_ratio=args.swa_full_tokens_ratio,
        max_running_requests=args.max_running_requests,
        hicache_ratio=args.hicache_ratio,
        hicache_size_bytes=_gib(args.hicache_size_gb),
    )


def accounting(args: argparse.Namespace) -> dict[str, Any]:
    """The whole report as a dict (also the --json output)."""
    la = _layout(args)
    return account(la.layout, args.page_size, _sizing(args), la.faults)


def this_host(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, Any] | None:
    """Would the host tiers of every stage fit *this* host's RAM?  (A planning hint: nothing
    is allocated; sglang's host may be another machine.)  None where /proc/meminfo is missing."""
    from ..memory.host_tier import fitting_ratio, ram_budget, read_meminfo

    mem = read_meminfo()
    if mem is None:
        return None
    need = report["totals"]["host_bytes"]
    out = {"mem_available_bytes": mem.available, "reserve_bytes": mem.reserve(), "host_bytes": need,
           "fits": need <= ram_budget(mem), "advice": None}
    if not out["fits"]:
        la, base = _layout(args), _sizing(args)

        def host_bytes(_pages: int, r: float) -> int:
            opts = dataclasses.replace(base, hicache_ratio=r)
            return account(la.layout, args.page_size, opts, la.faults)["totals"]["host_bytes"]

        fit = fitting_ratio(host_bytes, ram_budget(mem), report["stages"][0]["swa_device_pages"],
                            report["sizing"]["hicache_ratio"])
        out["advice"] = (f"lower --hicache-ratio to {fit:g}" if fit is not None
                         else "no --hicache-ratio fits this host")
    return out


def run(args: argparse.Namespace) -> int:
    report = accounting(args)
    report["this_host"] = this_host(args, report)
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


def _title(report: dict[str, Any]) -> str:
    sz, s0 = report["sizing"], report["stages"][0]
    budget = f", budget {human(sz['mem_budget_bytes'])}/stage" if "mem_budget_bytes" in sz else ""
    return (f"{report['model']}: {report['num_layers']} layers, pp={report['pp_size']}, "
            f"page={report['page_size']}{budget}: full {s0['full_tokens']:,} tokens, swa {s0['swa_tokens']:,} "
            f"(ratio {sz['swa_full_tokens_ratio']}), {s0['request_slots']} request slots, "
            f"hicache_ratio={sz['hicache_ratio']}"
            + (f", faults={','.join(report['faults'])}" if report["faults"] else ""))


def print_accounting(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..model.pool_kinds import KINDS

    console = Console(width=160)
    table = Table(title=_title(report))
    for col, just in (("stage", "right"), ("layers", "left"), ("pool", "left"), ("buffers", "right"),
                      ("sized by", "left"), ("B/page", "right"), ("device pages", "right"),
                      ("device", "right"), ("host pages", "right"), ("host", "right")):
        table.add_column(col, justify=just)
    for s in report["stages"]:
        first = True
        for r in s["pools"]:
            if not r["buffers"]:
                continue
            unit = " /slot" if r["budget"] == "request" else ""
            table.add_row(
                str(s["stage"]) if first else "", f"[{s['start_layer']}, {s['end_layer']})" if first else "",
                KINDS[r["pool"]].label, str(r["buffers"]), r["budget"], f"{r['page_bytes']:,}{unit}",
                f"{r['device_pages']:,}", human(r["device_bytes"]),
                f"{r['host_pages']:,}" if r["host_cached"] else "-", human(r["host_bytes"]),
            )
            first = False
        table.add_row("", "", "[bold]stage total[/bold]", "", "", f"{s['token_page_bytes']:,}",
                      "", f"[bold]{human(s['device_bytes'])}[/bold]",
                      "", f"[bold]{human(s['host_bytes'])}[/bold]", end_section=True)
    t = report["totals"]
    table.add_row("", "", "[bold]all stages[/bold]", "", "", "", "", f"[bold]{human(t['device_bytes'])}[/bold]",
                  "", f"[bold]{human(t['host_bytes'])}[/bold]")
    console.print(table)
    for note in report["notes"]:
        console.print(f"note: {note}")
    for s in report["stages"]:
        for status, reason in zip(s["host_tier"]["status"], s["host_tier"]["reasons"], strict=True):
            if status != "ok":
                console.print(f"warning: {reason}")
    host = report.get("this_host")
    if host is not None and not host["fits"]:
        console.print(f"this host: the host tiers of all stages ({human(host['host_bytes'])}) would not "
                      f"fit its {human(host['mem_available_bytes'] - host['reserve_bytes'])} of available "
                      f"RAM above the reserve; {host['advice']}")
