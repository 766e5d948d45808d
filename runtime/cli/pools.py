"""``stagecache pools``: per stage and pool kind, what sglang 0.5.23 allocates on device and host.

The numbers are the run's plan sized the sglang way (``plan.Sizing.sglang``: the
pool-kind table + sglang's sizing rules, faults applied); the real-sglang tests check
them field by field against sglang's own ``DeepSeekV4TokenToKVPool`` and HiCache
assembler.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .. import defaults
from ..model.families import load_spec
from ..model.family import Family, is_unbounded
from ..model.layer_map import partition_without_problems
from ..plan.plan import RunPlan, Sizing
from .common import (
    add_layout_command,
    float_range,
    int_range,
    output_console,
    plan_from_args,
    positive_float,
    positive_int,
)

GIB = 1 << 30


def register(sub: argparse._SubParsersAction) -> None:
    p = add_layout_command(
        sub, "pools",
        help="what sglang allocates for every stage's device pools and host (HiCache) mirror",
        description="Per PP stage and pool kind: buffers, bytes per page, device and host pages and bytes.",
    )
    add_sizing_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def add_sizing_args(p: argparse.ArgumentParser) -> None:
    """sglang's sizing flags (``sizing_of`` reads them): this command's and ``advise``'s."""
    size = p.add_mutually_exclusive_group()
    size.add_argument("--max-total-tokens", type=positive_int, default=None,
                      help=f"full-attention tokens per stage (default {defaults.MAX_TOTAL_TOKENS})")
    size.add_argument("--mem-budget-gb", type=float_range(0.0, 1 << 20, low_open=True), default=None,
                      nargs="+", metavar="GB",
                      help="KV memory per stage, GiB: one value for every stage or one per stage; full "
                           "tokens as sglang's configurator fits them (the smallest stage's, as PP "
                           "ranks agree on one), and the bytes that leaves stranded on each stage")
    p.add_argument("--swa-full-tokens-ratio", type=float_range(0.0, 1.0, low_open=True), default=None,
                   help="SWA tokens / full tokens (default: sglang's for the model's family: 0.1 for "
                        "DeepSeek-V4, 0.8 for SWA hybrids)")
    p.add_argument("--max-running-requests", type=int_range(1, 1 << 20), default=defaults.MAX_RUNNING_REQUESTS,
                   help="request slots of the per-request pools (default %(default)s, sglang's for DeepSeek-V4)")
    mamba = p.add_mutually_exclusive_group()
    mamba.add_argument("--max-mamba-cache-size", type=int_range(1, 1 << 24), default=None,
                       help="Mamba state slots per stage, as sglang's flag (linear-attention / Mamba "
                            f"hybrids; default: from the memory budget, else {defaults.MAMBA_SLOTS_PER_REQUEST} "
                            "per running request)")
    mamba.add_argument("--mamba-full-memory-ratio", type=float_range(0.0, 1 << 10, low_open=True), default=None,
                       help="Mamba state bytes / attention KV bytes of a memory budget, as sglang's flag "
                            f"(default {defaults.MAMBA_FULL_MEMORY_RATIO})")
    host = p.add_mutually_exclusive_group()
    host.add_argument("--hicache-ratio", type=positive_float, default=defaults.HICACHE_RATIO,
                      help="host pages = device pages x ratio, per budget (default %(default)s, as sglang)")
    host.add_argument("--hicache-size-gb", type=float_range(0.0, 1 << 20, low_open=True), default=None,
                      help="refused for DeepSeek-V4, as sglang refuses --hicache-size")


def _gib(value: float | None) -> int | None:
    return int(value * GIB) if value is not None else None


def sizing_of(args: argparse.Namespace, hicache_ratio: float | None = None) -> Sizing:
    """The sglang sizing the flags of ``add_sizing_args`` ask for."""
    budgets = None if args.mem_budget_gb is None else [_gib(v) for v in args.mem_budget_gb]
    return Sizing.sglang(
        max_total_tokens=args.max_total_tokens,
        mem_budget_bytes=budgets,
        swa_ratio=args.swa_full_tokens_ratio,
        max_running_requests=args.max_running_requests,
        hicache_ratio=args.hicache_ratio if hicache_ratio is None else hicache_ratio,
        hicache_size_bytes=_gib(args.hicache_size_gb),
        max_mamba_cache_size=getattr(args, "max_mamba_cache_size", None),
        mamba_full_memory_ratio=getattr(args, "mamba_full_memory_ratio", None),
    )


