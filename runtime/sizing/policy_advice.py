"""Which of sglang's eviction policies, at what size, per stage: ``advise --policies``.

Why: the LRU curve (``curves.py``) prices every size at once, but an operator also picks
``--radix-eviction-policy``.  This module runs each policy (``policies.py``: sglang's radix
tree, one run per policy and size) at the sizes the LRU report marks, beside Belady's bound,
and finds, per tier and share of the infinite-cache ceiling, the pages each policy needs
(bisection to 1 %, assuming a policy's hit rate does not fall as its cache grows), the best
policy and what it saves against LRU, in each stage's bytes and sglang's flags.

Bytes come only from the plan's pools, grouped by what sizes them, so every model family's
plan prices its own pages: a paged kind costs its page bytes times its budget's pages per
full-token page (``units / full_pages``: 1 for full-budget kinds, the SWA ratio for SWA-window
kinds, whatever a family's budget gives); a per-request kind (``paged`` false: DeepSeek V4's
C128 state, a Mamba hybrid's conv + SSM state) costs its slot bytes times its slots whatever
the hit rate, and is named in ``unreduced_pools`` with the SWA-window kinds, whose size the hit
rate does not set either.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..cache.pages import PageView
from ..plan.plan import RunPlan, StagePlan
from .advice import hicache_ratio_for
from .curves import TraceCurves
from .policies import PolicySpec, Tier, prompt_pages, run_policy

#: Shares of the ceiling the policy advice sizes for.
POLICY_TARGETS = (0.9, 0.95, 0.99)
#: The LRU report's shares whose pages are evaluated (beside the configured size).
EVAL_SHARES = (0.5, 0.9, 0.95, 0.99)
#: Bisection stops when the bracket is this share of its upper end (or one page).
PRECISION = 0.01

StrategyFactory = Callable[[PolicySpec], Any]
#: Budgets counted per request slot whatever a kind's ``paged`` says (a family's per-request state
#: budget, e.g. Mamba's ``state``, next to ``request``).
PER_REQUEST_BUDGETS = frozenset({"request", "state"})


# -- bytes per page, from the plan ----------------------------------------------------------------
def stage_pricing(stage: StagePlan) -> dict[str, Any]:
    """What one more full-token page costs this stage on device and host, and what the hit rate
    does not change (see module docstring)."""
    full = max(stage.budget.full_pages, 1)
    host_full = max(stage.host_pages, 1)
    device = host = 0.0
    unreduced: list[dict[str, Any]] = []
    for p in stage.pools:
        if not p.present:
            continue
        if not p.kind.paged or p.kind.budget in PER_REQUEST_BUDGETS:
            unreduced.append({"pool": p.pool, "budget": p.kind.budget, "reason": "per request",
                              "bytes": p.device_bytes, "slots": p.units,
                              "per_request_bytes": p.present * p.page_bytes})
            continue
        device += p.present * p.page_bytes * (p.units / full)
        if p.kind.host_cached and p.host_pages:
            host += p.present * p.page_bytes * (p.host_pages / host_full)
        if p.kind.budget != "full":
            unreduced.append({"pool": p.pool, "budget": p.kind.budget,
                              "reason": f"sized by the {p.kind.budget} budget "
                                        f"({p.units:,} of {full:,} full pages), not by reuse",
                              "bytes": p.device_bytes, "slots": None, "per_request_bytes": None})
    return {"stage": stage.stage, "device_page_bytes": round(device),
            "host_page_bytes": round(host), "unreduced_pools": unreduced}


# -- runs -----------------------------------------------------------------------------------------
class Evaluator:
    """Runs of the trace through the tree model, remembered by (policy, tier, pages)."""

    def __init__(self, views: Sequence[PageView], factory: StrategyFactory) -> None:
        self.views = views
        self.factory = factory
        self.tokens_per_page = views[0].page_size if views else 1
        # a trace whose requests keep every page they hold and may match all of them (a
        # Mooncake trace at one block per page) gives both tiers the same run
        self.same_tiers = all(v.pages == v.cacheable == v.max_hit and prompt_pages(v) == v.cacheable
                              for v in views)
        self.cache: dict[tuple[str, str, int], int] = {}
        self.runs = 0
        self.seconds = 0.0

    def hits(self, spec: PolicySpec, tier: Tier, pages: int) -> int:
        pages = max(int(pages), 1)
        key = (spec.label, "device" if self.same_tiers else tier, pages)
        got = self.cache.get(key)
        if got is None:
            t0 = time.perf_counter()
            got = run_policy(self.views, self.factory(spec), pages, tier, self.tokens_per_page,
                             spec.name == "tlru").hit_tokens
            self.seconds += time.perf_counter() - t0
            self.runs += 1
            self.cache[key] = got
        return got

    def pages_for(self, spec: PolicySpec, tier: Tier, want: float, start: int, top: int) -> int | None:
        """Fewest pages (to ``PRECISION``) whose hits reach ``want`` tokens; None past ``top``."""
        start = max(start, 1)
        if self.hits(spec, tier, start) >= want:
            hi, lo = start, start // 2
            while lo >= 1 and self.hits(spec, tier, lo) >= want:
                hi, lo = lo, lo // 2
        else:
            lo, hi = start, min(2 * start, top)
            while self.hits(spec, tier, hi) < want:
                if hi >= top:
                    return None
                lo, hi = hi, min(2 * hi, top)
        while hi - lo > max(1, int(PRECISION * hi)):
            mid = (lo + hi) // 2
            if self.hits(spec, tier, mid) >= want:
                hi = mid
            else:
                lo = mid
        return hi


def _rate(hits: int, total: int) -> float:
    return hits / total if total else 0.0


def _tier_report(ev: Evaluator, specs: Sequence[PolicySpec], tier: Tier, curves: TraceCurves,
                 belady: Mapping[int, int], configured: int, device_pages: int, page_size: int,
                 top: int) -> dict[str, Any]:
    curve = curves.device if tier == "device" else curves.total
    total = curves.input_tokens
    ceiling = curve.ceiling_tokens
    marks = [("configured", configured)] + [(f"{round(100 * s)}%", curve.pages_for(s)) for s in EVAL_SHARES]
    sizes = []
    for label, pages in marks:
        rates = {s.label: _rate(ev.hits(s, tier, pages), total) for s in specs}
        best = max(specs, key=lambda s: (rates[s.label], -specs.index(s)))
        sizes.append({"mark": label, "pages": int(pages), "lru_curve_hit_rate": curve.rate(pages),
                      "belady_hit_rate": _rate(belady[pages], total) if pages in belady else None,
                      "hit_rate": rates, "best": best.label})
    targets = []
    for share in POLICY_TARGETS:
        want = share * ceiling
        start = curve.pages_for(share)
        need = {s.label: ev.pages_for(s, tier, want, start, top) for s in specs}
        known = [s for s in specs if need[s.label] is not None]
        best = min(known, key=lambda s: (need[s.label], specs.index(s))) if known else None
        lru = next((need[s.label] for s in specs if s.name == "lru"), None)
        row: dict[str, Any] = {"share": share, "pages": need, "best": best.label if best else None,
                               "best_pages": need[best.label] if best else None,
                               "lru_pages": lru,
                               "pages_saved_vs_lru": (lru - need[best.label]) if best and lru is not None else None}
        if best is not None:
            bp = need[best.label]
            row["flags"] = (f"{best.flags()} --max-total-tokens {bp * page_size}" if tier == "device"
                            else f"{best.flags()} --hicache-ratio {hicache_ratio_for(bp, device_pages):g}")
        else:
            row["flags"] = None
        targets.append(row)
    return {"tier": tier, "ceiling_hit_rate": _rate(ceiling, total), "sizes": sizes, "targets": targets}


def build_policy_report(views: Sequence[PageView], curves: TraceCurves, plan: RunPlan,
                        specs: Sequence[PolicySpec], factory: StrategyFactory, source: str,
                        belady: Mapping[int, int]) -> dict[str, Any]:
    """The ``policies`` part of ``advise --json`` (see docs/advise.md)."""
    t0 = time.perf_counter()
    ev = Evaluator(views, factory)
    stage0 = plan.stage(0)
    page = plan.page_size
    longest = max(v.pages for v in views)
    top = max(curves.distinct_pages + longest, 1)  # nothing is ever evicted: the ceiling
    tiers = [
        _tier_report(ev, specs, "device", curves, belady, stage0.device_pages, stage0.device_pages,
                     page, top),
        _tier_report(ev, specs, "host", curves, belady, stage0.host_pages, stage0.device_pages, page, top),
    ]
    pricing = [stage_pricing(s) for s in plan.stages]
    stages = []
    for s, price in zip(plan.stages, pricing, strict=True):
        rows = []
        for t in tiers:
            per_page = price["device_page_bytes"] if t["tier"] == "device" else price["host_page_bytes"]
            for row in t["targets"]:
                best, lru = row["best_pages"], row["lru_pages"]
                rows.append({"tier": t["tier"], "share": row["share"], "best": row["best"],
                             "bytes": best * per_page if best is not None else None,
                             "lru_bytes": lru * per_page if lru is not None else None,
                             "saved_bytes": (lru - best) * per_page
                             if best is not None and lru is not None else None})
        stages.append({**price, "stage": s.stage, "targets": rows})
    unreduced = sorted({u["pool"] for p in pricing for u in p["unreduced_pools"]})
    return {
        "source": source,
        "policies": [s.to_dict() for s in specs],
        "tiers": tiers,
        "stages": stages,
        "unreduced_pools": unreduced,
        "runs": ev.runs,
        "same_tiers": ev.same_tiers,
        "notes": policy_notes(ev.same_tiers),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def policy_notes(same_tiers: bool) -> list[str]:
    """What the policy figures model and what they leave out."""
    return [
        "each policy replays the trace through sglang's radix tree (full-KV part), one request in "
        "flight; an eviction removes whole leaves, as sglang's does",
        "device + host is modelled as one tier of the host's pages filled when a request finishes "
        "(write-through): exact for LRU's page set, an estimate for the other policies",
        *(["every request keeps every page it looks up: both tiers give the same runs"] if same_tiers else []),
        "sizes needed are found by bisection to 1 %, assuming a policy's hit rate does not fall as "
        "its cache grows",
        "priority: trace requests carry no priority, so its only ranks are sglang's prompt re-insert "
        "at priority + 1 (a request's answer pages go before prompts); where requests keep only "
        "prompt pages (a Mooncake trace) it is lru",
        "T-LRU runs with the given --policy-config (default sglang's help example, threshold 4096 "
        "and next_prompt_estimate 512 tokens); it is not tuned",
        "a model with a sliding-window part of the tree (DeepSeek V4's SWA) evicts that part by "
        "its own rules, not modelled here; the bytes price its pools by sglang's SWA ratio",
    ]
