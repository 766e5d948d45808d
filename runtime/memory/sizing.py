"""Pure byte accounting of a stage's KV pools: one function the real pools and ``stagecache pools`` share.

All pools of a stage share one page-id space ("token pages"): page ``p`` of
every pool holds the rows of token page ``p`` (``page_size`` tokens).  So a
page of each pool kind has a fixed byte size, and a stage costs
``sum(buffers x page_bytes) x num_pages`` bytes.  Keeping this arithmetic here,
with no tensors, lets the CLI print the accounting for a 43-layer model on a
laptop and lets a test check that the real ``StagePools`` allocates exactly
that.

Per pool, rows per page x bytes per row:

* ``swa``         -- ``page_size`` rows of ``spec.kv_row_bytes`` (584 B for flash).
* ``c4``          -- ``page_size // 4`` compressed rows of ``kv_row_bytes``.
* ``c128``        -- ``page_size // 128`` compressed rows of ``kv_row_bytes``.
* ``indexer``     -- ``page_size // 4`` rows of ``spec.indexer_row_bytes``.
* ``c4_state`` / ``c128_state`` -- ``page_size`` rows of
  ``spec.compress_state_row_bytes(ratio)``.

Why the compress state is per token of the page: sglang's ``CompressStatePool``
is a small ring per request (8 slots for C4, 128 for C128), indexed by request,
not by token page.  A cache that backs up and reloads *pages* needs the state
addressable by the same page id as the KV it belongs to, so stagecache stores
the running state per token slot, with the row bytes already amortised over
the window (``compress_state_row_bytes`` divides the window's FP32 kv+score by
the ratio).  The cost is visible in the accounting (C4 state is the largest
pool per page); the benefit is one page-id space and one transfer path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..model.layer_map import POOL_RATIO, POOLS, StageLayerMap
from ..model.spec import ModelSpec, check_page_size

#: Token-rows-per-page divisor of each pool kind (1 = one row per token).
ROW_DIVISOR: dict[str, int] = {
    "swa": 1,
    "c4": 4,
    "c128": 128,
    "c4_state": 1,
    "c128_state": 1,
    "indexer": 4,
}


@dataclass(frozen=True)
class PoolGeometry:
    """One page of one pool kind: ``rows_per_page`` rows of ``row_bytes`` bytes."""

    pool: str
    rows_per_page: int
    row_bytes: int

    @property
    def page_bytes(self) -> int:
        return self.rows_per_page * self.row_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"pool": self.pool, "rows_per_page": self.rows_per_page,
                "row_bytes": self.row_bytes, "page_bytes": self.page_bytes}


def _row_bytes(spec: ModelSpec, pool: str) -> int:
    if pool in ("swa", "c4", "c128"):
        return spec.kv_row_bytes
    if pool == "indexer":
        return spec.indexer_row_bytes
    if pool == "c4_state":
        return spec.compress_state_row_bytes(4)
    if pool == "c128_state":
        return spec.compress_state_row_bytes(128)
    raise ConfigError(f"unknown pool {pool!r}; pools are {', '.join(POOLS)}")


def check_layout_page_size(spec: ModelSpec, page_size: int) -> int:
    """``check_page_size`` plus the divisors of the pools this model really has.

    A model with no C128 layer may use pages that are multiples of 4 only; a
    page must still hold at least one whole row of every pool kind it uses.
    """
    check_page_size(spec, page_size)
    used = {r for r in spec.compress_ratios if r}
    for pool, div in ROW_DIVISOR.items():
        ratio = POOL_RATIO[pool]
        if ratio is not None and ratio not in used:
            continue
        if page_size % div or page_size // div < 1:
            raise ConfigError(
                f"--page-size {page_size}: the {pool} pool stores page_size/{div} rows per page, "
                f"so the page size must be a positive multiple of {div}"
            )
    return page_size


def pool_geometry(spec: ModelSpec, pool: str, page_size: int) -> PoolGeometry:
    """Rows and bytes of one page of ``pool`` for this model and page size."""
    if pool not in ROW_DIVISOR:
        raise ConfigError(f"unknown pool {pool!r}; pools are {', '.join(POOLS)}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ConfigError(f"--page-size must be a positive integer, got {page_size!r}")
    div = ROW_DIVISOR[pool]
    if page_size % div:
        raise ConfigError(
            f"--page-size {page_size}: the {pool} pool stores page_size/{div} rows per page, "
            f"so the page size must be a multiple of {div}"
        )
    return PoolGeometry(pool, page_size // div, _row_bytes(spec, pool))


def stage_geometries(spec: ModelSpec, stage_map: StageLayerMap, page_size: int) -> dict[str, PoolGeometry]:
    """Geometry of every pool kind the stage has at least one buffer of."""
    expected = stage_map.expected_buffers()
    return {p: pool_geometry(spec, p, page_size) for p in POOLS if expected[p]}


def stage_pool_bytes(
    spec: ModelSpec,
    stage_map: StageLayerMap,
    page_size: int,
    num_pages: int,
    buffers: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Bytes each pool of a stage occupies: buffers x page_bytes x num_pages.

    ``buffers`` (pool -> allocated buffer count) defaults to the correct
    stage-local counts; pass a fault's buffer plan counts to price a buggy build.
    """
    counts = dict(stage_map.expected_buffers()) if buffers is None else dict(buffers)
    out: dict[str, int] = {}
    for pool in POOLS:
        n = counts.get(pool, 0)
        out[pool] = n * pool_geometry(spec, pool, page_size).page_bytes * num_pages if n else 0
    return out


