"""The one table of DeepSeek-V4 pool kinds: who owns each kind, how it is sized, what a page costs.

Everything that needs a pool kind's facts -- the layer map, validation, the
device pools and their host mirror, the transfer controller, ``stagecache
pools``/``check``, exporters, dashboard and the sglang integration -- reads
them here.  The bytes follow what sglang 0.5.23 really allocates for a
DeepSeek-V4 stage on CUDA (``DeepSeekV4TokenToKVPool`` with the V4 FP8 KV
layout, FP8 indexer, no speculative decoding), measured on its objects by
tests/integrations/test_sglang_live.py:

* ``swa``, ``c4``, ``c128`` -- KV rows of 448 FP8 nope + 64 BF16 rope + one UE8M0
  scale per 64 nope values + 1 pad byte (584 B for flash); a page of them is
  padded to a multiple of the 576-byte data row (sglang's ``KVLayout.V4``
  page alignment), so a 256-token SWA page is 149,760 B, not 256 x 584.
* ``indexer`` -- the C4 indexer key: FP8 dims + one FP32 scale per 128 (132 B).
* ``c4_state`` / ``c4_indexer_state`` -- the C4 compressors' running state: a
  ring of 8 FP32 (kv, score) rows with overlap, addressed per *SWA page*, so
  these are sized by the SWA token budget and host-cached with the SWA pages.
* ``c128_state`` -- the C128 compressor's ring of 128 raw rows, one per
  *request slot*: per-request, never host-cached (sglang's HiCache assembler
  does not register it).

A kind's buffers belong to the stage's layers of its ``owner_ratio`` (every
layer for ``None``) and are indexed by the layer-map id named by ``id_attr``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ..errors import ConfigError
from .spec import ModelSpec

Budget = Literal["full", "swa", "request"]

#: sglang's compress-state ring sizes without speculative decoding
#: (``get_compress_state_ring_size``: 8 rows for C4, 128 raw rows for offline C128).
STATE_RING = {4: 8, 128: 128}
#: Bytes of one FP32 element (compress states are FP32 kv + score).
FP32 = 4
#: Nope values sharing one UE8M0 scale in the V4 KV row, and the FP8 indexer's scale block.
KV_SCALE_BLOCK = 64
INDEXER_SCALE_BLOCK = 128


class LayerIds(Protocol):
    """The ids of a layer that index pool buffers (``layer_map.LayerEntry`` or its JSON model)."""

    local: int
    compress_layer_id: int | None
    c4_state_id: int | None


@dataclass(frozen=True)
class PoolKind:
    """What a pool kind is, independent of model sizes: its name, owners and sizing rule."""

    name: str  # the pool label value in metrics, JSON and CLI output
    label: str
    owner_ratio: int | None  # None: every layer of the stage has a buffer
    id_attr: str  # LayerEntry attribute that indexes the kind's buffers
    budget: Budget  # which budget sizes it: full tokens, SWA tokens, or request slots
    host_cached: bool  # mirrored on the host and moved by HiCache transfers

    @property
    def paged(self) -> bool:
        """Indexed by token page (``full``/``swa``) rather than by request slot."""
        return self.budget != "request"

    def owns(self, compress_ratio: int) -> bool:
        return self.owner_ratio is None or compress_ratio == self.owner_ratio

    def index_of(self, entry: LayerIds) -> int | None:
        """The buffer index of a layer entry in this kind (``LayerEntry`` or its JSON model)."""
        return getattr(entry, self.id_attr)


_KINDS = (
    PoolKind("swa", "SWA KV", None, "local", "swa", True),
    PoolKind("c4", "C4 KV", 4, "compress_layer_id", "full", True),
    PoolKind("c128", "C128 KV", 128, "compress_layer_id", "full", True),
    PoolKind("c4_state", "C4 compress-state", 4, "c4_state_id", "swa", True),
    PoolKind("c128_state", "C128 compress-state", 128, "compress_layer_id", "request", False),
    PoolKind("indexer", "C4 indexer", 4, "compress_layer_id", "full", True),
    PoolKind("c4_indexer_state", "C4 indexer compress-state", 4, "c4_state_id", "swa", True),
)

#: Every pool kind by name, in display order.
KINDS: dict[str, PoolKind] = {k.name: k for k in _KINDS}
#: Pool kind names in display order.
POOLS: tuple[str, ...] = tuple(KINDS)
#: The kinds a HiCache host mirror holds and transfers move.
HOST_CACHED: tuple[str, ...] = tuple(k.name for k in _KINDS if k.host_cached)


def kind(name: str) -> PoolKind:
    """The kind named ``name``; a ConfigError listing the kinds otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ConfigError(f"unknown pool {name!r}; pools are {', '.join(POOLS)}") from None