def plan_of(args: argparse.Namespace) -> RunPlan:
    """The plan sized the sglang way.  sglang runs some families with a page size of its own
    whatever --page-size says (DeepSeek-V4: 256, DSA: 64: ``Family.sglang_page_size``); the plan
    takes that page size and the report says when it overrode the flag."""
    family = load_spec(args.model).family
    return plan_from_args(args, sizing_of(args), page_size=family.sglang_page_size(args.page_size))


def page_size_notes(family: Family, requested: int, page_size: int) -> list[str]:
    """The one-line note when sglang's own page size for the family (``Family.sglang_page_size``)
    overrides ``--page-size`` (``pools`` and ``advise`` print it alike)."""
    if requested == page_size:
        return []
    who = "DeepSeek-V4" if family.name == "deepseek_v4" else f"{family.label} models"
    return [f"sglang 0.5.23 runs {who} with page_size {page_size} (it overrides --page-size {requested})"]


def stage_problems(plan: RunPlan) -> dict[str, Any]:
    """What sglang itself does wrong with a stage of this partition (``Family.stage_problems``) and,
    where it does, a partition near sglang's even split that avoids it."""
    family = plan.spec.family
    problems = [{"stage": s.stage, "problem": p} for s in plan.stages
                for p in family.stage_problems(s.layer_map, plan.page_size)]
    suggested = None
    if problems:
        part = partition_without_problems(plan.spec, plan.pp_size, page_size=plan.page_size)
        suggested = list(part) if part is not None else None
    return {"stage_problems": problems, "suggested_partition": suggested}


def state_notes(plan: RunPlan) -> list[str]:
    """Per-request state (Mamba): how many slots, from what, and what is not modelled."""
    family = plan.spec.family
    notes: list[str] = []
    state = [p for p in plan.stage(0).pools if p.kind.budget == "state"]
    if state:
        sz = plan.sizing
        source = ("--max-mamba-cache-size" if sz.max_mamba_cache_size is not None else
                  "the memory budget (--mamba-full-memory-ratio)" if sz.mem_budget_bytes is not None else
                  f"stagecache's default of {defaults.MAMBA_SLOTS_PER_REQUEST} per running request (sglang "
                  "sizes them from free GPU memory: give --mem-budget-gb or --max-mamba-cache-size)")
        notes.append(f"Mamba state is per request, not per token: {state[0].units:,} slots per stage (+1 "
                     f"padding slot), from {source}")
        if plan.tp_size > 1:
            notes.append(f"--tp-size {plan.tp_size} is not modelled for {family.label} models: the sizes "
                         "are those of one rank at TP 1")
    return notes


def accounting(args: argparse.Namespace) -> dict[str, Any]:
    """The whole report as a dict (also the --json output): the plan, plus each stage's host tier
    verdict and the notes."""
    from ..memory.host_tier import host_tier_check

    plan = plan_of(args)
    report = plan.to_dict()
    report["requested_page_size"] = args.page_size
    report["notes"] = page_size_notes(plan.spec.family, args.page_size, plan.page_size)
    problems = stage_problems(plan)
    if problems["stage_problems"]:
        report.update(problems)
    report["notes"] += state_notes(plan)
    for stage, row in zip(plan.stages, report["stages"], strict=True):
        cached = [p for p in stage.pools if p.host_pages and p.present]
        tier = host_tier_check(f"stage {stage.stage} host tier", {p.pool: p.units for p in cached},
                               {p.pool: p.host_pages for p in cached}, 0, None)
        row["host_tier"] = {"status": list(tier.statuses), "reasons": list(tier.reasons)}
    report["deployment"] = deployment(plan)
    return report


