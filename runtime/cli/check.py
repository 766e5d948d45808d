"""``stagecache check``: preflight every PP stage's layer map and pools without a GPU."""

from __future__ import annotations

import argparse
import json

from ..plan.plan import RunPlan
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


def live_only_lines(plan: RunPlan) -> list[str]:
    """One line per fault of the plan that only a serving stage acts on (``FaultKind.scope ==
    "serve"``): the layout it leaves is healthy, so ``check`` passes it -- and says so."""
    out = []
    for f in plan.faults:
        if f.kind.scope != "serve":
            continue
        where = "stagecache serve" + (", or the sglang plugin's STAGECACHE_FAULT" if f.kind.backup_left_out else "")
        out.append(f"--fault {f.name}: live only: it leaves the layout healthy and acts on a serving stage "
                   f"({where}); check has nothing to find")
    return out


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    report = preflight(plan)
    storage = storage_findings(args, report.pp_size)
    live_only = live_only_lines(plan)
    if args.json:
        out = report.to_dict()
        if args.sglang_storage:
            out["sglang_storage"] = storage
        print(json.dumps(out, indent=2))
    else:
        print_report(report)
        if storage:
            print_findings(storage)
        for line in live_only:
            output_console().print(line)
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
