"""Pure sizing of a stage's pools: pages (or request slots) per kind, and the bytes they take.

Bytes per page come from the pool-kind table (``model.pool_kinds``); this module
only decides *how many* pages each kind gets, following sglang 0.5.23's
DeepSeek-V4 configurator (``DSV4PoolConfigurator``):

* full-budget kinds (``c4``, ``c128``, ``indexer``) get ``full_tokens / page_size`` pages;
* SWA-budget kinds (``swa``, ``c4_state``, ``c4_indexer_state``) get
  ``int(full_tokens x swa_full_tokens_ratio)`` tokens' worth (0.1 for DeepSeek-V4 by default);
* per-request kinds (``c128_state``) get ``max_running_requests + 1`` request slots;
* host (HiCache) pages are ``int(device pages x --hicache-ratio)`` of each kind's budget;
  sglang refuses a host size in bytes for DeepSeek-V4.

The tensors sglang allocates hold a few rows more (``PoolKindSpec.tensor_rows``); the
accounts report those exact bytes.  stagecache's own runtime (``StagePools``) allocates
the budget pages only, with one page-id space (SWA pages == full pages).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..model.layer_map import StageLayerMap
from ..model.pool_kinds import POOLS, KindTable, PoolKind

#: sglang 0.5.23's ``--swa-full-tokens-ratio`` for DeepSeek-V4 (its model override sets it).
DSV4_SWA_FULL_TOKENS_RATIO = 0.1
#: sglang 0.5.23's ``--max-running-requests`` for DeepSeek-V4 (``apply_deepseek_v4_defaults``).
DSV4_MAX_RUNNING_REQUESTS = 256
#: sglang's default ``--hicache-ratio``.
DEFAULT_HICACHE_RATIO = 2.0
#: The page size sglang 0.5.23 runs DeepSeek-V4 with on CUDA (it overrides ``--page-size``).
DSV4_PAGE_SIZE = 256

HICACHE_SIZE_REFUSED = (
    "--hicache-size: DeepSeek V4 HiCache does not support a host size in bytes (sglang 0.5.23 "
    "refuses it); size the host pools with --hicache-ratio"
)


@dataclass(frozen=True)
class TokenBudget:
    """The budgets a stage's pools are sized by: full tokens, SWA tokens, request slots."""

    page_size: int
    full_tokens: int
    swa_tokens: int
    request_slots: int

    @property
    def full_pages(self) -> int:
        return self.full_tokens // self.page_size

    @property
    def swa_pages(self) -> int:
        return self.swa_tokens // self.page_size

    def units(self, kind: PoolKind) -> int:
        """Pages (paged kinds) or request slots (per-request kinds) of ``kind``."""
        return {"full": self.full_pages, "swa": self.swa_pages, "request": self.request_slots}[kind.budget]

    def to_dict(self) -> dict[str, int]:
        return {"full_tokens": self.full_tokens, "swa_tokens": self.swa_tokens,
                "request_slots": self.request_slots, "full_pages": self.full_pages,
                "swa_pages": self.swa_pages}


