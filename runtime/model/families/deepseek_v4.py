"""DeepSeek V4: sliding-window KV on every layer, compressed KV, states and an indexer on C4/C128.

Layer kinds come from ``compress_ratios`` (one per layer, plus one placeholder per MTP layer,
dropped).  The bytes follow what sglang 0.5.23 really allocates for a DeepSeek-V4 stage on CUDA
(``DeepSeekV4TokenToKVPool`` with the V4 FP8 KV layout, FP8 indexer, no speculative decoding),
measured on its objects by tests/integrations/test_sglang_live.py; docs/pools.md, "The pool
kinds", tables every kind (the SWA-page-addressed C4 states, the per-request C128 state that
HiCache never mirrors).  Ids: C4 and C128 layers are numbered each among the stage's layers of
their ratio (``compress_layer_id``), the C4 states among its C4 layers (``c4_state_id``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from ... import defaults
from ...errors import ConfigError
from ..family import (
    Family,
    FaultKind,
    LayerKind,
    backup_without_indexer,
    duplicate_id,
    ids_counted_globally,
    last_buffer_none,
    later_stages,
    sized_globally,
)
from ..layer_map import IdSpace, LayerEntry
from ..pool_kinds import LOCAL, KindTable, KvPages, PoolKind, PoolKindSpec, StateRing
from ..spec import MAX_DIM, MAX_LAYERS, MAX_MTP_LAYERS, MAX_SLIDING_WINDOW, ConfigFields, ModelSpec

#: Compress ratios DeepSeek V4 uses: 0 = SWA only, 4 = C4 (+indexer, state), 128 = C128.
SUPPORTED_RATIOS = (0, 4, 128)
#: Layer kind of each ratio.
KIND_OF_RATIO = {0: "swa", 4: "c4", 128: "c128"}
RATIO_OF_KIND = {k: r for r, k in KIND_OF_RATIO.items()}
#: sglang's compress-state ring sizes without speculative decoding
#: (``get_compress_state_ring_size``: 8 rows for C4, 128 raw rows for offline C128).
STATE_RING = {4: 8, 128: 128}
#: Bytes of one FP32 element (compress states are FP32 kv + score).
FP32 = 4
#: Nope values sharing one UE8M0 scale in the V4 KV row, and the FP8 indexer's scale block.
KV_SCALE_BLOCK = 64
INDEXER_SCALE_BLOCK = 128


@dataclass(frozen=True)
class DeepSeekV4Spec(ModelSpec):
    """What the KV cache needs to know about a DeepSeek-V4-style model."""

    compress_ratios: tuple[int, ...]  # one per PP layer (the MTP placeholder dropped)
    sliding_window: int
    head_dim: int
    qk_rope_head_dim: int
    index_head_dim: int
    num_nextn_predict_layers: int = 0

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(KIND_OF_RATIO[r] for r in self.compress_ratios)

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim


class DeepSeekV4Layer(LayerEntry):
    """A DeepSeek V4 layer: its compress ratio and its ids in the stage's compressed pools."""

    compress_ratio: Literal[0, 4, 128]
    compress_layer_id: int | None = Field(
        description="index in the stage's pool of the layer's ratio (C4 or C128); None for ratio 0")
    c4_state_id: int | None = Field(description="index among the stage's ratio-4 layers; None otherwise")

    @property
    def kind(self) -> str:
        return KIND_OF_RATIO[self.compress_ratio]

    def describe(self) -> str:
        return f"compress ratio {self.compress_ratio}"

    @classmethod
    def make(cls, local: int, global_id: int, kind: str, ids: dict[str, int | None]) -> DeepSeekV4Layer:
        return cls.model_construct(local=local, global_id=global_id, compress_ratio=RATIO_OF_KIND[kind],
                                   compress_layer_id=ids["compress_layer_id"], c4_state_id=ids["c4_state_id"])


#: C4 and C128 layers are numbered each among the stage's layers of their ratio.
COMPRESS_IDS = IdSpace("compress_layer_id", frozenset({"c4", "c128"}), per_kind=True, text="compress id")
C4_STATE_IDS = IdSpace("c4_state_id", frozenset({"c4"}), text="C4 state id")


