"""DeepSeek sparse attention (DSA): DeepSeek-V3.2, GLM-5.x -- MLA KV plus an indexer cache.

sglang 0.5.23's ``DSATokenToKVPool``: the MLA latent KV (``kv``) on every layer, by local id, and
a top-k indexer key cache (``indexer``) on the layers that compute their own top-k, numbered
among them.  A layer that *shares* the previous layer's top-k (``dsa_layer_skips_topk``'s rules,
read here the same way) writes no index keys: sglang gives it a 0-row device placeholder and no
host buffer.  sglang forces 64-token pages (``Family.sglang_page_size``); under PP a stage that
starts on a shared layer takes the previous stage's top-k (``topk_from``).  docs/families.md
lists the rules, bytes and ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field

from ...errors import ConfigError
from ..family import (
    Family,
    FaultKind,
    LayerKind,
    backup_without_indexer,
    ids_counted_globally,
    later_stages,
    sized_globally,
)
from ..layer_map import IdSpace, LayerEntry, StageLayerMap
from ..pool_kinds import LOCAL, KindTable, KvPages, PoolKind, TokenRows, token_host_pages
from ..spec import MAX_DIM, ConfigFields, ModelSpec, shown
from .mha import BF16, kv_cache_dtype
from .mla import mla_fields

#: The architectures sglang's ``is_deepseek_dsa`` lists whose models split over PP stages.
ARCHITECTURES = ("DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM",
                 "MistralLarge3ForCausalLM")
#: Layer kinds: computes its own top-k (owns an indexer buffer) / reuses the previous layer's.
INDEXER, SHARED = "indexer", "shared"
#: The page size sglang's DSA kernels need (``page_size / index_kpool``).
DSA_PAGE = 64
#: The index key's head dim sglang's pool accepts, and its FP8 scale block.
INDEX_HEAD_DIM = 128
QUANT_BLOCK = 128
FP32 = 4
MAX_PATTERN = 4096


def _is_int(value: Any) -> bool:
    return type(value) is int


def topk_rule(cfg: dict[str, Any], f: ConfigFields, num_layers: int) -> tuple[str, tuple[bool, ...]]:
    """Which rule decides (its config field) and, per layer, whether it shares the previous
    layer's top-k: sglang's ``dsa_layer_skips_topk``, with its assertions as one-line errors."""
    types = cfg.get("indexer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) > MAX_PATTERN or not all(isinstance(t, str) for t in types):
            raise f.error(f"'indexer_types' must be a list of strings ('full' / 'shared'), got {shown(types)}")
        return "indexer_types", tuple(i < len(types) and types[i] == SHARED for i in range(num_layers))
    cli = cfg.get("cli_factor", 1)
    cli = 1 if cli is None else cli
    if not _is_int(cli) or cli <= 0:
        raise f.error(f"'cli_factor' must be a positive integer, got {shown(cli)}")
    if cli > 1:
        return "cli_factor", tuple(i % cli != 0 for i in range(num_layers))
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN:
            raise f.error(f"'index_topk_pattern' must be a string of 'F'/'S', got {shown(pattern)}")
        return "index_topk_pattern", tuple(i < len(pattern) and pattern[i] == "S" for i in range(num_layers))
    freq = cfg.get("index_topk_freq", 1)
    freq = 1 if freq is None else freq
    if not _is_int(freq) or freq <= 0:
        raise f.error(f"'index_topk_freq' must be a positive integer, got {shown(freq)}")
    offset = cfg.get("index_skip_topk_offset")
    if offset is not None:
        if not _is_int(offset) or offset <= 0:
            raise f.error(f"'index_skip_topk_offset' must be a positive integer (sglang: an offset <= 0 "
                          f"makes layer 0 reuse a top-k that does not exist), got {shown(offset)}")
        return "index_topk_freq", tuple(max(i - offset + 1, 0) % freq != 0 for i in range(num_layers))
    return "index_topk_freq", tuple(max(i - 1, 0) % freq != 0 for i in range(num_layers))


@dataclass(frozen=True)
class DsaSpec(ModelSpec):
    """What the KV cache needs to know about a DSA model."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    shared_topk: tuple[bool, ...]  # per layer: reuses the previous layer's top-k
    topk_rule: str  # the config field that decided ``shared_topk``
    kv_cache_dtype: Literal["bf16", "fp8_e4m3"] = "bf16"

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(SHARED if s else INDEXER for s in self.shared_topk)

    @property
    def kv_row_bytes(self) -> int:
        """One token's latent row: BF16, or the scaled FP8 layout (FP8 latent, an FP32 scale per
        128 values, BF16 rope), as ``calculate_mla_kv_cache_dim`` sizes it."""
        if self.kv_cache_dtype == "fp8_e4m3":
            return self.kv_lora_rank + self.kv_lora_rank // QUANT_BLOCK * FP32 + self.qk_rope_head_dim * BF16
        return (self.kv_lora_rank + self.qk_rope_head_dim) * BF16

    @property
    def indexer_row_bytes(self) -> int:
        """One token's index key: FP8 values plus one FP32 scale per 128."""
        return self.index_head_dim + self.index_head_dim // QUANT_BLOCK * FP32

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_layers": self.num_layers, "kv_lora_rank": self.kv_lora_rank,
                "qk_rope_head_dim": self.qk_rope_head_dim, "index_head_dim": self.index_head_dim,
                "kv_cache_dtype": self.kv_cache_dtype, "topk_rule": self.topk_rule,
                "shared_topk_layers": [i for i, s in enumerate(self.shared_topk) if s]}