def deployment(plan: RunPlan) -> dict[str, Any] | None:
    """The capacity ledger under memory budgets: each stage alone, the minimum, what it strands."""
    caps = [s.capacity for s in plan.stages]
    if any(c is None for c in caps):
        return None
    out = {"tokens": min(s.budget.full_tokens for s in plan.stages),  # a faulted stage may size itself alone
           "limited_by": min(range(plan.pp_size), key=lambda i: caps[i].tokens_alone),
           "stranded_bytes": sum(c.stranded_bytes for c in caps)}
    if all(c.state_stranded_bytes is not None for c in caps):
        out["state_stranded_bytes"] = sum(c.state_stranded_bytes or 0 for c in caps)
    return out


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
        plan = plan_of(args)

        def host_bytes(_pages: int, r: float) -> int:
            return plan.resized(sizing_of(args, hicache_ratio=r)).host_bytes

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
    budgets = sz.get("mem_budget_bytes")
    budget = f", budget {'/'.join(human(b) for b in budgets)} per stage" if budgets else ""
    budgets = {k["budget"] for k in report["kinds"]}  # a family's budgets: no SWA text without SWA pools
    swa = f", swa {s0['swa_tokens']:,} (ratio {sz['swa_full_tokens_ratio']})" if "swa" in budgets else ""
    slots = f", {s0['request_slots']} request slots" if "request" in budgets else ""
    if "state" in budgets:  # per-request state (Mamba): its slots, per stage
        slots += f", Mamba state {s0.get('state_slots', 0):,} request slots per stage"
    return (f"{report['model']}: {report['num_layers']} layers, pp={report['pp_size']}, "
            f"page={report['page_size']}{budget}: full {s0['full_tokens']:,} tokens{swa}{slots}, "
            f"hicache_ratio={sz['hicache_ratio']}"
            + (f", faults={','.join(report['faults'])}" if report["faults"] else ""))


def print_accounting(report: dict[str, Any]) -> None:
    from rich.table import Table

    labels = {k["pool"]: k["label"] for k in report["kinds"]}
    console = output_console()
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
            unit = " /slot" if r["budget"] in ("request", "state") else ""
            table.add_row(
                str(s["stage"]) if first else "", f"[{s['start_layer']}, {s['end_layer']})" if first else "",
                labels[r["pool"]], str(r["buffers"]), r["budget"], f"{r['page_bytes']:,}{unit}",
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
    if report.get("deployment"):
        print_ledger(console, report)
    for note in report["notes"]:
        console.print(f"note: {note}")
    for p in report.get("stage_problems", ()):
        console.print(f"[red]stage {p['stage']}[/red]: {p['problem']}")
    if report.get("stage_problems"):
        part = report["suggested_partition"]
        console.print("suggested partition: " + (f"--pp-partition {','.join(map(str, part))}" if part
                                                 else "none found near the even split"))
    for s in report["stages"]:
        for status, reason in zip(s["host_tier"]["status"], s["host_tier"]["reasons"], strict=True):
            if status != "ok":
                console.print(f"warning: {reason}")
    host = report.get("this_host")
    if host is not None and not host["fits"]:
        console.print(f"this host: the host tiers of all stages ({human(host['host_bytes'])}) would not "
                      f"fit its {human(host['mem_available_bytes'] - host['reserve_bytes'])} of available "
                      f"RAM above the reserve; {host['advice']}")


def print_ledger(console: Any, report: dict[str, Any]) -> None:
    """Per stage under its memory budget: the tokens it could hold alone, the deployment's (the
    minimum over stages, as sglang takes it) and the HBM that minimum leaves stranded."""
    from rich.table import Table

    dep = report["deployment"]
    state = "state_stranded_bytes" in dep
    table = Table(title=f"capacity: the deployment holds {dep['tokens']:,} tokens (stage "
                        f"{dep['limited_by']} limits it); {human(dep['stranded_bytes'])} stranded in all"
                        + (f", {human(dep['state_stranded_bytes'])} of it Mamba state charged and never "
                           "allocated" if state else ""))
    cols = ["stage", "budget", "tokens alone", "deployment tokens", "used", "stranded"]
    if state:
        cols += ["state charged", "state allocated", "state stranded"]
    for col in cols:
        table.add_column(col, justify="right")
    for s in report["stages"]:
        c = s["capacity"]
        alone, tokens = ("unbounded" if is_unbounded(c[k]) else f"{c[k]:,}" for k in ("tokens_alone", "tokens"))
        row = [str(s["stage"]), human(c["budget_bytes"]), alone, tokens,
               human(c["used_bytes"]), human(c["stranded_bytes"])]
        if state:
            row += [human(c["state_charged_bytes"]), human(c["state_bytes"]), human(c["state_stranded_bytes"])]
        table.add_row(*row)
    console.print(table)