def stage_token_page_bytes(
    spec: ModelSpec, stage_map: StageLayerMap, page_size: int, buffers: Mapping[str, int] | None = None
) -> int:
    """Bytes one token page costs on this stage, all pools and layers together."""
    return sum(stage_pool_bytes(spec, stage_map, page_size, 1, buffers).values())


def pages_for_tokens(max_total_tokens: int, page_size: int) -> int:
    """``--max-total-tokens`` -> pages (rounded up, so every token fits)."""
    if isinstance(max_total_tokens, bool) or not isinstance(max_total_tokens, int) or max_total_tokens <= 0:
        raise ConfigError(f"--max-total-tokens must be a positive integer, got {max_total_tokens!r}")
    return -(-max_total_tokens // page_size)


def pages_for_budget(
    spec: ModelSpec, stage_map: StageLayerMap, page_size: int, budget_bytes: int
) -> int:
    """The most token pages a stage fits in ``budget_bytes`` (rounded down; at least one or error)."""
    per_page = stage_token_page_bytes(spec, stage_map, page_size)
    if budget_bytes < per_page:
        raise ConfigError(
            f"stage {stage_map.stage}: memory budget {budget_bytes} B is smaller than one token "
            f"page of its pools ({per_page} B at page size {page_size})"
        )
    return budget_bytes // per_page


@dataclass(frozen=True)
class PoolAccount:
    """One row of ``stagecache pools``: a pool kind of one stage, device and host side."""

    stage: int
    pool: str
    buffers: int
    rows_per_page: int
    row_bytes: int
    page_bytes: int
    device_pages: int
    host_pages: int

    @property
    def device_bytes(self) -> int:
        return self.buffers * self.page_bytes * self.device_pages

    @property
    def host_bytes(self) -> int:
        return self.buffers * self.page_bytes * self.host_pages

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage, "pool": self.pool, "buffers": self.buffers,
            "rows_per_page": self.rows_per_page, "row_bytes": self.row_bytes,
            "page_bytes": self.page_bytes, "device_pages": self.device_pages,
            "host_pages": self.host_pages, "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
        }


def host_pages_for(device_pages: int, hicache_ratio: float | None = None,
                   hicache_size_bytes: int | None = None, token_page_bytes: int | None = None) -> int:
    """Host mirror pages: from ``--hicache-size`` bytes if given, else device pages x ratio.

    Mirrors sglang's precedence (an explicit host size wins over the ratio) and
    its default ratio of 2.0.
    """
    if hicache_size_bytes is not None:
        if hicache_size_bytes <= 0:
            raise ConfigError(f"--hicache-size must be positive, got {hicache_size_bytes} bytes")
        if not token_page_bytes:
            raise ConfigError("host pool sizing by bytes needs the stage's bytes per token page")
        pages = hicache_size_bytes // token_page_bytes
        if pages < 1:
            raise ConfigError(
                f"--hicache-size {hicache_size_bytes} B is smaller than one host page "
                f"({token_page_bytes} B)"
            )
        return pages
    ratio = 2.0 if hicache_ratio is None else hicache_ratio
    if not ratio > 0:
        raise ConfigError(f"--hicache-ratio must be > 0, got {ratio}")
    pages = int(device_pages * ratio)
    if pages < 1:
        raise ConfigError(
            f"--hicache-ratio {ratio} x {device_pages} device pages gives no host page"
        )
    return pages


def stage_accounts(
    spec: ModelSpec, stage_map: StageLayerMap, page_size: int, device_pages: int, host_pages: int,
    buffers: Mapping[str, int] | None = None,
) -> list[PoolAccount]:
    """Every pool kind of a stage as ``PoolAccount`` rows (pools with no buffer included, as 0)."""
    counts = dict(stage_map.expected_buffers()) if buffers is None else dict(buffers)
    rows = []
    for pool in POOLS:
        if counts.get(pool, 0):
            g = pool_geometry(spec, pool, page_size)
        else:  # a pool this stage does not use: no divisibility demand on the page size
            g = PoolGeometry(pool, page_size // ROW_DIVISOR[pool], _row_bytes(spec, pool))
        rows.append(PoolAccount(stage_map.stage, pool, counts.get(pool, 0), g.rows_per_page,
                                g.row_bytes, g.page_bytes, device_pages, host_pages))
    return rows
