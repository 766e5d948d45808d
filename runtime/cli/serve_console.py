"""``serve``'s human output: progress bar, startup verdict, the final per-stage table.

stdout normally; under ``--json`` everything here goes to stderr so that stdout
carries only the JSON summary.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..live.numbers import StageLive
    from ..serve.options import ServeOptions
    from ..validation.report import StartupReport


class Console:
    """Human output: stdout normally, stderr under --json (stdout is then only the JSON summary)."""

    def __init__(self, json_mode: bool):
        from .common import output_console

        self.rich = output_console(file=sys.stderr if json_mode else sys.stdout, highlight=False)

    def print(self, *args: Any, **kw: Any) -> None:
        self.rich.print(*args, **kw)
        self.rich.file.flush()


class Progress:
    """A rich progress bar over the requests the last stage finished (= left the pipeline)."""

    def __init__(self, opts: ServeOptions, console: Console):
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        self.opts = opts
        self.console = console
        self.bar = RichProgress(
            TextColumn("[bold]trace[/bold]"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
            console=console.rich, transient=False, auto_refresh=console.rich.is_terminal,
        )
        self.task = None

    def __enter__(self) -> Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.stop()

    def startup(self, report: StartupReport) -> None:
        print_startup(self.console, report)
        if report.ok and self.task is None:
            self.task = self.bar.add_task("trace", total=None, info="")

    def update(self, stages: dict[int, StageLive]) -> None:
        from ..live.numbers import StageLive

        if self.task is None or not stages:
            return
        last = stages.get(self.opts.pp_size - 1) or StageLive(stage=self.opts.pp_size - 1)
        total = max((s.total_requests for s in stages.values()), default=0) or None
        tok = last.cache_tokens
        hit = (tok.device + tok.host + tok.storage) / tok.looked_up if tok.looked_up else 0.0
        info = f"hit {hit:.0%}  host-hit {last.host_hit_ratio:.0%}"
        self.bar.update(self.task, total=total, completed=last.requests, info=info)
        if self.console.rich.is_terminal:
            self.bar.refresh()


def print_startup(console: Console, report: StartupReport) -> None:
    """One line when every stage validated; otherwise every error with stage/pool/expected/got."""
    stages = report.stages
    if report.ok:
        layers = ", ".join(f"{s.stage}:[{s.start},{s.end})" for s in stages)
        console.print(f"[green]startup ok[/green]: {len(stages)} stages validated ({layers})")
        return
    errors = report.all_errors
    console.print(f"[red]startup validation FAILED: {len(errors)} mapping error(s); not serving traffic[/red]")
    for e in errors:
        where = "cross-stage" if e.stage is None else f"stage {e.stage}"
        console.print(f"  [{where}] pool={e.pool} expected={e.expected!r} "
                      f"got={e.got!r}: {e.message}", markup=False)


def _si(n: float) -> str:
    """Compact count/byte figure for an 80-column table: 163840 -> 164k, 87954944 -> 88M."""
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.0f}{unit}" if abs(n) >= 10 * div else f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    """Per-stage table that fits 80 columns (the full numbers are in --json / snapshot.json)."""
    from rich import box
    from rich.table import Table

    if not summary["stages"] or summary["phase"] == "refused":
        return
    table = Table(title=f"{summary['model']} pp={summary['pp_size']}: {summary['phase']} "
                        f"in {summary['wall_seconds']:.1f} s, {summary['micro_batches']} micro-batches",
                  box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False)
    for col in ("stage", "layers", "req", "tokens d/h/L3/m", "host hit", "B d2h/h2d",
                "s busy/bub/idle", "bubble"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in summary["stages"]:
        tok, tb = r["cache_tokens"], r["transfer_bytes"]
        layers = r["layers"]
        table.add_row(
            str(r["stage"]), f"[{layers[0]},{layers[1]})" if None not in layers else "?",
            str(r["requests"]),
            "/".join(_si(tok.get(t, 0)) for t in ("device", "host", "storage", "miss")),
            f"{r['host_hit_ratio']:.1%}",
            f"{_si(tb.get('d2h', 0))}/{_si(tb.get('h2d', 0))}",
            f"{r['stage_seconds']:.1f}/{r['bubble_seconds']:.1f}/{r['idle_seconds']:.1f}",
            f"{r['bubble_fraction']:.0%}",
        )
    console.print(table)
    if summary["micro_batches"]:
        console.print(f"tokens: device hit / host hit / L3 hit / miss; bubble = bub / (busy + bub); ideal for "
                      f"pp={summary['pp_size']}, m={summary['micro_batches']}: "
                      f"{summary['ideal_bubble_fraction']:.0%}")
    if summary["phase"] == "done" and summary["pp_size"] > 1:
        verified = sum(r["kv_verified_pages"] for r in summary["stages"])
        from ..live.liveness import disagreeing

        odd = disagreeing((r["stage"], r.get("disagreements", {})) for r in summary["stages"])
        compared = min((r.get("compared_requests", 0) for r in summary["stages"]), default=0)
        agree = (f"[red]stages disagreed: {odd}[/red] (requests per kind, by stage)" if odd else
                 f"cache decisions identical on every stage ({compared} requests compared)")
        console.print(f"{agree}; {verified} host- and L3-loaded pages verified byte for byte")
