"""SWA hybrids: sliding-window and full-attention layers in two sub-pools (sglang's ``SWAKVPool``).

gpt-oss, Gemma 4, MiMo-V2 and Step-3.5 mix sliding-window and full-attention layers; sglang
0.5.23 gives such a stage one ``SWAKVPool`` of two MHA sub-pools (``full`` by the full-token
budget, ``swa`` by ``--swa-full-tokens-ratio`` of it), one buffer (K and V) per layer of its
kind, which layer is which following ``get_hybrid_layer_ids``.  Where sglang turns hybrid memory
off (Step-3.5 under HiCache, Gemma 2/3) it is one plain MHA pool (``kv``).  ``SWAKVPool`` has
``start_layer = 0``, so a hybrid stage's transfer and wait ids are *global* (holes below the
stage).  docs/families.md lists the architectures, shapes and ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from ...errors import ConfigError
from ..family import Family, FaultKind, LayerKind, StageBudget, later_stages, sized_globally
from ..layer_map import IdSpace, LayerEntry, StageLayerMap
from ..pool_kinds import KindTable, PoolKind, TokenRows
from ..spec import (
    MAX_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_SLIDING_WINDOW,
    ConfigFields,
    ModelSpec,
)

if TYPE_CHECKING:
    from ...plan.plan import Sizing

#: Bytes of one KV element (bf16, sglang's default KV dtype for these models).
BF16 = 2
#: sglang 0.5.23's default ``--swa-full-tokens-ratio`` (``arg_groups/fields/schedule.py``).
SWA_FULL_TOKENS_RATIO = 0.8

GPT_OSS = ("GptOssForCausalLM",)
GEMMA4 = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
MIMO_V2 = ("MiMoV2ForCausalLM", "MiMoV2FlashForCausalLM")
STEP3P5 = ("Step3p5ForCausalLM",)
GEMMA23 = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
LLAMA4 = ("Llama4ForConditionalGeneration",)

LayerKindName = Literal["swa", "full", "kv"]
LAYER_TYPES = {"sliding_attention": "swa", "full_attention": "full"}


@dataclass(frozen=True)
class KvShape:
    """One sub-pool's token row: KV heads, K and V head dims (per TP rank 1)."""

    heads: int
    head_dim: int
    v_head_dim: int

    @property
    def token_bytes(self) -> int:
        return self.heads * (self.head_dim + self.v_head_dim) * BF16

    def to_dict(self) -> dict[str, int]:
        return {"kv_heads": self.heads, "head_dim": self.head_dim, "v_head_dim": self.v_head_dim}


@dataclass(frozen=True)
class SwaHybridSpec(ModelSpec):
    """What the KV cache needs to know about an SWA-hybrid (or plain-MHA) model of this family."""

    architecture: str
    kinds: tuple[str, ...]  # per layer: swa, full, or kv (one plain MHA pool)
    sliding_window: int
    full: KvShape
    swa: KvShape
    plain_reason: str = ""  # why sglang gives every layer one plain MHA pool ("" for a hybrid)
    no_pp: str = ""  # why sglang does not split it over PP ("" where it does)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return self.kinds

    @property
    def pp_refused(self) -> str | None:
        return self.no_pp or None

    def tp_refused(self, tp_size: int) -> str | None:
        return ("SWA hybrids are modelled at one TP rank (sglang splits their KV heads over TP ranks); "
                "use --tp-size 1")

    @property
    def hybrid(self) -> bool:
        return not self.plain_reason

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "num_layers": self.num_layers, "architecture": self.architecture,
                "layer_kinds": list(self.kinds), "sliding_window": self.sliding_window,
                "full": self.full.to_dict(), "swa": self.swa.to_dict(), "plain_reason": self.plain_reason}


class SwaHybridLayer(LayerEntry):
    """A layer of an SWA hybrid: its kind, its sub-pool index and its HiCache transfer ids."""

    kind_field: ClassVar[str] = "layer_kind"
    layer_kind: LayerKindName = Field(description="swa (sliding window), full, or kv (one plain MHA pool)")
    sub_pool_id: int | None = Field(description="index among the stage's layers of its kind: what the "
                                    "device pool reads (sglang's layers_mapping)")
    transfer_id: int | None = Field(description="id HiCache signals the layer's transfer with")
    wait_id: int | None = Field(description="id the pool waits on before reading the layer")

    def describe(self) -> str:
        return KIND_TEXT[self.layer_kind]

    def transfer_ids(self) -> tuple[int | None, int | None]:
        return self.transfer_id, self.wait_id

    @classmethod
    def make(cls, local: int, global_id: int, kind: str, ids: dict[str, int | None]) -> SwaHybridLayer:
        # SWAKVPool: start_layer 0 and HiCache maps global ids; a plain MHA pool: local ids.
        transfer = local if kind == "kv" else global_id
        return cls.model_construct(local=local, global_id=global_id, layer_kind=kind,
                                   sub_pool_id=ids["sub_pool_id"], transfer_id=transfer, wait_id=transfer)


