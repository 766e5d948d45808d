"""Pool kinds: what a kind of KV pool is, how one of its pages is sized, and a model's table of them.

A model family (``model/families``) declares its pool kinds (``PoolKind``: which layer kinds
own a buffer, which layer id indexes it, which budget sizes it, whether HiCache mirrors it) and
sizes them for a spec and a page size (a ``PoolKindSpec`` per kind).  The sizing rule is a
class, not a flag: ``KvPages`` (token pages of KV rows, padded and with sglang's reserved
pages) and ``StateRing`` (a compressor's ring of rows, padded to the ratio) compute their page
and tensor bytes each their own way.  Everything that needs a pool kind's facts -- the plan,
validation, the device pools and their host mirror, transfers, ``stagecache pools``/``check``,
exporters, dashboard and the sglang integration -- reads them from the run's ``KindTable``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..errors import ConfigError

if TYPE_CHECKING:
    from .spec import ModelSpec

#: What sizes a pool kind: full-attention tokens, SWA tokens, request slots (DeepSeek V4's
#: per-request compress state), or per-request state slots (Mamba conv + SSM state, sized by
#: sglang's ``max_mamba_cache_size``).
Budget = Literal["full", "swa", "request", "state"]


def check_host_ratio(ratio: object) -> float:
    """``--hicache-ratio``: a number > 0."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio > 0:
        raise ConfigError(f"--hicache-ratio must be > 0, got {ratio!r}")
    return ratio


def default_host_units(device_units: int, ratio: float) -> int:
    """Host pages of one budget: ``int(device_units x ratio)`` (DeepSeek V4's HiCache rule)."""
    check_host_ratio(ratio)
    pages = int(device_units * ratio)
    if pages < 1:
        raise ConfigError(f"--hicache-ratio {ratio} x {device_units} device pages gives no host page")
    return pages

#: The id space of a pool kind whose buffers are indexed by the local layer id (every layer owns
#: one): no numbering of its own.
LOCAL = "local"


class LayerIds(Protocol):
    """What indexes a pool's buffers: a layer's kind and its id in a numbering (``LayerEntry``)."""

    local: int

    @property
    def kind(self) -> str: ...

    def id_in(self, space: str) -> int | None: ...


@dataclass(frozen=True)
class PoolKind:
    """What a pool kind is, independent of model sizes: its name, owners, ids and sizing rule.

    ``count_message`` and ``none_name`` are the family's own words for a wrong pool (sglang's,
    where sglang says it), so an operator sees the message of the engine they run.
    """

    name: str  # the pool label value in metrics, JSON and CLI output
    label: str
    owners: frozenset[str] | None  # layer kinds with a buffer in this pool; None: every layer
    id_space: str  # the numbering that indexes its buffers (``LOCAL`` or one of the family's)
    budget: Budget  # which budget sizes it: full tokens, SWA tokens, or request slots
    host_cached: bool  # mirrored on the host and moved by HiCache transfers
    count_message: str = ("{label} pool must hold one buffer per local {owners} layer: got {got} "
                          "buffers for {expected} local {owners} layers")
    owners_text: str = ""  # the owning layers in a message ("ratio-4")
    none_name: str = ""  # how a pool holding None is named ("" -> "<label> pool")
    owner_ratio: int | None = None  # DeepSeek V4: the compress ratio owning it (``pools --json``)
    name_layers: bool = False  # a wrong-count message lists the stage's owning layers

    @property
    def paged(self) -> bool:
        """Indexed by token page (``full``/``swa``) rather than by request slot."""
        return self.budget not in ("request", "state")

    def owns(self, layer_kind: str) -> bool:
        return self.owners is None or layer_kind in self.owners

    def index_of(self, entry: LayerIds) -> int | None:
        """The buffer index of a layer entry in this kind."""
        return entry.id_in(self.id_space)

    def wrong_count(self, got: int, expected: int, layers: str = "") -> str:
        text = self.count_message.format(label=self.label, owners=self.owners_text, got=got,
                                         expected=expected)
        return f"{text} ({layers})" if layers else text

    def holds_none(self, empty: list[int]) -> str:
        return f"{self.none_name or self.label + ' pool'} must not contain None: buffer(s) {empty} are None"


