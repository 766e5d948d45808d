"""What each stage's memory buys: a trace's hit-rate curves turned into bytes and sglang flags.

Why per stage: under PP every stage caches the same tokens, so a hit rate needs
the same *pages* on every stage, but a page costs each stage its own bytes
(its mix of SWA, C4 and C128 layers: ``StagePlan.token_page_bytes``).  The
curves (``curves.py``) say how many pages reach a share of the infinite-cache
hit rate; the plan says what those pages cost where.

Two questions, two curves (``docs/advise.md`` has the exact correspondence to the
replay): with HiCache the host tier decides the hit rate (device + host hits at
``H`` host pages, for a host at least as large as the device), so the flag is
``--hicache-ratio``; without it the device tier alone decides, so the flag is
``--max-total-tokens``.  Bytes here are the KV bytes of the cached pages, every
paged pool kind (one page-id space, as the runtime holds them); what sglang
allocates for the suggested flags is ``stagecache pools``'s answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..plan.plan import RunPlan
from .curves import HitCurve, TraceCurves, sample_capacities

#: Shares of the infinite-cache hit rate every report sizes for.
TARGETS = (0.5, 0.9, 0.95, 0.99)
#: Capacities a report's curve is sampled at (plus the marked ones), for plots and JSON.
CURVE_POINTS = 400


def hicache_ratio_for(host_pages: int, device_pages: int) -> float:
    """The smallest ``--hicache-ratio`` (two decimals) whose host pages, as sglang floors
    ``device_pages x ratio``, hold ``host_pages`` and at least the device's pages."""
    want = max(host_pages, device_pages)
    hundredths = -(-want * 100 // device_pages)  # exact: a float quotient can land above an integer
    while int(device_pages * (hundredths / 100)) < want:  # sglang's float floor: one more hundredth
        hundredths += 1
    return hundredths / 100


def _point(curve: HitCurve, pages: int) -> dict[str, Any]:
    ceiling = curve.ceiling_tokens
    return {"pages": int(pages), "hit_rate": curve.rate(pages),
            "share_of_ceiling": curve.at(pages) / ceiling if ceiling else 0.0}


def _targets(curves: TraceCurves, device_pages: int, targets: Sequence[float]) -> list[dict[str, Any]]:
    out = []
    page = curves.page_size
    for share in targets:
        host = curves.total.pages_for(share)
        device = curves.device.pages_for(share)
        alone = curves.device.at(device_pages) >= share * curves.device.ceiling_tokens
        out.append({
            "share": share,
            "host": {**_point(curves.total, host),
                     "hicache_ratio": None if alone else hicache_ratio_for(host, device_pages)},
            "device": {**_point(curves.device, device), "max_total_tokens": device * page},
        })
    return out


def _configured(curves: TraceCurves, plan: RunPlan) -> dict[str, Any]:
    """Where the plan's sizes sit on the curves: device pages, host pages and their hit rates
    (a host no larger than the device adds nothing: it holds what the device holds)."""
    stage = plan.stage(0)
    dev, host = stage.device_pages, stage.host_pages
    total = curves.total.rate(host) if host >= dev else curves.device.rate(dev)
    return {"device_pages": dev, "host_pages": host, "max_total_tokens": stage.budget.full_tokens,
            "hicache_ratio": plan.sizing.hicache_ratio, "device_hit_rate": curves.device.rate(dev),
            "hit_rate": total}


def _stage_rows(plan: RunPlan, targets: list[dict[str, Any]], knee: dict[str, Any],
                configured: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for s in plan.stages:
        per_page = s.token_page_bytes
        m = s.layer_map
        rows.append({
            "stage": s.stage, "start_layer": m.start, "end_layer": m.end, "token_page_bytes": per_page,
            "targets": [{"share": t["share"], "host_bytes": t["host"]["pages"] * per_page,
                         "device_bytes": t["device"]["pages"] * per_page} for t in targets],
            "knee": {"host_bytes": knee["host"]["pages"] * per_page,
                     "device_bytes": knee["device"]["pages"] * per_page},
            "configured": {"device_bytes": configured["device_pages"] * per_page,
                           "host_bytes": configured["host_pages"] * per_page},
            "capacity": s.capacity.to_dict() if s.capacity is not None else None,
        })
    return rows


def _curve_json(curves: TraceCurves, marked: Sequence[int]) -> dict[str, list[Any]]:
    top = max(curves.total.full_pages, curves.device.full_pages)
    pages = sample_capacities(top, CURVE_POINTS, marked).tolist()
    return {"pages": pages, "hit_rate": [curves.total.rate(p) for p in pages],
            "device_hit_rate": [curves.device.rate(p) for p in pages]}


def sglang_notes(plan: RunPlan) -> list[str]:
    """What the suggested flags mean in sglang 0.5.23 for this model."""
    family = plan.spec.family
    refused = family.host_size_refusal() if family.host_size_reason else None
    state = [p for p in plan.stage(0).pools if p.kind.budget == "state"]
    return [
        *([f"host tier: {refused}"] if refused else []),
        *([f"{state[0].kind.label} is per request, not per token: {state[0].units:,} slots per stage "
           "(+1 padding slot) whatever the hit rate; the bytes per page here are the attention KV "
           "only, the state is in `stagecache pools`"] if state else []),
        "sglang warns when the host tier is not larger than the device tier: it then holds what "
        "the device holds and adds no hit",
        f"--max-total-tokens is the device tier's token budget per stage (pages of {plan.page_size} "
        "tokens); `stagecache pools --max-total-tokens N --hicache-ratio R` shows what sglang "
        "allocates for it on every stage",
    ]


def build_report(curves: TraceCurves, plan: RunPlan, belady: Mapping[int, int],
                 trace: dict[str, Any], targets: Sequence[float] = TARGETS) -> dict[str, Any]:
    """The whole advice as one JSON-able dict (``advise --json``, ``/api/advise``)."""
    configured = _configured(curves, plan)
    rows = _targets(curves, configured["device_pages"], targets)
    knee = {"host": _point(curves.total, curves.total.knee()),
            "device": _point(curves.device, curves.device.knee())}
    marked = [t[tier]["pages"] for t in rows for tier in ("host", "device")] + [
        knee["host"]["pages"], knee["device"]["pages"], configured["host_pages"],
        configured["device_pages"]]
    ceiling = curves.total.ceiling_tokens
    return {
        "trace": {**trace, "requests": curves.requests, "input_tokens": curves.input_tokens,
                  "lookup_pages": curves.lookup_pages, "distinct_pages": curves.distinct_pages,
                  "page_size": curves.page_size, "repeated_requests": curves.repeated_requests},
        "plan": {"model": plan.spec.name, "pp_size": plan.pp_size, "tp_size": plan.tp_size,
                 "page_size": plan.page_size,
                 "partition": list(plan.partition) if plan.partition is not None else None,
                 "sizing": plan.sizing.to_dict()},
        "ceiling_hit_rate": ceiling / curves.input_tokens if curves.input_tokens else 0.0,
        "full_pages": {"host": curves.total.full_pages, "device": curves.device.full_pages},
        "targets": rows,
        "knee": knee,
        "configured": configured,
        "belady": [{"pages": c, "hit_rate": hits / curves.input_tokens if curves.input_tokens else 0.0,
                    "lru_hit_rate": curves.total.rate(c)} for c, hits in sorted(belady.items())],
        "curve": _curve_json(curves, marked),
        "stages": _stage_rows(plan, rows, knee, configured),
        "deployment": None,
        "notes": sglang_notes(plan),
    }