class DsaLayer(LayerEntry):
    """A DSA layer: whether it computes its top-k, its indexer id, and whose top-k it uses."""

    kind_field: ClassVar[str] = "topk"
    topk: Literal["indexer", "shared"] = Field(
        description="indexer: computes its own top-k (owns an indexer buffer); shared: reuses the previous layer's")
    indexer_id: int | None = Field(description="index among the stage's top-k computing layers; None if shared")
    topk_from: int | None = Field(
        description="global layer whose top-k this layer uses (itself, or the layer before it); None: it "
                    "gets none")

    def describe(self) -> str:
        return "its own top-k" if self.topk == INDEXER else f"the top-k of layer {self.topk_from} (shared)"

    def problem(self) -> tuple[str, str] | None:
        if self.topk == SHARED and self.topk_from is None:
            return ("indexer", f"global layer {self.global_id} reuses the previous layer's top-k (shared "
                    f"top-k) but receives none: its stage starts on it and the PP proxy does not carry layer "
                    f"{self.global_id - 1}'s top-k from the stage before (sglang #28525)")
        return None

    @classmethod
    def make(cls, local: int, global_id: int, kind: str, ids: dict[str, int | None]) -> DsaLayer:
        return cls.model_construct(local=local, global_id=global_id, topk=kind, indexer_id=ids["indexer_id"],
                                   topk_from=global_id if kind == INDEXER else global_id - 1)


#: Top-k computing layers are numbered among the stage's computing layers.
INDEXER_IDS = IdSpace("indexer_id", frozenset({INDEXER}), text="indexer id")

_KV = PoolKind("kv", "MLA KV", None, LOCAL, "full", True,
               count_message="DSA MLA KV pool must be PP-stage-local: got {got} buffers for {expected} "
                             "local layers")
_INDEXER = PoolKind("indexer", "DSA indexer", frozenset({INDEXER}), INDEXER_IDS.name, "full", True,
                    owners_text="top-k computing")


@dataclass(frozen=True)
class IndexerPages(KvPages):
    """The index-key pages: one page of ``page_size`` tokens per row of sglang's tensor, which holds
    ``(tokens + page + 1) // page`` pages (one reserved).  The host pool takes the MLA KV host
    pool's token slots (``DSAIndexerPoolHost``: its anchor's size) and, as on device, one page
    more: ``(host tokens + page + 1) // page``."""

    def host_units(self, device_units: int, ratio: float) -> int:
        return token_host_pages(device_units, self.rows_per_page, ratio) + 1


def _lose_topk(spec: ModelSpec, stage_map: StageLayerMap) -> StageLayerMap:
    """The stage's first layer, when it shares, gets no top-k (the PP proxy before #28532)."""
    first = stage_map.layers[0] if stage_map.layers else None
    if first is None or first.kind != SHARED or stage_map.start == 0:
        return stage_map
    layers = list(stage_map.layers)
    layers[0] = first.model_copy(update={"topk_from": None})
    return stage_map.with_layers(stage_map.start, stage_map.end, layers)


