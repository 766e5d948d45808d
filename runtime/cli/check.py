"""``stagecache check``: preflight every PP stage's layer map and pools without a GPU."""

from __future__ import annotations

import argparse
import json

from ..validation.deployment import preflight
from ..validation.report import StartupReport
from .check_storage import add_storage_args, print_findings, storage_findings
from .common import add_layout_command, output_console, plan_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = add_layout_command(sub, "check", help="validate every PP stage's layer map and pool sizes",
                           description="Exit 0: every stage valid; 1: mapping errors found; 2: bad input.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = preflight(plan_from_args(args))
    storage = storage_findings(args, report.pp_size)
    if args.json:
        out = report.to_dict()
        if args.sglang_storage:
            out["sglang_storage"] = storage
        print(json.dumps(out, indent=2))
    else:
        print_report(report)
        if storage:
            print_findings(storage)
    return 0 if report.ok and not any(f["level"] == "error" for f in storage) else 1


def print_report(report: StartupReport) -> None:
    from rich.table import Table

    console = output_console()
    title = (
        f"{report.model}: {report.num_layers} layers, pp={report.pp_size} tp={report.tp_size}, "
        f"page={report.page_size}" + (f", faults={','.join(report.faults)}" if report.faults else "")
    )
    table = Table(title=title)
    # the kinds the report keeps (``report.shown_pools``: not a kind no stage has nor needs)
    first = report.stages[0] if report.stages else None
    pools = tuple(p for p in first.pools if p in first.buffers or p in first.expected) if first else ()
    for col in ("stage", "layers", "local", *pools, "status"):
        table.add_column(col, justify="right" if col not in ("status", "layers") else "left")
    for s in report.stages:
        cells = []
        for pool in pools:
            got, want = s.buffers.get(pool, 0), s.expected.get(pool, 0)
            cells.append(str(got) if got == want else f"[red]{got}/{want}[/red]")
        status = "[green]OK[/green]" if s.ok else "[red]" + "; ".join(e.message for e in s.errors) + "[/red]"
        table.add_row(str(s.stage), f"[{s.start}, {s.end})", str(s.local_layers), *cells, status)
    console.print(table)
    for e in report.cross_errors:
        console.print(f"[red]cross-stage[/red] {e.pool}: {e.message}")
    n = len(report.all_errors)
    console.print("[green]all stages valid[/green]" if report.ok else f"[red]{n} mapping error(s)[/red]")
