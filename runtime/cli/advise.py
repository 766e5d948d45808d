"""``stagecache advise``: how much memory each stage should get, from one pass over a trace.

The trace's hit-rate curves at every capacity (``sizing/curves.py``: LRU stack
distances), turned into each stage's bytes and sglang's flags by the run's plan
(``sizing/advice.py``), with Belady's offline optimum at the marked sizes and,
under ``--mem-budget-gb``, the capacity ledger ``stagecache pools`` prints.
``--json`` for scripts, ``--plot FILE.html`` for a standalone page; the dashboard
shows a saved ``--json`` report (``stagecache dashboard --advise FILE``).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .common import add_layout_command, add_trace_args, output_console, plan_from_args
from .pools import add_sizing_args, deployment, human, page_size_notes, print_ledger, sizing_of

if TYPE_CHECKING:
    from ..sizing.curves import Progress


def register(sub: argparse._SubParsersAction) -> None:

    p = add_layout_command(
        sub, "advise",
        help="how much host and device memory each stage needs for a hit rate, from one pass over a trace",
        description="Hit rate against cache size for every size at once (LRU stack distances over the "
        "cache's own page keys), per PP stage in bytes, with the sglang flags that buy 50/90/95/99 % "
        "of the infinite-cache hit rate, the knee of the curve and Belady's bound. Exit 2: bad input.",
    )
    add_trace_args(p, "JSONL trace, stagecache tokens or Mooncake format (docs/hicache.md)",
                   required=True)
    add_sizing_args(p)
    p.add_argument("--no-belady", action="store_true",
                   help="skip Belady's offline bound at the marked sizes (about a second per simulated size "
                        "on a 300,000-page trace)")
    p.add_argument("--policies", nargs="*", default=None, metavar="POLICY",
                   help="also evaluate sglang's radix eviction policies (lru lfu slru priority tlru; "
                        "none named: all five) at the configured size and the LRU curve's 50/90/95/99 %% "
                        "points, per tier, beside Belady; advice per stage with the flags")
    p.add_argument("--policy-config", action="append", default=[], metavar="POLICY=JSON",
                   help="a policy's --radix-eviction-policy-config, e.g. 'slru={\"protected_threshold\": 4}' "
                        "(T-LRU default: threshold 4096, next_prompt_estimate 512, sglang's help example)")
    p.add_argument("--policy-order", choices=("auto", "sglang", "stagecache"), default="auto",
                   help="whose strategy classes rank the leaves: sglang's where installed (auto), "
                        "sglang's (refused without sglang) or stagecache's versions")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of tables")
    p.add_argument("--plot", metavar="FILE.html", default=None,
                   help="also write a standalone HTML page with the curves (plotly.js inside)")
    p.set_defaults(func=run)


class ProgressBar:
    """A rich progress bar on stderr, one row per phase; nothing when stderr is not a terminal."""

    def __init__(self, console: Any | None = None) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        console = console if console is not None else output_console(stderr=True)
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                                 transient=True, disable=not console.is_terminal)
        self.tasks: dict[str, Any] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        task = self.tasks.get(phase)
        if task is None:
            task = self.tasks[phase] = self.progress.add_task(phase, total=total or None)
        self.progress.update(task, completed=done, total=total or None)

    def __enter__(self) -> ProgressBar:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


def _read(args: argparse.Namespace, bar: Progress) -> tuple[list[Any], dict[str, Any]]:
    from ..traces.readers import TraceError, load_requests

    bar("reading the trace", 0, 0)
    try:
        trace = load_requests(args.trace, fmt=args.trace_format, skip_bad=args.skip_bad_lines,
                              block_tokens=args.block_tokens)
    except TraceError as exc:
        if exc.errors and exc.errors[0].line == 0 and len(exc.errors) == 1:  # no line at all
            raise ConfigError(f"trace {args.trace} is empty: no requests to size a cache by "
                              "(expected JSONL lines of the tokens or Mooncake format)") from None
        raise
    bar("reading the trace", 1, 1)
    return list(trace.requests), {"source": str(args.trace), "format": trace.format,
                                  "lines_read": trace.lines_read, "bad_lines": trace.bad_lines,
                                  "skipped_lines": [str(e) for e in trace.errors]}


def advise(args: argparse.Namespace, bar: Progress) -> dict[str, Any]:
    """The whole report (what ``--json`` prints); ``bar(phase, done, total)`` hears each step."""
    from ..bench.hicache import page_size_for
    from ..sizing.advice import TARGETS, build_report
    from ..sizing.bounds import belady_curve
    from ..sizing.curves import page_views, trace_curves
    from ..sizing.policy_advice import EVAL_SHARES, build_policy_report

    t0 = time.perf_counter()
    requests, info = _read(args, bar)
    requested = page_size_for(args, info["format"])
    page_size, notes = sglang_page_size(args, requested, info["format"])
    plan = plan_from_args(args, sizing_of(args), page_size=page_size)
    t1 = time.perf_counter()
    views = page_views(requests, plan.page_size, bar, len(requests))
    curves = trace_curves(views, bar, lambda i: f"trace {args.trace} line {requests[i].line}")
    t2 = time.perf_counter()
    sizes = [curves.total.pages_for(s) for s in TARGETS] + [plan.stage(0).host_pages]
    specs = _policy_specs(args)
    if specs is not None:
        sizes += [curves.device.pages_for(s) for s in EVAL_SHARES] + [plan.stage(0).device_pages]
    belady = {} if args.no_belady else belady_curve(views, sizes, bar)
    t3 = time.perf_counter()
    report = build_report(curves, plan, belady, info)
    report["notes"] = notes + report["notes"]
    if specs is not None:
        factory, source = _strategy_factory(args.policy_order)
        bar("eviction policies", 0, 0)
        report["policies"] = build_policy_report(views, curves, plan, specs, factory, source, belady)
        bar("eviction policies", 1, 1)
    report["deployment"] = deployment(plan)
    report["seconds"] = {"read": round(t1 - t0, 3), "curves": round(t2 - t1, 3),
                         "belady": round(t3 - t2, 3), "total": round(time.perf_counter() - t0, 3)}
    if specs is not None:
        report["seconds"]["policies"] = report["policies"]["seconds"]
    report["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return report


def sglang_page_size(args: argparse.Namespace, requested: int, fmt: str) -> tuple[int, list[str]]:
    """The page size advice is sized by: sglang's own for the family where it overrides
    ``--page-size`` (DSA: 64, DeepSeek-V4: 256; ``Family.sglang_page_size``), as ``pools`` sizes,
    with its note.  A Mooncake trace's page is its block (its hashes name whole blocks), so there
    the block stays the page and the note says what sglang would use."""
    from ..model.families import load_spec

    family = load_spec(args.model).family
    real = family.sglang_page_size(requested)
    if fmt != "mooncake" or real == requested:
        return real, page_size_notes(family, requested, real)
    who = "DeepSeek-V4" if family.name == "deepseek_v4" else f"{family.label} models"
    return requested, [f"sglang 0.5.23 runs {who} with page_size {real}; this Mooncake trace's page is "
                       f"its block of {requested} tokens (its hashes name whole blocks), so the sizes here "
                       f"are in {requested}-token pages"]


def _policy_specs(args: argparse.Namespace) -> list[Any] | None:
    """The policies ``--policies`` asks for (None: not asked), configs validated up front."""
    from ..sizing.policies import parse_policy_config, policy_specs

    if args.policies is None:
        if args.policy_config:
            raise ConfigError("--policy-config needs --policies")
        return None
    return policy_specs(args.policies, parse_policy_config(args.policy_config))


def _strategy_factory(order: str) -> tuple[Any, str]:
    """Whose ``get_priority`` ranks the leaves, and its name for the report."""
    from ..sizing.policies import own_strategy

    if order != "stagecache":
        from ..integrations.sglang_eviction import sglang_factory, sglang_version

        factory = sglang_factory()
        if factory is not None:
            return factory, f"sglang {sglang_version() or ''}".strip()
        if order == "sglang":
            raise ConfigError("--policy-order sglang: sglang cannot be imported here; install it "
                              "(pip install '.[sglang]') or use --policy-order stagecache")
    return own_strategy, "stagecache"


def run(args: argparse.Namespace) -> int:
    with ProgressBar() as bar:
        report = advise(args, bar)
    if args.plot:
        write_plot(args.plot, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


def write_plot(path: str, report: dict[str, Any]) -> None:
    """A standalone page (plotly.js inside: it opens without a network)."""
    from stagecache.dashboard.advise_figures import advise_figure, policy_figure
    from stagecache.dashboard.advise_models import AdviseReport

    checked = AdviseReport.model_validate(report)
    fig = advise_figure(checked)
    policies = policy_figure(checked)
    try:
        if policies is None:
            fig.write_html(path, include_plotlyjs=True, full_html=True)
        else:  # both figures on one page, plotly.js once
            body = (fig.to_html(include_plotlyjs=True, full_html=False)
                    + policies.to_html(include_plotlyjs=False, full_html=False))
            with open(path, "w", encoding="utf-8") as f:
                f.write("<!doctype html><html><head><meta charset='utf-8'><title>stagecache advise"
                        f"</title></head><body>{body}</body></html>\n")
    except OSError as exc:
        raise ConfigError(f"--plot {path}: cannot write it: {exc.strerror or exc}") from None


# -- tables ---------------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _flags(t: dict[str, Any], configured: dict[str, Any]) -> str:
    ratio = t["host"]["hicache_ratio"]
    return (f"--hicache-ratio {ratio:g}" if ratio is not None
            else f"none: {configured['device_pages']:,} device pages reach it")


def print_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    console = output_console()
    tr, conf = report["trace"], report["configured"]
    belady = {b["pages"]: b["hit_rate"] for b in report["belady"]}
    table = Table(title=f"trace {tr['source']}: {tr['requests']:,} requests, {tr['lookup_pages']:,} "
                        f"pages looked up, {tr['distinct_pages']:,} distinct pages of {tr['page_size']} "
                        f"tokens; infinite-cache hit rate {_pct(report['ceiling_hit_rate'])}")
    for col in ("share of ceiling", "host pages", "hit rate", "Belady there",
                f"with HiCache ({conf['device_pages']:,} device pages)", "device pages alone",
                "no host tier"):
        table.add_column(col, justify="right")
    for t in report["targets"]:
        h, d = t["host"], t["device"]
        table.add_row(f"{100 * t['share']:g}%", f"{h['pages']:,}", _pct(h["hit_rate"]),
                      _pct(belady[h["pages"]]) if h["pages"] in belady else "-", _flags(t, conf),
                      f"{d['pages']:,}", f"--max-total-tokens {d['max_total_tokens']:,}")
    knee = report["knee"]
    table.add_row("knee", f"{knee['host']['pages']:,}", _pct(knee["host"]["hit_rate"]), "", "",
                  f"{knee['device']['pages']:,}", "", end_section=True)
    table.add_row("configured", f"{conf['host_pages']:,}", _pct(conf["hit_rate"]),
                  _pct(belady[conf["host_pages"]]) if conf["host_pages"] in belady else "-",
                  f"--hicache-ratio {conf['hicache_ratio']:g}", f"{conf['device_pages']:,}",
                  f"{_pct(conf['device_hit_rate'])} with --max-total-tokens {conf['max_total_tokens']:,}")
    console.print(table)
    _print_stages(console, report)
    if report.get("deployment"):
        print_ledger(console, report)
    if report.get("policies"):
        print_policies(console, report["policies"])
    for note in report["notes"]:
        console.print(f"note: {note}")
    if tr["repeated_requests"]:
        console.print(f"note: {tr['repeated_requests']} request(s) keep again pages past their lookable "
                      "prefix (a repeated prompt and answer): the device-tier column is an upper bound")
    s = report["seconds"]
    extra = f", policies {s['policies']} s" if "policies" in s else ""
    console.print(f"read {s['read']} s, curves {s['curves']} s, Belady {s['belady']} s{extra}; "
                  f"peak RSS {report['peak_rss_mib']} MiB")


def _print_stages(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    shares = [f"{100 * t['share']:g}%" for t in report["targets"]]
    table = Table(title="per stage: host memory with HiCache | device memory with no host tier "
                        "(KV bytes of the cached pages)")
    for col in ("stage", "layers", "bytes/page", *(f"host {s}" for s in shares), "host knee",
                "host configured", *(f"device {s}" for s in shares)):
        table.add_column(col, justify="right")
    for s in report["stages"]:
        table.add_row(str(s["stage"]), f"[{s['start_layer']}, {s['end_layer']})",
                      f"{s['token_page_bytes']:,}", *(human(t["host_bytes"]) for t in s["targets"]),
                      human(s["knee"]["host_bytes"]), human(s["configured"]["host_bytes"]),
                      *(human(t["device_bytes"]) for t in s["targets"]))
    console.print(table)


def print_policies(console: Any, pol: dict[str, Any]) -> None:
    """The ``--policies`` tables: hit rates at the marked sizes, pages and flags per share, bytes
    per stage."""
    from rich.table import Table

    labels = [p["name"] if not p["config"] else f"{p['name']}*" for p in pol["policies"]]
    for tier in pol["tiers"]:
        what = "device tier alone" if tier["tier"] == "device" else "device + host (host pages)"
        table = Table(title=f"eviction policies, {what}: hit rate at each size (order: "
                            f"{pol['source']}; ceiling {_pct(tier['ceiling_hit_rate'])})")
        for col in ("size", "pages", "Belady", *labels, "best"):
            table.add_column(col, justify="right")
        for row in tier["sizes"]:
            b = row["belady_hit_rate"]
            table.add_row(row["mark"], f"{row['pages']:,}", _pct(b) if b is not None else "-",
                          *(_pct(row["hit_rate"][p["label"]]) for p in pol["policies"]),
                          row["best"].split(" ")[0])
        console.print(table)
        table = Table(title=f"eviction policies, {what}: pages each needs for a share of the ceiling")
        for col in ("share", *labels, "best", "saved vs lru", "flags"):
            table.add_column(col, justify="right")
        for row in tier["targets"]:
            table.add_row(f"{100 * row['share']:g}%",
                          *(f"{row['pages'][p['label']]:,}" if row["pages"][p["label"]] is not None
                            else "beyond" for p in pol["policies"]),
                          (row["best"] or "-").split(" ")[0],
                          f"{row['pages_saved_vs_lru']:,}" if row["pages_saved_vs_lru"] is not None else "-",
                          row["flags"] or "-")
        console.print(table)
    table = Table(title="eviction policies per stage: bytes of the best policy's pages, and what it "
                        "saves against lru")
    for col in ("stage", "device B/page", "host B/page",
                *(f"{t['tier']} {100 * t['share']:g}%" for t in pol["stages"][0]["targets"])):
        table.add_column(col, justify="right")
    for st in pol["stages"]:
        table.add_row(str(st["stage"]), f"{st['device_page_bytes']:,}", f"{st['host_page_bytes']:,}",
                      *(f"{(t['best'] or '-').split(' ')[0]} {human(t['bytes']) if t['bytes'] is not None else '-'}"
                        f" (-{human(t['saved_bytes']) if t['saved_bytes'] is not None else '-'})"
                        for t in st["targets"]))
    console.print(table)
    configured = [p for p in pol["policies"] if p["config"]]
    for p in configured:
        console.print(f"note: {p['name']}* is {p['flags']}")
    if pol["unreduced_pools"]:
        console.print("note: pools the hit rate does not size (per request, or a window budget): "
                      + ", ".join(pol["unreduced_pools"]))
    for note in pol["notes"]:
        console.print(f"note: {note}")

