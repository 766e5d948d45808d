"""``stagecache check --sglang-storage BACKEND``: do an sglang L3 backend's keys keep stages apart?"""

from __future__ import annotations

import argparse
from typing import Any

from ..integrations.storage_keys import BACKENDS, facts, verdict
from .common import output_console


def add_storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sglang-storage", action="append", default=None, metavar="BACKEND",
                   choices=(*BACKENDS, "all"),
                   help="also check sglang 0.5.23's --hicache-storage-backend BACKEND (repeatable; "
                   f"{', '.join(BACKENDS)} or all): do its L3 keys separate PP ranks, model, dtype "
                   "and layout?  Computed with sglang's own key functions where it imports, else "
                   "from the table in docs/l3.md")
    p.add_argument("--strict", action="store_true",
                   help="with --sglang-storage: a backend whose keys collide across PP stages "
                   "(pp-size > 1) is an error (exit 1), not a warning")
    p.add_argument("--mooncake-master", default=None, metavar="HOST:PORT",
                   help="with --sglang-storage mooncake: the master sglang's Mooncake client joins "
                   "to build its keys (default: one started on 127.0.0.1 for the check)")


def storage_findings(args: argparse.Namespace, pp_size: int) -> list[dict[str, Any]]:
    names = args.sglang_storage or []
    backends = list(BACKENDS) if "all" in names else list(dict.fromkeys(names))
    out = []
    for b in backends:
        f, why_table = facts(b, args.mooncake_master)
        level, line = verdict(f, pp_size)
        if level == "error" and not args.strict:
            level = "warning"
        out.append({**f.to_dict(), "level": level, "message": line, "table_because": why_table})
    return out


def print_findings(findings: list[dict[str, Any]]) -> None:
    from rich.markup import escape
    from rich.table import Table

    console = output_console()
    table = Table(title="sglang 0.5.23 L3 keys: does a key carry ...")
    for col in ("backend", "pp rank", "model", "dtype", "layout", "from", "verdict"):
        table.add_column(col)
    mark = {True: "[green]yes[/green]", False: "[red]no[/red]"}
    colour = {"ok": "green", "warning": "yellow", "error": "red"}
    for f in findings:
        table.add_row(f["backend"], mark[f["pp_rank"]], mark[f["model"]], mark[f["dtype"]],
                      mark[f["layout"]], "sglang's key functions" if f["how"] == "sglang" else "table",
                      f"[{colour[f['level']]}]{f['level']}[/{colour[f['level']]}]")
    console.print(table)
    for f in findings:
        if f["level"] != "ok":
            console.print(f"[{colour[f['level']]}]{escape(f['message'])}[/{colour[f['level']]}]")
        if f["table_because"]:
            console.print(f"{f['backend']}: from the table ({escape(f['table_because'])}); source: "
                          f"{escape(f['source'])}")
