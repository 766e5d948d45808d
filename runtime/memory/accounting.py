"""What sglang 0.5.23 allocates on every PP stage of a layout: the report behind ``stagecache pools``.

Pure: a layout, the sizing flags and optional faults in, a JSON-ready dict out.
Per stage it prices every pool kind with the pool-kind table (bytes) and
``sizing`` (pages per budget), the way sglang's ``DSV4PoolConfigurator`` and
``DeepSeekV4TokenToKVPool`` do; tests/test_sglang_live.py compares it field by
field with sglang's own objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..model.layer_map import ModelLayout, StageLayerMap
from ..model.pool_kinds import kind_table
from ..validation.faults import Fault, buffer_plan
from .host_tier import host_tier_check
from .sizing import (
    DSV4_MAX_RUNNING_REQUESTS,
    DSV4_PAGE_SIZE,
    DSV4_SWA_FULL_TOKENS_RATIO,
    HICACHE_SIZE_REFUSED,
    TokenBudget,
    host_pages_for,
    sglang_budget,
    sglang_full_tokens_for_bytes,
    stage_accounts,
    token_page_bytes,
)

DEFAULT_MAX_TOTAL_TOKENS = 262_144


@dataclass(frozen=True)
class SizingOptions:
    """sglang's sizing flags as ``stagecache pools`` takes them."""

    max_total_tokens: int | None = None  # --max-total-tokens (default 262,144 without a budget)
    mem_budget_bytes: int | None = None  # the KV budget per stage sglang's profiler arrives at
    swa_ratio: float | None = None  # --swa-full-tokens-ratio (None: sglang's 0.1 for DeepSeek-V4)
    max_running_requests: int = DSV4_MAX_RUNNING_REQUESTS
    hicache_ratio: float | None = None  # None: sglang's 2.0
    hicache_size_bytes: int | None = None  # refused for DeepSeek-V4, as sglang does

    def to_dict(self) -> dict[str, Any]:
        sizing = ({"mem_budget_bytes": self.mem_budget_bytes} if self.mem_budget_bytes is not None
                  else {"max_total_tokens": self.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS})
        return {**sizing,
                "swa_full_tokens_ratio": (DSV4_SWA_FULL_TOKENS_RATIO if self.swa_ratio is None
                                          else self.swa_ratio),
                "max_running_requests": self.max_running_requests,
                "hicache_ratio": 2.0 if self.hicache_ratio is None else self.hicache_ratio}


def _stage_counts(layout: ModelLayout, m: StageLayerMap, faults: Sequence[Fault]) -> dict[str, int]:
    """Buffers per pool: the layer map's, or a fault's plan when faults are given."""
    if not faults:
        return m.expected_buffers()
    plan = buffer_plan(m, layout.spec.compress_ratios, faults, layout.pp_size)
    return {p: len(slots) for p, slots in plan.items()}


def full_tokens(layout: ModelLayout, page_size: int, options: SizingOptions) -> int:
    """Full tokens every stage gets: ``--max-total-tokens``, or what the smallest stage budget fits.

    Under PP sglang all-reduces the token capacity with MIN, so every stage has the same.
    """
    if options.mem_budget_bytes is None:
        return options.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS
    table = kind_table(layout.spec, page_size)
    return min(sglang_full_tokens_for_bytes(table, m, options.mem_budget_bytes, options.swa_ratio,
                                            options.max_running_requests) for m in layout.stages)


def stage_budget(layout: ModelLayout, page_size: int, options: SizingOptions) -> TokenBudget:
    """The token budgets sglang sizes every stage with (full, SWA, request slots)."""
    return sglang_budget(page_size, full_tokens(layout, page_size, options), layout.spec.sliding_window,
                         options.swa_ratio, options.max_running_requests)


def account(layout: ModelLayout, requested_page_size: int, options: SizingOptions,
            faults: Sequence[Fault] = ()) -> dict[str, Any]:
    """The whole ``stagecache pools`` report for ``layout``."""
    if options.hicache_size_bytes is not None:
        raise ConfigError(HICACHE_SIZE_REFUSED)
    page = DSV4_PAGE_SIZE
    table = kind_table(layout.spec, page)
    budget = stage_budget(layout, page, options)
    host_full = host_pages_for(budget.full_pages, options.hicache_ratio)
    host_swa = host_pages_for(budget.swa_pages, options.hicache_ratio)
    stages = []
    for m in layout.stages:
        counts = _stage_counts(layout, m, faults)
        rows = stage_accounts(table, m, budget, options.hicache_ratio, counts)
        tier = host_tier_check(f"stage {m.stage} host tier",
                               {r.pool: r.device_pages for r in rows if r.host_cached and r.buffers},
                               {r.pool: r.host_pages for r in rows if r.host_cached and r.buffers},
                               0, None)
        stages.append({
            "stage": m.stage, "start_layer": m.start, "end_layer": m.end, "local_layers": m.local_layers,
            "host_tier": {"status": list(tier.statuses), "reasons": list(tier.reasons)},
            **budget.to_dict(), "device_pages": budget.full_pages, "swa_device_pages": budget.swa_pages,
            "host_pages": host_full, "swa_host_pages": host_swa,
            "token_page_bytes": token_page_bytes(table, counts),
            "device_bytes": sum(r.device_bytes for r in rows), "host_bytes": sum(r.host_bytes for r in rows),
            "pools": [r.to_dict() for r in rows],
        })
    notes = []
    if requested_page_size != page:
        notes.append(f"sglang 0.5.23 runs DeepSeek-V4 with page_size {page} (it overrides "
                     f"--page-size {requested_page_size})")
    return {
        "model": layout.spec.name, "num_layers": layout.spec.num_layers, "pp_size": layout.pp_size,
        "page_size": page, "requested_page_size": requested_page_size,
        "faults": [f.name for f in faults], "sizing": options.to_dict(), "notes": notes,
        "kinds": table.to_dict()["kinds"], "stages": stages,
        "totals": {"device_bytes": sum(s["device_bytes"] for s in stages),
                   "host_bytes": sum(s["host_bytes"] for s in stages)},
    }