KIND_TEXT = {"swa": "sliding window", "full": "full attention", "kv": "plain MHA"}
#: Each sub-pool numbers the stage's layers of its kind from 0 (``SWAKVPool.layers_mapping``).
SUB_POOL_IDS = IdSpace("sub_pool_id", frozenset({"swa", "full", "kv"}), per_kind=True, text="sub-pool id")

_POOL_KINDS = (
    PoolKind("swa", "SWA KV", frozenset({"swa"}), SUB_POOL_IDS.name, "swa", True,
             count_message="SWA sub-pool must hold one buffer per local sliding-window layer: got {got} "
                           "buffers for {expected} local sliding-window layers", name_layers=True),
    PoolKind("full", "full KV", frozenset({"full"}), SUB_POOL_IDS.name, "full", True,
             count_message="full sub-pool must hold one buffer per local full-attention layer: got {got} "
                           "buffers for {expected} local full-attention layers", name_layers=True),
    PoolKind("kv", "KV", frozenset({"kv"}), SUB_POOL_IDS.name, "full", True,
             count_message="MHA pool must be PP-stage-local: got {got} buffers for {expected} local "
                           "layers", name_layers=True),
)
KINDS: dict[str, PoolKind] = {k.name: k for k in _POOL_KINDS}


# -- faults ------------------------------------------------------------------------------------------


def _empty_swa_list(spec: ModelSpec, stage_map: StageLayerMap, kind: PoolKind, count: int) -> int:
    """The stage's sliding-layer list comes out empty: no SWA buffer although it owns SWA layers."""
    return 0 if kind.name == "swa" else count


def _stage_local_transfer_ids(spec: ModelSpec, stage_map: StageLayerMap) -> StageLayerMap:
    """HiCache's transfer ids rebased to the stage (sglang PR #39699) while ``SWAKVPool`` still
    waits on global ids (``start_layer`` 0): the two id spaces of #38866."""
    layers = [e.model_copy(update={"transfer_id": e.global_id - stage_map.start})
              if isinstance(e, SwaHybridLayer) and e.layer_kind != "kv" else e for e in stage_map.layers]
    return stage_map.with_layers(stage_map.start, stage_map.end, layers)


# -- reading config.json ----------------------------------------------------------------------------


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language-model part (``text_config``), as sglang reads it."""
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, dict) else cfg


def _layer_types(f: ConfigFields, key: str, n: int, *, cut: bool = False) -> list[str]:
    """``layer_types`` as layer kinds: exactly ``n`` entries (``cut``: at least ``n``, the rest
    dropped, as sglang does for Step-3.5's MTP entries)."""
    types = f.nonempty_list(key)
    if len(types) < n or (len(types) != n and not cut):
        raise f.error(f"'{key}' has {len(types)} entries; expected num_hidden_layers={n}"
                      + (" or more" if cut else ""))
    return f.kinds(key, types[:n], LAYER_TYPES)


def _kv_heads(f: ConfigFields) -> int:
    """sglang's ``get_total_num_kv_heads``: the first of its attributes present."""
    for key in ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num",
                "num_attention_groups"):
        if f.cfg.get(key) is not None:
            return f.positive_int(key, MAX_HEADS)
    return f.positive_int("num_attention_heads", MAX_HEADS)


def _head_dim(f: ConfigFields) -> int:
    if f.cfg.get("head_dim") is not None:
        return f.positive_int("head_dim", MAX_DIM)
    hidden = f.positive_int("hidden_size", MAX_DIM * MAX_HEADS)
    heads = f.positive_int("num_attention_heads", MAX_HEADS)
    return hidden // heads


def _sliding_window(f: ConfigFields) -> int:
    for key in ("sliding_window_size", "sliding_window", "window_size"):
        if f.cfg.get(key) is not None:
            return f.positive_int(key, MAX_SLIDING_WINDOW)
    raise f.error("missing required field 'sliding_window'")