class DsaFamily(Family):
    name = "dsa"
    label = "DeepSeek sparse attention"
    architectures = ARCHITECTURES
    entry = DsaLayer
    layer_kinds = (LayerKind(INDEXER, "computes top-k"), LayerKind(SHARED, "shared top-k"))
    legend_title = "top-k"
    id_spaces = (INDEXER_IDS,)
    pool_kinds = (_KV, _INDEXER)
    faults = (
        FaultKind("global-dsa", "DSA MLA KV and indexer pools sized by the model's global layer counts "
                  "instead of the stage's", count=sized_globally("kv", "indexer")),
        FaultKind("global-indexer-ids", "DSA indexer ids counted over the whole model instead of inside "
                  "the stage", layer_map=ids_counted_globally(INDEXER_IDS)),
        FaultKind("shared-topk-start", "a later stage starting on a shared top-k layer gets no top-k from "
                  "the stage before (sglang #28525, GLM-5.2 pp 2)", stages=later_stages, min_pp=2,
                  layer_map=_lose_topk),
        FaultKind("indexer-not-host-cached", "HiCache's host set leaves the DSA indexer out, so a load-back "
                  "leaves the index keys stale (sglang #38031)", host_left_out=frozenset({"indexer"})),
        backup_without_indexer("indexer"),
    )

    def matches(self, cfg: dict[str, Any]) -> bool:
        """sglang's ``is_deepseek_dsa``: a listed first architecture and ``index_topk`` set."""
        return self.first_architecture_listed(cfg) and cfg.get("index_topk") is not None

    def spec_from_config(self, cfg: dict[str, Any], name: str) -> DsaSpec:
        f = ConfigFields(cfg, name)
        layers, rank, rope = mla_fields(f)
        index_dim = f.positive_int("index_head_dim", MAX_DIM)
        if index_dim != INDEX_HEAD_DIM:
            raise f.error(f"index_head_dim {index_dim} is not supported: sglang 0.5.23's DSA pool needs "
                          f"{INDEX_HEAD_DIM}")
        kpool = cfg.get("index_kpool", 1)
        if kpool not in (None, 1) or isinstance(kpool, bool):
            raise f.error(f"index_kpool {shown(kpool)} is not modelled: stagecache sizes DSA pools with "
                          "index_kpool 1")
        rule, shared = topk_rule(cfg, f, layers)
        if shared and shared[0]:
            raise f.error(f"layer 0 shares the previous layer's top-k ({rule}), but no layer comes before "
                          "it; sglang cannot serve this model")
        return DsaSpec(name=name, num_layers=layers, kv_lora_rank=rank, qk_rope_head_dim=rope,
                       index_head_dim=index_dim, shared_topk=shared, topk_rule=rule)

    def with_kv_cache_dtype(self, spec: DsaSpec, dtype: str) -> DsaSpec:  # type: ignore[override]
        """sglang's ``--kv-cache-dtype``: ``fp8_e4m3`` is the scaled FP8 layout, which needs whole
        128-value scale blocks (``auto``: BF16, sglang's default for DSA on an H100)."""
        if dtype == "fp8_e4m3" and spec.kv_lora_rank % QUANT_BLOCK:
            raise ConfigError(f"--kv-cache-dtype fp8_e4m3: {spec.name}: kv_lora_rank {spec.kv_lora_rank} must "
                              f"be a multiple of {QUANT_BLOCK} for sglang's scaled FP8 layout")
        return kv_cache_dtype(spec, dtype)

    def kind_table(self, spec: DsaSpec, page_size: int) -> KindTable:  # type: ignore[override]
        page = self.positive_page_size(page_size)
        return KindTable(spec, page, {
            "kv": TokenRows(_KV, spec.kv_row_bytes, page),
            "indexer": IndexerPages(_INDEXER, spec.indexer_row_bytes, page, reserve_pages=1),
        })

    def sglang_page_size(self, requested: int) -> int:
        """sglang's DSA kernels take 64-token pages only."""
        return DSA_PAGE


FAMILY = DsaFamily()

