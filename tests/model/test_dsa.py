"""The DSA family: which layers compute their top-k, the pools' bytes and ids, and bad configs in one line."""

from __future__ import annotations

import pytest
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.model.config_file import PRESETS, preset_config
from stagecache.runtime.model.families import family_of, load_spec, spec_from_config
from stagecache.runtime.model.families.dsa import FAMILY, INDEXER, SHARED
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.plan.plan import Sizing, build_plan

BASE = {"architectures": ["GlmMoeDsaForCausalLM"], "index_topk": 2048, "num_hidden_layers": 12,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}


def owners(spec) -> list[int]:
    return [i for i, k in enumerate(spec.layer_kinds) if k == INDEXER]


def test_presets_are_dsa_and_glm_52_computes_top_k_on_21_layers():
    assert {"deepseek-v3.2", "glm-5.2"} <= set(PRESETS)
    glm, v32 = load_spec("glm-5.2"), load_spec("deepseek-v3.2")
    assert glm.family is FAMILY and v32.family is FAMILY
    assert owners(glm)[:4] == [0, 1, 2, 6] and owners(glm)[-1] == 74 and len(owners(glm)) == 21
    assert glm.topk_rule == "index_topk_freq"
    assert owners(v32) == list(range(61))  # no index_topk_freq: every layer computes


def test_matches_like_is_deepseek_dsa():
    assert family_of(BASE, "x") is FAMILY
    # without index_topk a DeepSeek-V3 architecture is dense MLA, not DSA
    v3 = {**BASE, "architectures": ["DeepseekV3ForCausalLM"], "index_topk": None}
    assert family_of(v3, "x").name == "mla"
    # the first architecture decides, as sglang's _hf_arch
    assert family_of({**BASE, "architectures": ["LlamaForCausalLM", "GlmMoeDsaForCausalLM"],
                      "num_attention_heads": 8, "hidden_size": 1024}, "x").name == "mha"


@pytest.mark.parametrize(("rule", "want"), [
    ({"index_topk_freq": 4}, [0, 1, 5, 9]),
    ({"index_topk_freq": 4, "index_skip_topk_offset": 3}, [0, 1, 2, 6, 10]),
    ({"index_topk_pattern": "FSSF"}, [0, 3, 4, 5, 6, 7, 8, 9, 10, 11]),
    ({"cli_factor": 3, "index_topk_freq": 2}, [0, 3, 6, 9]),
    ({"indexer_types": ["full", "shared", "full"], "cli_factor": 5}, [0, 2, *range(3, 12)]),
])
def test_topk_rules_in_sglangs_order(rule, want):
    assert owners(spec_from_config({**BASE, **rule})) == want


@pytest.mark.parametrize(("field", "value", "says"), [
    ("index_topk_freq", 0, "'index_topk_freq' must be a positive integer"),
    ("index_skip_topk_offset", 0, "'index_skip_topk_offset' must be a positive integer"),
    ("cli_factor", -1, "'cli_factor' must be a positive integer"),
    ("index_topk_pattern", ["S"], "'index_topk_pattern' must be a string"),
    ("indexer_types", "full", "'indexer_types' must be a list of strings"),
    ("indexer_types", ["shared", "full"], "layer 0 shares the previous layer's top-k (indexer_types)"),
    ("index_topk_pattern", "SF", "layer 0 shares the previous layer's top-k (index_topk_pattern)"),
    ("index_head_dim", 64, "index_head_dim 64 is not supported"),
    ("index_kpool", 2, "index_kpool 2 is not modelled"),
    ("kv_lora_rank", 0, "'kv_lora_rank' must be a positive integer"),
])
def test_configs_sglang_would_reject_are_one_line(field, value, says):
    with pytest.raises(ConfigError) as err:
        spec_from_config({**BASE, field: value}, "bad.json")
    assert says in str(err.value) and "\n" not in str(err.value) and "'bad.json'" in str(err.value)


def test_rows_and_pages_bf16_fp8():
    spec = load_spec("glm-5.2")
    table = FAMILY.kind_table(spec, 64)
    assert (table["kv"].row_bytes, table["kv"].page_bytes, table["kv"].tensor_rows(10)) == (1152, 64 * 1152, 11 * 64)
    assert (table["indexer"].row_bytes, table["indexer"].page_bytes, table["indexer"].tensor_rows(10)) == (
        132, 64 * 132, 11)
    fp8 = FAMILY.with_kv_cache_dtype(spec_from_config(preset_config("deepseek-v3.2")), "fp8_e4m3")
    assert FAMILY.kind_table(fp8, 64)["kv"].row_bytes == 656
    assert FAMILY.with_kv_cache_dtype(fp8, "bfloat16").kv_row_bytes == 1152
    with pytest.raises(ConfigError, match="kv_lora_rank 500 must be a multiple of 128"):
        FAMILY.with_kv_cache_dtype(spec_from_config({**BASE, "kv_lora_rank": 500}), "fp8_e4m3")
    assert FAMILY.sglang_page_size(256) == 64


def test_layer_map_ids_and_topk_sources():
    layout = build_layout(load_spec("glm-5.2"), 2)
    s0, s1 = layout.stages
    assert s0.expected_buffers() == {"kv": 39, "indexer": 12}
    assert s1.expected_buffers() == {"kv": 39, "indexer": 9}
    first = s1.layers[0]
    assert (first.global_id, first.kind, first.indexer_id, first.topk_from) == (39, SHARED, None, 38)
    assert s1.pool_map("indexer") == {3: 0, 7: 1, 11: 2, 15: 3, 19: 4, 23: 5, 27: 6, 31: 7, 35: 8}
    assert s1.pool_map("kv") == {i: i for i in range(39)}
    assert s1.pool_index("indexer", 42) == 0
    assert [e.topk_from for e in s1.layers[3:5]] == [42, 42]  # 42 computes, 43 reuses it
    assert "the top-k of layer 42 (shared)" in s1.layers[4].describe()


def test_a_stage_of_shared_layers_only_has_no_indexer_buffers():
    plan = build_plan(load_spec("glm-5.2"), 4, partition=(3, 3, 33, 39), page_size=64,
                      sizing=Sizing.sglang(max_total_tokens=65536))
    s1 = plan.stage(1)
    assert [e.kind for e in s1.layer_map.layers] == [SHARED] * 3
    assert (s1.pool("indexer").present, s1.pool("indexer").device_bytes, s1.pool("indexer").host_bytes) == (0, 0, 0)
    # host pages: sglang's HostKVCache (int(tokens x 2) // page + 1), the indexer one page more
    assert (s1.pool("kv").host_pages, plan.stage(0).pool("indexer").host_pages) == (2049, 2050)


def test_the_config_hash_sees_the_topk_schedule():
    from stagecache.runtime.plan.fingerprint import config_hash

    a = spec_from_config({**BASE, "index_topk_freq": 4})
    b = spec_from_config({**BASE, "index_topk_freq": 2})
    assert config_hash(a) != config_hash(b)