def _positive(value: object, flag: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{flag} must be a positive integer, got {value!r}")


def _check_ratio(ratio: float, flag: str) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise ConfigError(f"{flag} must be in (0, 1], got {ratio!r}")
    return float(ratio)


def runtime_budget(page_size: int, device_pages: int, swa_ratio: float = 1.0,
                   request_slots: int = 4) -> TokenBudget:
    """stagecache's runtime pools: ``device_pages`` full pages, SWA pages by ``swa_ratio``."""
    _positive(device_pages, "number of device pages")
    _positive(request_slots, "number of request slots")
    swa_pages = int(device_pages * _check_ratio(swa_ratio, "swa ratio"))
    if swa_pages < 1:
        raise ConfigError(f"swa ratio {swa_ratio} x {device_pages} device pages gives no SWA page")
    return TokenBudget(page_size, device_pages * page_size, swa_pages * page_size, request_slots)


def sglang_budget(page_size: int, full_tokens: int, sliding_window: int,
                  swa_ratio: float | None = None,
                  max_running_requests: int = DSV4_MAX_RUNNING_REQUESTS) -> TokenBudget:
    """The budget sglang's ``DSV4PoolConfigurator`` derives from ``max_total_tokens``.

    Full tokens are floored to whole pages, SWA tokens are ``int(full x ratio)`` floored
    to pages and must exceed ``sliding_window + page_size`` (sglang's
    ``validate_swa_pool_size``), and the request slots are ``min(max_running_requests,
    full // 2) + 1`` (``resolve_max_num_reqs`` and ``ReqToTokenPool``'s extra row).
    """
    _positive(full_tokens, "--max-total-tokens")
    _positive(max_running_requests, "--max-running-requests")
    ratio = _check_ratio(DSV4_SWA_FULL_TOKENS_RATIO if swa_ratio is None else swa_ratio,
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


def host_pages_for(device_pages: int, hicache_ratio: float | None = None,
                   hicache_size_bytes: int | None = None) -> int:
    """Host pages of one budget: ``int(device_pages x ratio)`` (sglang's rule, default 2.0).

    A host size in bytes is refused, as sglang 0.5.23 refuses ``--hicache-size`` for DeepSeek-V4.
    """
    if hicache_size_bytes is not None:
        raise ConfigError(HICACHE_SIZE_REFUSED)
    ratio = DEFAULT_HICACHE_RATIO if hicache_ratio is None else hicache_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio > 0:
        raise ConfigError(f"--hicache-ratio must be > 0, got {ratio!r}")
    pages = int(device_pages * ratio)
    if pages < 1:
        raise ConfigError(f"--hicache-ratio {ratio} x {device_pages} device pages gives no host page")
    return pages


def pages_for_tokens(max_total_tokens: int, page_size: int) -> int:
    """``--max-total-tokens`` -> pages (rounded up, so every token fits)."""
    _positive(max_total_tokens, "--max-total-tokens")
    return -(-max_total_tokens // page_size)


@dataclass(frozen=True)
class PoolAccount:
    """One row of ``stagecache pools``: a pool kind of one stage, device and host side."""

    stage: int
    pool: str
    buffers: int
    budget: str
    host_cached: bool
    rows_per_page: int
    row_bytes: int
    page_bytes: int
    device_pages: int  # budget pages, or request slots for a per-request kind
    tensor_rows: int  # first dimension of each of sglang's tensors (reserved rows included)
    tensor_row_bytes: int
    host_pages: int

    @property
    def device_bytes(self) -> int:
        return self.buffers * self.tensor_rows * self.tensor_row_bytes

    @property
    def host_bytes(self) -> int:
        return self.buffers * self.host_pages * self.page_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.update(device_bytes=self.device_bytes, host_bytes=self.host_bytes)
        return d


def stage_accounts(table: KindTable, stage_map: StageLayerMap, budget: TokenBudget,
                   hicache_ratio: float | None = None,
                   buffers: Mapping[str, int] | None = None) -> list[PoolAccount]:
    """Every pool kind of a stage as sglang sizes it (kinds with no buffer included, as 0).

    ``buffers`` overrides the stage-local counts (a fault's plan, to price a buggy build).
    """
    counts = dict(stage_map.expected_buffers()) if buffers is None else dict(buffers)
    rows = []
    for name in POOLS:
        k = table[name]
        units = budget.units(k.kind)
        host = host_pages_for(units, hicache_ratio) if k.kind.host_cached else 0
        rows.append(PoolAccount(
            stage_map.stage, name, counts.get(name, 0), k.kind.budget, k.kind.host_cached,
            k.rows_per_page, k.row_bytes, k.page_bytes, units, k.tensor_rows(units),
            k.tensor_row_bytes, host,
        ))
    return rows


def budget_bytes(table: KindTable, counts: Mapping[str, int], budget: TokenBudget,
                 hicache_ratio: float | None = None, host: bool = False) -> int:
    """Bytes of pools that hold exactly their budget (stagecache's runtime): device, or host mirror."""
    total = 0
    for p, n in counts.items():
        k = table[p]
        units = budget.units(k.kind)
        if host:
            if not k.kind.host_cached:
                continue
            units = host_pages_for(units, hicache_ratio)
        total += n * units * k.page_bytes
    return total


def token_page_bytes(table: KindTable, counts: Mapping[str, int]) -> int:
    """One page of every paged kind, all buffers: the stage's cost per token page."""
    return sum(n * table[p].page_bytes for p, n in counts.items() if table[p].kind.paged)


def sglang_full_tokens_for_bytes(table: KindTable, stage_map: StageLayerMap, budget_bytes: int,
                                 swa_ratio: float | None = None,
                                 max_running_requests: int = DSV4_MAX_RUNNING_REQUESTS) -> int:
    """Full tokens sglang's ``DSV4PoolConfigurator.calculate_pool_sizes`` fits in ``budget_bytes``.

    Per full token: every full-budget kind's page bytes / page size, plus ``swa_ratio`` x
    every SWA-budget kind's; the per-request kinds are fixed bytes for
    ``max_running_requests + 1`` slots.  The result is floored to whole pages.
    """
    ratio = _check_ratio(DSV4_SWA_FULL_TOKENS_RATIO if swa_ratio is None else swa_ratio,
                         "--swa-full-tokens-ratio")
    page = table.page_size
    counts = stage_map.expected_buffers()

    def per_token(budget: str) -> float:
        return sum(counts[p] * table[p].page_bytes / page for p in POOLS if table[p].kind.budget == budget)

    per_full = ratio * per_token("swa") + per_token("full")
    fixed = sum(counts[p] * table[p].tensor_rows(max_running_requests + 1) * table[p].tensor_row_bytes
                for p in POOLS if table[p].kind.budget == "request")
    full = int(max(budget_bytes - fixed, 0) / per_full) // page * page
    if full <= 0:
        raise ConfigError(
            f"stage {stage_map.stage}: memory budget {budget_bytes} B holds no full page: its "
            f"per-request pools take {fixed} B and a page costs {per_full * page:.0f} B"
        )
    return full
