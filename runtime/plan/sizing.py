"""Pure sizing of a stage's pools: how many pages (or request slots) each pool kind gets.

Bytes per page come from the model's pool-kind table (its family's ``kind_table``); this module
only decides *how many* pages each budget gets, following sglang 0.5.23's pool configurators
(DeepSeek V4's ``DSV4PoolConfigurator`` first: docs/pools.md, "How sglang sizes a stage").
stagecache's own runtime allocates the budget pages only, with one page-id space (SWA pages ==
full pages: ``runtime_budget``).  The plan (``plan.py``) is the only caller that turns these
budgets into bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .. import defaults
from ..errors import ConfigError
from ..model.pool_kinds import KindTable, PoolKind, default_host_units


@dataclass(frozen=True)
class TokenBudget:
    """The budgets a stage's pools are sized by: full tokens, SWA tokens, request slots."""

    page_size: int
    full_tokens: int
    swa_tokens: int
    request_slots: int
    state_slots: int | None = None  # per-request state slots (Mamba); None: no such kind


    @property
    def full_pages(self) -> int:
        return self.full_tokens // self.page_size

    @property
    def swa_pages(self) -> int:
        return self.swa_tokens // self.page_size

    def units(self, kind: PoolKind) -> int:
        """Pages (paged kinds) or request slots (per-request kinds) of ``kind``."""
        return {"full": self.full_pages, "swa": self.swa_pages, "request": self.request_slots,
                "state": self.state_slots or 0}[kind.budget]

    def to_dict(self) -> dict[str, int]:
        out = {"full_tokens": self.full_tokens, "swa_tokens": self.swa_tokens,
               "request_slots": self.request_slots, "full_pages": self.full_pages,
               "swa_pages": self.swa_pages}
        if self.state_slots is not None:
            out["state_slots"] = self.state_slots
        return out


def check_positive(value: object, flag: str) -> None:
    """``flag`` must be a positive integer (a ConfigError naming it otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{flag} must be a positive integer, got {value!r}")


def _check_ratio(ratio: float, flag: str) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise ConfigError(f"{flag} must be in (0, 1], got {ratio!r}")
    return float(ratio)


def runtime_budget(page_size: int, device_pages: int, swa_ratio: float = 1.0,
                   request_slots: int = 4) -> TokenBudget:
    """stagecache's runtime pools: ``device_pages`` full pages, SWA pages by ``swa_ratio``."""
    check_positive(device_pages, "number of device pages")
    check_positive(request_slots, "number of request slots")
    swa_pages = int(device_pages * _check_ratio(swa_ratio, "swa ratio"))
    if swa_pages < 1:
        raise ConfigError(f"swa ratio {swa_ratio} x {device_pages} device pages gives no SWA page")
    return TokenBudget(page_size, device_pages * page_size, swa_pages * page_size, request_slots)


def sglang_budget(page_size: int, full_tokens: int, sliding_window: int,
                  swa_ratio: float | None = None,
                  max_running_requests: int = defaults.MAX_RUNNING_REQUESTS) -> TokenBudget:
    """The budget sglang's ``DSV4PoolConfigurator`` derives from ``max_total_tokens``.

    Full tokens are floored to whole pages, SWA tokens are ``int(full x ratio)`` floored
    to pages and must exceed ``sliding_window + page_size`` (sglang's
    ``validate_swa_pool_size``), and the request slots are ``min(max_running_requests,
    full // 2) + 1`` (``resolve_max_num_reqs`` and ``ReqToTokenPool``'s extra row).
    """
    check_positive(full_tokens, "--max-total-tokens")
    check_positive(max_running_requests, "--max-running-requests")
    ratio = _check_ratio(defaults.SWA_FULL_TOKENS_RATIO if swa_ratio is None else swa_ratio,
                         "--swa-full-tokens-ratio")
    full = full_tokens // page_size * page_size
    if full <= 0:
        raise ConfigError(f"--max-total-tokens {full_tokens} is less than one page of {page_size} tokens")
    swa = int(full * ratio) // page_size * page_size
    if sliding_window + page_size >= swa:
        raise ConfigError(
            f"SWA pool ({swa} tokens) cannot hold even one request: the prefill admission floor is "
            f"sliding_window ({sliding_window}) + page_size ({page_size}); raise "
            "--swa-full-tokens-ratio or --max-total-tokens"
        )
    return TokenBudget(page_size, full, swa, min(max_running_requests, full // 2) + 1)


def host_pages_for(device_pages: int, hicache_ratio: float | None = None) -> int:
    """Host pages of one budget: ``int(device_pages x ratio)`` (sglang's rule, default 2.0)."""
    return default_host_units(device_pages, defaults.HICACHE_RATIO if hicache_ratio is None else hicache_ratio)


def pages_for_tokens(max_total_tokens: int, page_size: int) -> int:
    """``--max-total-tokens`` -> pages (rounded up, so every token fits)."""
    check_positive(max_total_tokens, "--max-total-tokens")
    return -(-max_total_tokens // page_size)


def sglang_full_tokens_for_bytes(table: KindTable, counts: Mapping[str, int], budget_bytes: int,
                                 swa_ratio: float | None = None,
                                 max_running_requests: int = defaults.MAX_RUNNING_REQUESTS,
                                 where: str = "stage") -> int:
    """Full tokens sglang's ``DSV4PoolConfigurator.calculate_pool_sizes`` fits in ``budget_bytes``
    for a stage with ``counts`` buffers per pool kind.

    Per full token: every full-budget kind's page bytes / page size, plus ``swa_ratio`` x
    every SWA-budget kind's; the per-request kinds are fixed bytes for
    ``max_running_requests + 1`` slots.  The result is floored to whole pages.
    """
    ratio = _check_ratio(defaults.SWA_FULL_TOKENS_RATIO if swa_ratio is None else swa_ratio,
                         "--swa-full-tokens-ratio")
    page = table.page_size

    def per_token(budget: str) -> float:
        return sum(counts.get(p, 0) * table[p].page_bytes / page for p in table.pools
                   if table[p].kind.budget == budget)

    per_full = ratio * per_token("swa") + per_token("full")
    fixed = sum(counts.get(p, 0) * table[p].tensor_rows(max_running_requests + 1) * table[p].tensor_row_bytes
                for p in table.pools if table[p].kind.budget == "request")
    full = int(max(budget_bytes - fixed, 0) / per_full) // page * page if per_full else 0
    if full <= 0:
        raise ConfigError(
            f"{where}: memory budget {budget_bytes} B holds no full page: its "
            f"per-request pools take {fixed} B and a page costs {per_full * page:.0f} B"
        )
    return full
