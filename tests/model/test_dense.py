"""Dense MLA (DeepSeek-V3) and plain MHA (Llama): one pool kind ``kv``, one buffer per local layer."""

from __future__ import annotations

import pytest
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.model.families import FAMILIES, load_spec, mha, mla, spec_from_config
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.plan.plan import Sizing, build_plan

LLAMA = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "num_attention_heads": 32,
         "hidden_size": 4096}


def test_registry_order_of_the_contract():
    names = [f.name for f in FAMILIES]
    assert names.index("deepseek_v4") < names.index("dsa") < names.index("mla") < names.index("mha")
    assert names[-1] == "mha"
    assert "Llama4ForConditionalGeneration" not in mha.FAMILY.architectures


def test_presets():
    v3, llama = load_spec("deepseek-v3"), load_spec("llama-3.1-8b")
    assert v3.family is mla.FAMILY and (v3.num_layers, v3.kv_lora_rank, v3.qk_rope_head_dim) == (61, 512, 64)
    assert llama.family is mha.FAMILY and (llama.num_layers, llama.num_kv_heads, llama.head_dim) == (32, 8, 128)
    assert mla.FAMILY.kind_table(v3, 64)["kv"].row_bytes == 1152
    assert mha.FAMILY.kind_table(llama, 64)["kv"].row_bytes == 8 * (128 + 128) * 2 == 4096


def test_mha_geometry_falls_back_like_sglang():
    spec = spec_from_config(LLAMA, "llama")
    assert (spec.num_kv_heads, spec.head_dim, spec.v_head_dim) == (32, 128, 128)
    with pytest.raises(ConfigError, match="hidden_size \\(4097\\) is not a multiple of num_attention_heads"):
        spec_from_config({**LLAMA, "hidden_size": 4097}, "llama")
    with pytest.raises(ConfigError, match="'num_key_value_heads' must be a positive integer"):
        spec_from_config({**LLAMA, "num_key_value_heads": 0}, "llama")


@pytest.mark.parametrize("model", ["deepseek-v3", "llama-3.1-8b"])
def test_one_kind_one_buffer_per_local_layer_local_ids(model):
    layout = build_layout(load_spec(model), 4)
    for s in layout.stages:
        assert s.pools == ("kv",)
        assert s.pool_map("kv") == {i: i for i in range(s.local_layers)}
        assert {e.kind for e in s.layers} == {load_spec(model).layer_kinds[0]}


def test_token_rows_tensor_and_host_like_sglang():
    plan = build_plan(load_spec("llama-3.1-8b"), 2, page_size=64, sizing=Sizing.sglang(max_total_tokens=8192))
    kv = plan.stage(1).pool("kv")
    # (size + page_size) token rows of K and V per layer; host: int(8192 x 2) // 64 + 1 pages
    assert (kv.units, kv.tensor_rows, kv.tensor_row_bytes, kv.host_pages) == (128, 8192 + 64, 4096, 257)
    assert kv.device_bytes == 16 * (8192 + 64) * 4096


def test_every_new_entry_round_trips_through_a_report():
    from stagecache.runtime.validation.deployment import preflight
    from stagecache.runtime.validation.report import StartupReport

    for model in ("deepseek-v3", "llama-3.1-8b", "glm-5.2"):
        report = preflight(build_plan(load_spec(model), 2))
        again = StartupReport.model_validate(report.to_dict())
        assert again.to_dict() == report.to_dict()
        assert type(again.stages[1].layers[0]) is type(report.stages[1].layers[0])
