"""Dense multi-head latent attention (MLA): DeepSeek-V3, Kimi-K2 -- one latent KV row per token.

Every layer keeps one compressed latent row per token in sglang 0.5.23's
``MLATokenToKVPool``: per stage layer a tensor ``(size + page_size, 1, kv_lora_rank +
qk_rope_head_dim)`` (BF16 under ``--kv-cache-dtype auto``: 1,152 B per token for 512 + 64),
indexed by the local layer id, mirrored on the host by ``MLATokenToKVPoolHost``
(``_PlainKvStrategy``, ids ``{i: i}``).  A DeepSeek-V3 architecture with ``index_topk`` set is
DeepSeek sparse attention instead (``families/dsa.py``, matched first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from ..family import LayerKind
from ..pool_kinds import LOCAL, PoolKind
from ..spec import MAX_DIM, MAX_LAYERS, ConfigFields, ModelSpec
from .mha import ELEMENT_BYTES, OneKindFamily, OneKindLayer, global_kv_fault

#: The layer kind of every dense MLA layer.
MLA = "mla"


@dataclass(frozen=True)
class MlaSpec(ModelSpec):
    """What the KV cache needs to know about a dense MLA model."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    kv_cache_dtype: Literal["bf16", "fp8_e4m3"] = "bf16"

    @property
    def row_bytes(self) -> int:
        """One token's latent row: BF16, or one byte per value in FP8 (dense MLA has no scales)."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * ELEMENT_BYTES[self.kv_cache_dtype]


class MlaLayer(OneKindLayer):
    """A dense MLA layer: one latent buffer of the ``kv`` pool, by its local id."""

    attention: Literal["mla"] = Field(MLA, description="the layer's attention: MLA, one latent row per token")


_KV = PoolKind("kv", "MLA latent KV", None, LOCAL, "full", True,
               count_message="MLA KV pool must be PP-stage-local: got {got} buffers for {expected} "
                             "local layers")


def mla_fields(f: ConfigFields) -> tuple[int, int, int]:
    """``num_hidden_layers``, ``kv_lora_rank`` and ``qk_rope_head_dim``, as sglang reads them."""
    return (f.positive_int("num_hidden_layers", MAX_LAYERS), f.positive_int("kv_lora_rank", MAX_DIM),
            f.positive_int("qk_rope_head_dim", MAX_DIM))


class MlaFamily(OneKindFamily):
    name = "mla"
    label = "MLA"
    architectures = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "KimiK2ForCausalLM")
    entry = MlaLayer
    layer_kinds = (LayerKind(MLA, "MLA latent KV"),)
    pool_kinds = (_KV,)
    faults = (global_kv_fault("mla", "MLA"),)

    def matches(self, cfg: dict[str, Any]) -> bool:
        return super().matches(cfg) and "kv_lora_rank" in cfg

    def spec_from_config(self, cfg: dict[str, Any], name: str) -> MlaSpec:
        layers, rank, rope = mla_fields(ConfigFields(cfg, name))
        return MlaSpec(name=name, num_layers=layers, kv_lora_rank=rank, qk_rope_head_dim=rope)


FAMILY = MlaFamily()