@dataclass(frozen=True)
class PoolKindSpec:
    """One pool kind sized for a model and page size: what one page (or request slot) costs.

    ``rows_per_page`` rows of ``row_bytes`` make a page (a request slot for per-request
    kinds).  The tensors sglang allocates hold a few rows more than the budget asks for
    (``tensor_rows``); each subclass says how.
    """

    kind: PoolKind
    row_bytes: int
    rows_per_page: int

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (or request slot) of one buffer, sglang's padding included."""
        return self.rows_per_page * self.row_bytes

    @property
    def tensor_row_bytes(self) -> int:
        """Bytes of one first-dimension row of sglang's tensor."""
        raise NotImplementedError

    def tensor_rows(self, units: int) -> int:
        """First dimension of sglang's tensor for ``units`` budget pages (or request slots)."""
        raise NotImplementedError

    def host_units(self, device_units: int, ratio: float) -> int:
        """Host pages (or slots) HiCache builds for this kind from its device units."""
        return default_host_units(device_units, ratio)

    def to_dict(self) -> dict[str, Any]:
        k = self.kind
        return {"pool": k.name, "label": k.label, "owner_ratio": k.owner_ratio, "budget": k.budget,
                "paged": k.paged, "host_cached": k.host_cached, "row_bytes": self.row_bytes,
                "rows_per_page": self.rows_per_page, "page_bytes": self.page_bytes}


@dataclass(frozen=True)
class KvPages(PoolKindSpec):
    """Token pages of KV rows: a page is padded to ``page_align`` bytes, and sglang's tensor holds
    ``ceil((tokens + page_size) / rows_per_page)`` pages: the budget plus ``reserve_pages``."""

    page_align: int = 1
    reserve_pages: int = 0

    @property
    def page_bytes(self) -> int:
        raw = self.rows_per_page * self.row_bytes
        return -(-raw // self.page_align) * self.page_align

    @property
    def tensor_row_bytes(self) -> int:
        return self.page_bytes

    def tensor_rows(self, units: int) -> int:
        return units + self.reserve_pages


@dataclass(frozen=True)
class StateRing(PoolKindSpec):
    """A compressor's running state: a ring of ``rows_per_page`` rows per page (or request slot);
    sglang's ``CompressStatePool`` tensor has ``units x ring + ring + 1`` rows, padded to a
    multiple of ``ring_pad`` (the compress ratio)."""

    ring_pad: int = 1

    @property
    def tensor_row_bytes(self) -> int:
        return self.row_bytes

    def tensor_rows(self, units: int) -> int:
        rows = units * self.rows_per_page + self.rows_per_page + 1
        return -(-rows // self.ring_pad) * self.ring_pad


@dataclass(frozen=True)
class TokenRows(PoolKindSpec):
    """Per-token KV rows (MLA latent, MHA K and V): sglang's ``(size + page_size, heads, dim)``
    tensors, one row per token, so a tensor holds the budget's tokens plus one page; its HiCache
    host pool holds ``int(tokens x ratio)`` tokens rounded down to pages, plus one page
    (``HostKVCache``)."""

    @property
    def tensor_row_bytes(self) -> int:
        return self.row_bytes

    def tensor_rows(self, units: int) -> int:
        return (units + 1) * self.rows_per_page

    def host_units(self, device_units: int, ratio: float) -> int:
        return token_host_pages(device_units, self.rows_per_page, ratio)


@dataclass(frozen=True)
class RequestState(PoolKindSpec):
    """Per-request-slot state (Mamba conv + SSM state): one row of ``row_bytes`` per slot and
    layer; sglang's tensors hold the slots plus one padding slot, and HiCache's host pool
    ``int(slots x ratio) + 1`` slots (``MambaPoolHost``: page size 1)."""

    @property
    def tensor_row_bytes(self) -> int:
        return self.row_bytes

    def tensor_rows(self, units: int) -> int:
        return units + 1

    def host_units(self, device_units: int, ratio: float) -> int:
        check_host_ratio(ratio)
        return int(device_units * ratio) + 1


def token_host_pages(device_pages: int, page_size: int, ratio: float) -> int:
    """sglang's ``HostKVCache`` size for a device pool of ``device_pages`` token pages:
    ``int(tokens x ratio) // page_size + 1`` pages (at least its padding page: a pool of no
    pages, such as the full sub-pool of a stage of SWA layers only, still gets one)."""
    check_host_ratio(ratio)
    return int(device_pages * page_size * ratio) // page_size + 1


@dataclass(frozen=True)
class KindTable:
    """Every pool kind of one model at one page size: the only source of per-kind bytes."""

    spec: ModelSpec
    page_size: int
    kinds: Mapping[str, PoolKindSpec]  # in the family's display order

    def __getitem__(self, name: str) -> PoolKindSpec:
        try:
            return self.kinds[name]
        except KeyError:
            raise ConfigError(f"unknown pool {name!r}; pools are {', '.join(self.kinds)}") from None

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(self.kinds)

    def page_bytes(self, name: str) -> int:
        return self[name].page_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.spec.name, "page_size": self.page_size,
                "kinds": [k.to_dict() for k in self.kinds.values()]}