@dataclass(frozen=True)
class PoolKindSpec:
    """One pool kind sized for a model and page size: what one page (or request slot) costs.

    ``rows_per_page`` rows of ``row_bytes`` make a page (a request slot for
    per-request kinds); ``page_bytes`` adds sglang's page padding.  The tensors
    sglang allocates hold a few rows more than the budget asks for
    (``tensor_rows``): KV pools reserve one logical page, compress states pad
    their ring.
    """

    kind: PoolKind
    row_bytes: int
    rows_per_page: int
    page_align: int = 1  # page bytes are padded to a multiple of this
    reserve_pages: int = 0  # KV pools: extra tensor pages sglang reserves
    ring_pad: int = 0  # compress states: rows are padded to a multiple of this (0 = KV)

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (or request slot) of one buffer, sglang's padding included."""
        raw = self.rows_per_page * self.row_bytes
        return -(-raw // self.page_align) * self.page_align

    @property
    def tensor_row_bytes(self) -> int:
        """Bytes of one first-dimension row of sglang's tensor: a page (KV) or a ring row (state)."""
        return self.row_bytes if self.ring_pad else self.page_bytes

    def tensor_rows(self, units: int) -> int:
        """First dimension of sglang's tensor for ``units`` budget pages (or request slots).

        KV pools: ``ceil((tokens + page_size) / rows_per_page)`` pages, i.e. the budget
        plus one reserved logical page.  Compress states (``CompressStatePool``):
        ``units x ring + ring + 1`` rows, padded to a multiple of the compress ratio.
        """
        if self.ring_pad:
            rows = units * self.rows_per_page + self.rows_per_page + 1
            return -(-rows // self.ring_pad) * self.ring_pad
        return units + self.reserve_pages

    def to_dict(self) -> dict[str, Any]:
        k = self.kind
        return {"pool": k.name, "label": k.label, "owner_ratio": k.owner_ratio, "budget": k.budget,
                "paged": k.paged, "host_cached": k.host_cached, "row_bytes": self.row_bytes,
                "rows_per_page": self.rows_per_page, "page_bytes": self.page_bytes}


def check_page_size(spec: ModelSpec, page_size: object) -> int:
    """A page must hold whole compressed rows of every ratio the model uses."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ConfigError(f"--page-size must be a positive integer, got {page_size!r}")
    largest = max((r for r in spec.compress_ratios if r), default=1)
    if page_size % largest:
        raise ConfigError(
            f"--page-size {page_size} must be a multiple of {largest} (the largest compress ratio "
            f"of {spec.name}), so each page holds whole compressed tokens"
        )
    return page_size


@dataclass(frozen=True)
class KindTable:
    """Every pool kind of one model at one page size: the only source of per-kind bytes."""

    spec: ModelSpec
    page_size: int
    kinds: dict[str, PoolKindSpec]

    def __getitem__(self, name: str) -> PoolKindSpec:
        kind(name)  # ConfigError for an unknown name
        return self.kinds[name]

    def page_bytes(self, name: str) -> int:
        return self[name].page_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.spec.name, "page_size": self.page_size,
                "kinds": [k.to_dict() for k in self.kinds.values()]}


def kind_table(spec: ModelSpec, page_size: int) -> KindTable:
    """Build the table for ``spec`` at ``page_size`` (the page size is checked here, once)."""
    page = check_page_size(spec, page_size)
    nope, rope, index_dim = spec.nope_head_dim, spec.qk_rope_head_dim, spec.index_head_dim
    # V4 FP8 KV row: FP8 nope, BF16 rope, one UE8M0 scale per 64 nope values, one pad byte.
    kv_row = nope + 2 * rope + nope // KV_SCALE_BLOCK + 1
    kv_align = nope + 2 * rope  # the layout's data row, the reader's TMA stride
    indexer_row = index_dim + index_dim // INDEXER_SCALE_BLOCK * FP32  # FP8 key + FP32 scales

    def kv(name: str, divisor: int) -> PoolKindSpec:
        return PoolKindSpec(KINDS[name], kv_row, page // divisor, kv_align, reserve_pages=divisor)

    def state(name: str, ratio: int, head_dim: int) -> PoolKindSpec:
        overlap = 2 if ratio == 4 else 1  # C4 compresses overlapping windows
        row = 2 * overlap * head_dim * FP32  # FP32 kv and score
        return PoolKindSpec(KINDS[name], row, STATE_RING[ratio], ring_pad=ratio)

    kinds = {
        "swa": kv("swa", 1),
        "c4": kv("c4", 4),
        "c128": kv("c128", 128),
        "c4_state": state("c4_state", 4, spec.head_dim),
        "c128_state": state("c128_state", 128, spec.head_dim),
        "indexer": PoolKindSpec(KINDS["indexer"], indexer_row, page // 4, reserve_pages=4),
        "c4_indexer_state": state("c4_indexer_state", 4, index_dim),
    }
    return KindTable(spec, page, kinds)
