"""The L3 table of the dashboard: per stage, the storage tier's backend, health and traffic.

Three tiers per stage: the prefix-cache chart stacks device, host and L3 hits (``live_figures``);
this table says whether each stage's L3 backend answers (a Mooncake master that is gone leaves
the stage serving from device and host: a warning, not a failure), how full it is, and what it
moved and refused.  ``static/occupancy.js`` refreshes the same cells from every summary poll.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stagecache.runtime.live.numbers import StageLive
from stagecache.runtime.memory.host_tier import fmt_bytes


def l3_rows(stage_ids: Sequence[int], stages: Sequence[StageLive]) -> list[dict[str, Any]]:
    by_stage = {s.stage: s.l3 for s in stages}
    out = []
    for k in stage_ids:
        t = by_stage.get(k)
        if t is None or t.backend == "none":
            out.append({"stage": k, "backend": t.backend if t else "?", "state": "off", "cls": "unknown",
                        "used": "-", "capacity": "-", "prefetched": 0, "backuped": 0, "errors": 0,
                        "fallback": 0, "reason": ""})
            continue
        out.append({
            "stage": k, "backend": t.backend, "state": "up" if t.up else "down",
            "cls": "ok" if t.up else "warn", "used": fmt_bytes(t.used_bytes),
            "capacity": fmt_bytes(t.capacity_bytes) if t.capacity_bytes else "backend's",
            "prefetched": t.prefetched_tokens, "backuped": t.backuped_tokens,
            "errors": sum(t.errors.values()), "fallback": t.fallback_pages,
            "reason": t.down_reason or ""})
    return out