def _owned(name: str, label: str, ratio: int | None, space: str, budget: Any, host: bool) -> PoolKind:
    if ratio is None:
        return PoolKind(name, label, None, space, budget, host,
                        count_message="DeepSeek V4 SWA KV pool must be PP-stage-local: got {got} "
                                      "buffers for {expected} local layers")
    return PoolKind(name, label, frozenset({KIND_OF_RATIO[ratio]}), space, budget, host,
                    owners_text=f"ratio-{ratio}", owner_ratio=ratio,
                    none_name=f"deepseek_v4_{name} state_pools" if name.endswith("_state") else "")


_POOL_KINDS = (
    _owned("swa", "SWA KV", None, LOCAL, "swa", True),
    _owned("c4", "C4 KV", 4, COMPRESS_IDS.name, "full", True),
    _owned("c128", "C128 KV", 128, COMPRESS_IDS.name, "full", True),
    _owned("c4_state", "C4 compress-state", 4, C4_STATE_IDS.name, "swa", True),
    _owned("c128_state", "C128 compress-state", 128, COMPRESS_IDS.name, "request", False),
    _owned("indexer", "C4 indexer", 4, COMPRESS_IDS.name, "full", True),
    _owned("c4_indexer_state", "C4 indexer compress-state", 4, C4_STATE_IDS.name, "swa", True),
)
#: Every DeepSeek V4 pool kind by name, in display order.
KINDS: dict[str, PoolKind] = {k.name: k for k in _POOL_KINDS}
#: Pool kind names in display order.
POOLS: tuple[str, ...] = tuple(KINDS)
#: The kinds a HiCache host mirror holds and transfers move.
HOST_CACHED: tuple[str, ...] = tuple(k.name for k in _POOL_KINDS if k.host_cached)

_C4_POOLS = tuple(k.name for k in _POOL_KINDS if k.owner_ratio == 4)


def check_page_size(spec: DeepSeekV4Spec, page_size: object) -> int:
    """A page must hold whole compressed rows of every ratio the model uses."""
    page_size = Family.positive_page_size(page_size)
    largest = max((r for r in spec.compress_ratios if r), default=1)
    if page_size % largest:
        raise ConfigError(
            f"--page-size {page_size} must be a multiple of {largest} (the largest compress ratio "
            f"of {spec.name}), so each page holds whole compressed tokens"
        )
    return page_size