class SwaHybrid(Family):
    name = "swa_hybrid"
    label = "SWA hybrid"
    architectures = (*GPT_OSS, *GEMMA4, *MIMO_V2, *STEP3P5, *GEMMA23, *LLAMA4)
    entry = SwaHybridLayer
    layer_kinds = (LayerKind("swa", "sliding window"), LayerKind("full", "full attention"),
                   LayerKind("kv", "plain MHA"))
    id_spaces = (SUB_POOL_IDS,)
    pool_kinds = _POOL_KINDS
    swa_full_tokens_ratio = SWA_FULL_TOKENS_RATIO
    host_size_reason = "a host size in bytes is not modelled for SWA hybrids (sglang splits it by device bytes)"
    faults = (
        FaultKind("global-swa-subpool", "SWA sub-pool sized by the model's global sliding-window layer "
                  "count", count=sized_globally("swa")),
        FaultKind("global-full-subpool", "full sub-pool sized by the model's global full-attention "
                  "layer count", count=sized_globally("full")),
        FaultKind("no-swa-layer", "the stage's sliding-window layer list comes out empty while it owns "
                  "sliding-window layers (an SWA-hybrid stage built without an SWA layer)",
                  count=_empty_swa_list),
        FaultKind("stage-local-transfer-ids", "HiCache transfer ids rebased to the stage while the pool "
                  "waits on global ids (sglang #38866 / #39699)", stages=later_stages, min_pp=2,
                  layer_map=_stage_local_transfer_ids),
    )

    def spec_from_config(self, cfg: dict[str, Any], name: str) -> SwaHybridSpec:
        arch = next(a for a in cfg.get("architectures") or () if a in self.architectures)
        f = ConfigFields(_text_config(cfg) if arch in GEMMA4 or arch in GEMMA23 else cfg, name)
        n = f.positive_int("num_hidden_layers", MAX_LAYERS)
        heads, head_dim = _kv_heads(f), _head_dim(f)
        v_head_dim = f.positive_int("v_head_dim", MAX_DIM, head_dim)
        window = _sliding_window(f)
        plain, no_pp = "", ""
        if arch in GPT_OSS:
            kinds = _layer_types(f, "layer_types", n)
        elif arch in MIMO_V2:
            pattern = f.nonempty_list("hybrid_layer_pattern")
            if len(pattern) < n:
                raise f.error(f"'hybrid_layer_pattern' has {len(pattern)} entries; expected "
                              f"num_hidden_layers={n}")
            f.check_ints("hybrid_layer_pattern", pattern[:n], (0, 1))
            kinds = ["swa" if p == 1 else "full" for p in pattern[:n]]
        elif arch in GEMMA4:
            if f.cfg.get("layer_types") is None:  # transformers' default: every 6th layer full
                kinds = ["swa" if (i + 1) % 6 else "full" for i in range(n)]
            else:
                kinds = _layer_types(f, "layer_types", n)
            kinds[-1] = "full"  # transformers forces the last Gemma 4 layer to full attention
        elif arch in STEP3P5:
            _layer_types(f, "layer_types", n, cut=True)  # validated; HiCache turns the split off
            kinds = ["kv"] * n
            plain = ("sglang 0.5.23 turns hybrid SWA memory off for Step-3.5 with HiCache "
                     "(--swa-full-tokens-ratio 1.0, one MHA pool)")
        elif arch in GEMMA23:
            kinds = ["kv"] * n
            plain = "sglang 0.5.23 disables hybrid SWA memory for Gemma 2/3 (one MHA pool)"
            no_pp = f"sglang 0.5.23 does not split {arch} over PP stages; run it with --pp-size 1"
        else:  # Llama-4: every 4th layer full, but every rank builds every layer
            kinds = ["swa" if (i + 1) % 4 else "full" for i in range(n)]
            no_pp = ("sglang 0.5.23 does not split Llama-4 over PP stages (models/llama4.py builds every "
                     "layer on every rank); run it with --pp-size 1")
        full = KvShape(heads, head_dim, v_head_dim)
        swa = full
        if arch in GEMMA4:
            full_dim = f.positive_int("global_head_dim", MAX_DIM, 512)
            k_eq_v = f.cfg.get("attention_k_eq_v") is True
            full_heads = (f.positive_int("num_global_key_value_heads", MAX_HEADS)
                          if k_eq_v and f.cfg.get("num_global_key_value_heads") is not None else heads)
            swa = KvShape(heads, head_dim, head_dim)
            full = KvShape(full_heads, full_dim, full_dim)
        elif arch in MIMO_V2:
            swa_dim = f.positive_int("swa_head_dim", MAX_DIM, head_dim)
            swa = KvShape(f.positive_int("swa_num_key_value_heads", MAX_HEADS, heads), swa_dim,
                          f.positive_int("swa_v_head_dim", MAX_DIM, swa_dim))
        if not plain and "swa" not in kinds:
            raise f.error("no sliding-window layer: sglang 0.5.23 asserts 'Hybrid SWA model must have at "
                          "least one SWA layer'")
        return SwaHybridSpec(name=name, num_layers=n, architecture=arch, kinds=tuple(kinds),
                             sliding_window=window, full=full, swa=swa, plain_reason=plain, no_pp=no_pp)

    def kind_table(self, spec: SwaHybridSpec, page_size: int) -> KindTable:  # type: ignore[override]
        page_size = self.positive_page_size(page_size)
        kinds = {
            "swa": TokenRows(KINDS["swa"], spec.swa.token_bytes, page_size),
            "full": TokenRows(KINDS["full"], spec.full.token_bytes, page_size),
            "kv": TokenRows(KINDS["kv"], spec.full.token_bytes, page_size),
        }
        return KindTable(spec, page_size, kinds)

    def swa_floor_tokens(self, spec: SwaHybridSpec) -> int:  # type: ignore[override]
        """The window sglang's admission floor uses: gpt-oss and Gemma 4 models say
        ``sliding_window - 1`` (their ``get_attention_sliding_window_size``), the others the
        config's value."""
        if not spec.hybrid:
            return 0
        return spec.sliding_window - 1 if spec.architecture in (*GPT_OSS, *GEMMA4) else spec.sliding_window

    def stage_problems(self, stage_map: StageLayerMap, page_size: int = 1) -> list[str]:
        kinds = {e.kind for e in stage_map.layers}
        if "kv" in kinds or not kinds:
            return []
        if "swa" not in kinds:
            return [f"no sliding-window layer in [{stage_map.start}, {stage_map.end}): sglang 0.5.23 "
                    "asserts 'Hybrid SWA model must have at least one SWA layer' "
                    "(HybridSWAPoolConfigurator)"]
        if "full" not in kinds and page_size > 1:
            return [f"only sliding-window layers in [{stage_map.start}, {stage_map.end}): sglang 0.5.23's "
                    f"PureSWATokenToKVPoolAllocator asserts page_size == 1 (got {page_size})"]
        return []

    def stage_budget(self, table: KindTable, counts: Mapping[str, int], budget_bytes: int,
                     sizing: Sizing) -> StageBudget | None:
        """``HybridSWAPoolConfigurator.calculate_pool_sizes``: ``int(bytes // cell)`` tokens, the
        cell being a full token of every full layer plus ``ratio`` x an SWA token of every SWA
        layer -- or, for a stage of SWA layers only, an SWA token of each, no ratio."""
        page = table.page_size
        n_full, n_swa, n_kv = counts.get("full", 0), counts.get("swa", 0), counts.get("kv", 0)
        full_row = table["full"].row_bytes
        swa_row = table["swa"].row_bytes
        if n_kv or n_full:
            ratio = sizing.swa_ratio if sizing.swa_ratio is not None else self.swa_full_tokens_ratio
            cell = full_row * (n_full + n_kv) + (ratio * (swa_row * n_swa) if n_swa else 0)
        else:
            cell = swa_row * n_swa
        tokens = int(budget_bytes // cell) // page * page if cell else 0
        if tokens <= 0:
            raise ConfigError(f"memory budget {budget_bytes} B holds no page: a token costs {cell:.0f} B "
                              f"over the stage's layers")
        return StageBudget({"full": tokens // page})

    def stage_units(self, counts: Mapping[str, int], full_tokens: int, page_size: int) -> Mapping[str, int] | None:
        """A stage of SWA layers only has no full sub-pool: sglang sizes its SWA sub-pool by the
        whole token count, no ratio (``_solve_pool_sizes``)."""
        if counts.get("swa", 0) and not counts.get("full", 0) and not counts.get("kv", 0):
            return {"full": 0, "swa": full_tokens // page_size}
        return None

    def sglang_page_size(self, requested: int) -> int:
        return requested


FAMILY = SwaHybrid()
