"""Plain multi-head (or grouped-query) attention: Llama, Qwen3, Mistral -- the one-kind case.

Every layer keeps K and V for every token in sglang 0.5.23's ``MHATokenToKVPool``: per stage
layer a K tensor ``(size + page_size, kv_heads, head_dim)`` and a V tensor ``(..., v_head_dim)``
(BF16, the model's dtype under ``--kv-cache-dtype auto``; one byte per value under ``fp8_e4m3``), indexed by the local layer id
(``layer_id - start_layer``).  One stagecache buffer is one layer's K and V together, as
sglang's HiCache host pool (``MHATokenToKVPoolHost``, built by ``_PlainKvStrategy``) mirrors
them: a row is ``kv_heads x (head_dim + v_head_dim) x 2`` bytes per token.

sglang derives the geometry as ``ModelConfig`` does: ``head_dim`` falls back to
``hidden_size // num_attention_heads``, the KV heads to the attention heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from pydantic import Field

from ..family import Family, FaultKind, LayerKind, sized_globally
from ..layer_map import LayerEntry
from ..pool_kinds import LOCAL, KindTable, PoolKind, TokenRows
from ..spec import MAX_DIM, MAX_HEADS, MAX_LAYERS, ConfigFields, ModelSpec

#: Bytes of one KV element: BF16, the dtype of every preset (``--kv-cache-dtype auto``).
BF16 = 2
#: The layer kind of every MHA layer.
MHA = "mha"


#: Bytes of one element of each KV cache dtype.
ELEMENT_BYTES = {"bf16": 2, "fp8_e4m3": 1}


def kv_cache_dtype(spec: Any, dtype: str) -> Any:
    """``spec`` with sglang's ``--kv-cache-dtype`` (``auto``: BF16, the presets' dtype)."""
    if dtype == "auto":
        return spec
    return replace(spec, kv_cache_dtype="bf16" if dtype in ("bf16", "bfloat16") else dtype)


@dataclass(frozen=True)
class MhaSpec(ModelSpec):
    """What the KV cache needs to know about a plain-attention model."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    kv_cache_dtype: Literal["bf16", "fp8_e4m3"] = "bf16"

    def tp_refused(self, tp_size: int) -> str | None:
        return (f"sglang splits MHA's {self.num_kv_heads} KV heads over the TP ranks; stagecache sizes "
                "MHA pools at --tp-size 1 only")

    @property
    def row_bytes(self) -> int:
        """One token of one layer: K and V of every KV head."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * ELEMENT_BYTES[self.kv_cache_dtype]

class OneKindLayer(LayerEntry):
    """A layer of a one-kind family (MHA, dense MLA): one buffer of the ``kv`` pool, by its local
    id.  Each family narrows ``attention`` to a ``Literal`` of its kind, so a record's entries
    parse back into their own family."""

    kind_field: ClassVar[str] = "attention"
    attention: str

    def describe(self) -> str:
        return f"{self.attention.upper()} attention"

    @classmethod
    def make(cls, local: int, global_id: int, kind: str, ids: dict[str, int | None]) -> OneKindLayer:
        return cls.model_construct(local=local, global_id=global_id, attention=kind)


class MhaLayer(OneKindLayer):
    """An MHA layer: one buffer (K and V) of the ``kv`` pool, by its local id."""

    attention: Literal["mha"] = Field(MHA, description="the layer's attention: MHA, K and V per token")


_KV = PoolKind("kv", "MHA KV", None, LOCAL, "full", True,
               count_message="MHA KV pool must be PP-stage-local: got {got} buffers (K and V) for "
                             "{expected} local layers")


def global_kv_fault(family: str, label: str) -> FaultKind:
    """A one-kind family's PP bug: its ``kv`` pool sized by the whole model's layers."""
    return FaultKind(f"global-{family}", f"{label} KV pool sized by the model's global layer count "
                     "instead of the stage's", count=sized_globally("kv"))


class OneKindFamily(Family):
    """MHA and dense MLA: one ``kv`` pool of one token row per layer (``spec.row_bytes``) by the
    local id, any page size, BF16 or FP8; sglang tells them by the config's first architecture."""

    def matches(self, cfg: dict[str, Any]) -> bool:
        return self.first_architecture_listed(cfg)

    def with_kv_cache_dtype(self, spec: ModelSpec, dtype: str) -> ModelSpec:
        return kv_cache_dtype(spec, dtype)

    def kind_table(self, spec: ModelSpec, page_size: int) -> KindTable:
        page = self.positive_page_size(page_size)
        row = spec.row_bytes  # type: ignore[attr-defined]
        return KindTable(spec, page, {"kv": TokenRows(self.pool_kinds[0], row, page)})


class MhaFamily(OneKindFamily):
    name = "mha"
    label = "MHA"
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                     "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
    entry = MhaLayer
    layer_kinds = (LayerKind(MHA, "MHA K and V"),)
    pool_kinds = (_KV,)
    faults = (global_kv_fault("mha", "MHA"),)

    def spec_from_config(self, cfg: dict[str, Any], name: str) -> MhaSpec:
        f = ConfigFields(cfg, name)
        layers = f.positive_int("num_hidden_layers", MAX_LAYERS)
        heads = f.positive_int("num_attention_heads", MAX_HEADS)
        kv_heads = f.positive_int("num_key_value_heads", MAX_HEADS, default=heads)
        if cfg.get("head_dim") is None:  # sglang: hidden_size // num_attention_heads
            hidden = f.positive_int("hidden_size", MAX_DIM * MAX_HEADS)
            if hidden % heads:
                raise f.error(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) "
                              "and no head_dim is given")
            head_dim = hidden // heads
        else:
            head_dim = f.positive_int("head_dim", MAX_DIM)
        return MhaSpec(name=name, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                       v_head_dim=head_dim)


FAMILY = MhaFamily()