class DeepSeekV4(Family):
    name = "deepseek_v4"
    label = "DeepSeek V4"
    architectures = ("DeepseekV4ForCausalLM",)
    entry = DeepSeekV4Layer
    layer_kinds = (LayerKind("swa", "ratio 0"), LayerKind("c4", "ratio 4"), LayerKind("c128", "ratio 128"))
    legend_title = "compress"
    id_spaces = (COMPRESS_IDS, C4_STATE_IDS)
    pool_kinds = _POOL_KINDS
    #: sglang 0.5.23's V4 FP8 layout (FP8 nope, BF16 rope, UE8M0 scales) and FP8 indexer keys
    kv_dtype = "fp8_v4"
    swa_full_tokens_ratio = defaults.SWA_FULL_TOKENS_RATIO
    host_size_reason = "DeepSeek V4 HiCache does not support a host size in bytes (sglang 0.5.23 refuses it)"
    faults = (
        FaultKind("global-swa", "SWA KV pool sized by the model's global layer count (the original "
                  "PP+HiCache bug)", count=sized_globally("swa")),
        FaultKind("missing-c4-state", "a later stage's C4 compress-state pool holds None "
                  "('state_pools must not contain None')", stages=later_stages,
                  present=last_buffer_none("c4_state")),
        FaultKind("global-c4", "C4 KV/state/indexer pools sized by the model's global ratio-4 layer "
                  "count", count=sized_globally(*_C4_POOLS)),
        FaultKind("global-compress-ids", "compress ids counted over the whole model instead of "
                  "inside the stage", layer_map=ids_counted_globally(COMPRESS_IDS, C4_STATE_IDS)),
        FaultKind("duplicate-compress-id", "two C128 layers of a stage share one compress id",
                  layer_map=duplicate_id("c128", COMPRESS_IDS.name)),
        backup_without_indexer("indexer", "c4_indexer_state"),
    )

    def matches(self, cfg: dict[str, Any]) -> bool:
        return (super().matches(cfg) or cfg.get("model_type") == "deepseek_v4" or "compress_ratios" in cfg)

    def spec_from_config(self, cfg: dict[str, Any], name: str) -> DeepSeekV4Spec:
        f = ConfigFields(cfg, name)
        num_layers = f.positive_int("num_hidden_layers", MAX_LAYERS)
        mtp = f.int_in("num_nextn_predict_layers", 0, MAX_MTP_LAYERS, 0)
        ratios = f.nonempty_list("compress_ratios")
        if len(ratios) not in (num_layers, num_layers + 1):
            raise f.error(f"'compress_ratios' has {len(ratios)} entries; expected "
                          f"num_hidden_layers={num_layers} or {num_layers + 1} (with the MTP placeholder)")
        f.check_ints("compress_ratios", ratios, SUPPORTED_RATIOS)
        head_dim = f.positive_int("head_dim", MAX_DIM)
        rope = f.positive_int("qk_rope_head_dim", MAX_DIM)
        if rope >= head_dim:
            raise f.error(f"qk_rope_head_dim ({rope}) must be < head_dim ({head_dim})")
        return DeepSeekV4Spec(
            name=name, num_layers=num_layers, compress_ratios=tuple(ratios[:num_layers]),
            sliding_window=f.positive_int("sliding_window", MAX_SLIDING_WINDOW), head_dim=head_dim,
            qk_rope_head_dim=rope, index_head_dim=f.positive_int("index_head_dim", MAX_DIM),
            num_nextn_predict_layers=mtp,
        )

    def kind_table(self, spec: DeepSeekV4Spec, page_size: int) -> KindTable:  # type: ignore[override]
        page = check_page_size(spec, page_size)
        nope, rope, index_dim = spec.nope_head_dim, spec.qk_rope_head_dim, spec.index_head_dim
        # V4 FP8 KV row: FP8 nope, BF16 rope, one UE8M0 scale per 64 nope values, one pad byte.
        kv_row = nope + 2 * rope + nope // KV_SCALE_BLOCK + 1
        kv_align = nope + 2 * rope  # the layout's data row, the reader's TMA stride
        indexer_row = index_dim + index_dim // INDEXER_SCALE_BLOCK * FP32  # FP8 key + FP32 scales

        def kv(name: str, divisor: int) -> PoolKindSpec:
            return KvPages(KINDS[name], kv_row, page // divisor, page_align=kv_align, reserve_pages=divisor)

        def state(name: str, ratio: int, head_dim: int) -> PoolKindSpec:
            overlap = 2 if ratio == 4 else 1  # C4 compresses overlapping windows
            row = 2 * overlap * head_dim * FP32  # FP32 kv and score
            return StateRing(KINDS[name], row, STATE_RING[ratio], ring_pad=ratio)

        kinds = {
            "swa": kv("swa", 1),
            "c4": kv("c4", 4),
            "c128": kv("c128", 128),
            "c4_state": state("c4_state", 4, spec.head_dim),
            "c128_state": state("c128_state", 128, spec.head_dim),
            "indexer": KvPages(KINDS["indexer"], indexer_row, page // 4, reserve_pages=4),
            "c4_indexer_state": state("c4_indexer_state", 4, index_dim),
        }
        return KindTable(spec, page, kinds)

    def sglang_page_size(self, requested: int) -> int:
        """sglang 0.5.23 runs DeepSeek-V4 with 256-token pages whatever ``--page-size`` says."""
        return defaults.PAGE_SIZE

    def swa_floor_tokens(self, spec: DeepSeekV4Spec) -> int:  # type: ignore[override]
        return spec.sliding_window


FAMILY = DeepSeekV4()
