"""The JSON result and the rich table of ``stagecache bench hicache``.

``token_hit_rate`` is the headline: ``device``, ``host`` and ``total`` of the
HiCache run, ``ceiling`` (infinite cache) and ``belady`` (offline bound at the
host tier's capacity), each a fraction of the trace's prompt tokens.  Bytes
moved are pages moved x each stage's bytes per page, summed over the stages;
``implied_seconds`` divides them by the bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def _frac(n: int, d: int) -> float:
    return round(n / d, 4) if d else 0.0


def _summary(rows: list[dict[str, Any]], ceiling_hits: int, metadata: bool) -> dict[str, Any]:
    # every stage sees the same requests and decides the same: report stage 0's tokens, and
    # check the others agree (payload mode replays each stage on its own pools)
    r0 = rows[0]
    agree = all((r["device_hit_tokens"], r["host_hit_tokens"]) ==
                (r0["device_hit_tokens"], r0["host_hit_tokens"]) for r in rows)
    hit = r0["device_hit_tokens"] + r0["host_hit_tokens"]
    moved = {d: sum(r["moved_bytes"][d] for r in rows) for d in ("d2h", "h2d")}
    measured = {d: round(sum(r["transfer_seconds"][d] for r in rows), 4) for d in ("d2h", "h2d")}
    return {
        "hit_tokens": hit, "device_hit_tokens": r0["device_hit_tokens"],
        "host_hit_tokens": r0["host_hit_tokens"], "miss_tokens": r0["miss_tokens"],
        "hit_ratio": round(r0["hit_ratio"], 4), "device_hit_ratio": round(r0["device_hit_ratio"], 4),
        "host_hit_ratio": round(r0["host_hit_ratio"], 4),
        "share_of_ceiling": _frac(hit, ceiling_hits),
        "host_share_of_ceiling": _frac(r0["host_hit_tokens"], ceiling_hits),
        "stages_agree": agree, "decisions": "one replay, priced per stage" if metadata else "per stage",
        "evicted_pages": {"device": sum(r["device_evicted_pages"] for r in rows),
                          "host": sum(r["host_evicted_pages"] for r in rows),
                          "dropped": sum(r["dropped_pages"] for r in rows)},
        "moved_pages": dict(r0["moved_pages"]),  # per stage (every stage moves the same pages)
        "transfer_bytes": moved,  # all stages
        "transfer_seconds": measured,  # measured copies (payload mode); 0 in metadata mode
        "mismatches": sum(r["replay"]["mismatch_count"] for r in rows),
        "pages_verified": sum(r["replay"]["pages_verified"] for r in rows),
        "bytes_verified": sum(r["replay"]["bytes_verified"] for r in rows),
        "replay_seconds": round(sum(r["replay"]["seconds"] for r in rows)
                                / (len(rows) if metadata else 1), 3),
    }


def build_report(args: argparse.Namespace, plan: Any, stages: list[Any], modes: dict[str, Any],
                 trace: dict[str, Any], ceiling: Any, belady_hits: int, host_pages: int,
                 bandwidth: dict[str, float], timing: dict[str, Any]) -> dict[str, Any]:
    hi = _summary(modes["hicache"], ceiling.hit_tokens, args.metadata_only)
    dev = _summary(modes["device_only"], ceiling.hit_tokens, args.metadata_only)
    looked = ceiling.input_tokens
    moved = hi["transfer_bytes"]
    implied = {d: round(moved[d] / (bandwidth[d] * 1e9), 4) if bandwidth[d] else None
               for d in ("d2h", "h2d")}
    return {
        "bench": "hicache",
        "model": plan.spec.name, "pp_size": plan.pp_size, "stages": [s.stage for s in stages],
        "page_size": plan.page_size, "trace_format": trace["format"],
        "metadata_only": bool(args.metadata_only), "device": str(args.device),
        "device_pages": args.device_pages, "hicache_ratio": args.hicache_ratio,
        "host_pages": host_pages, "write_policy": args.write_policy,
        "eviction_policy": args.eviction_policy, "host_layout": args.hicache_layout,
        "concurrency": args.concurrency, "verify": args.verify,
        "trace": trace,
        "token_hit_rate": {"device": _frac(hi["device_hit_tokens"], looked),
                           "host": _frac(hi["host_hit_tokens"], looked),
                           "total": _frac(hi["hit_tokens"], looked),
                           "ceiling": _frac(ceiling.hit_tokens, looked),
                           "belady": _frac(belady_hits, looked)},
        "ceiling": {"hit_tokens": ceiling.hit_tokens, "hit_ratio": _frac(ceiling.hit_tokens, looked),
                    "looked_up_tokens": looked},
        "belady": {"capacity_pages": host_pages, "hit_tokens": belady_hits,
                   "hit_ratio": _frac(belady_hits, looked)},
        "transfer": {"pages_per_stage": hi["moved_pages"], "bytes": moved,
                     "bandwidth_gbps": {d: round(v, 3) for d, v in bandwidth.items()},
                     "bandwidth_source": "same-run copies through the transfer controller",
                     "implied_seconds": implied, "measured_seconds": hi["transfer_seconds"]},
        "summary": {
            "hicache": hi, "device_only": dev,
            "ratio_hit_tokens_hicache_vs_device_only":
                round(hi["hit_tokens"] / dev["hit_tokens"], 3) if dev["hit_tokens"] else None,
        },
        "per_stage": modes,
        **timing,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def _m(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s, c, b, tr = res["summary"], res["ceiling"], res["belady"], res["transfer"]
    mode = "metadata only" if res["metadata_only"] else "payload"
    t = Table(title=(f"HiCache replay ({mode}): {res['trace']['requests']} {res['trace_format']} "
                     f"requests, {res['model']} pp={res['pp_size']}, page {res['page_size']}, "
                     f"{res['device_pages']} device + {res['host_pages']} host pages/stage, "
                     f"{res['write_policy']}, {res['eviction_policy']}; tokens of one stage"))
    for col in ("", "device hit", "host hit", "miss", "hit %", "of ceiling", "d2h GB", "h2d GB",
                "bad pages"):
        t.add_column(col, justify="right" if col else "left")
    for name in ("device_only", "hicache"):
        r = s[name]
        t.add_row(name.replace("_", " "), _m(r["device_hit_tokens"]), _m(r["host_hit_tokens"]),
                  _m(r["miss_tokens"]), f"{r['hit_ratio']:.1%}", f"{r['share_of_ceiling']:.1%}",
                  _gb(r["transfer_bytes"]["d2h"]), _gb(r["transfer_bytes"]["h2d"]),
                  str(r["mismatches"]) if res["verify"] else "-")
    looked = c["looked_up_tokens"]
    t.add_row("belady", "-", _m(b["hit_tokens"]), _m(looked - b["hit_tokens"]),
              f"{b['hit_ratio']:.1%}",
              f"{b['hit_tokens'] / c['hit_tokens']:.1%}" if c["hit_tokens"] else "-", "-", "-", "-")
    t.add_row("ceiling", "-", _m(c["hit_tokens"]), _m(looked - c["hit_tokens"]),
              f"{c['hit_ratio']:.1%}", "100%", "-", "-", "-")
    con = Console(width=None if sys.stdout.isatty() else 120)  # piped: do not wrap at 80
    con.print(t)
    bw, implied = tr["bandwidth_gbps"], tr["implied_seconds"]
    hi = s["hicache"]
    con.print(
        f"belady = offline bound at the host tier's {b['capacity_pages']} pages; ceiling = infinite "
        f"cache.  Transfers: {tr['pages_per_stage']['d2h']:,} pages d2h, "
        f"{tr['pages_per_stage']['h2d']:,} pages h2d per stage; at the measured {bw['d2h']:.2f} / "
        f"{bw['h2d']:.2f} GB/s (d2h / h2d) that is {_s(implied['d2h'])} / {_s(implied['h2d'])}, all stages")
    con.print(
        f"hit tokens x{s['ratio_hit_tokens_hicache_vs_device_only']} vs device only; host tier = "
        f"{hi['host_share_of_ceiling']:.1%} of what the ceiling reuses; stages agree: "
        f"{hi['stages_agree'] and s['device_only']['stages_agree']} ({hi['decisions']}); "
        + (f"{hi['pages_verified'] + s['device_only']['pages_verified']} reused pages verified; "
           if res["verify"] else "not verified (--verify); ")
        + f"{res['seconds']} s, peak RSS {res['peak_rss_mib']} MiB")
    ov = res.get("insight_overhead")
    if ov and ov["overhead_percent"] is not None:
        pair = ov["paired"]
        con.print(f"cache insight (miss reasons, lifetimes): {ov['insight_seconds'] * 1000:.1f} ms of a "
                  f"{ov['replay_seconds']:.2f} s replay = {ov['overhead_percent']:.2f} % (budget "
                  f"{ov['budget_percent']:g} %; {ov['timed_seconds'] * 1000:.1f} ms as timed, less "
                  f"{ov['timer_floor_us']:.2f} us of timer per call)"
                  + (f"; paired metadata replays: {pair['overhead_percent']:.2f} % (median of "
                     f"{pair['repeats']}, pairs spread +/- {pair['spread_percent']:.2f} %"
                     + ("" if pair["conclusive"] else ": inconclusive, noise above the budget")
                     + ")" if pair and pair["overhead_percent"] is not None else ""))
