"""DSA (DeepSeek-V3.2, GLM-5.2): ``stagecache pools --json`` and the layer maps == sglang 0.5.23's own objects.

Runs in ``.venv-sglang``.  Every figure on sglang's side is read from its objects, built on CPU
from the presets' real ``config.json`` (tests/support/sglang_families.py): ``DSATokenToKVPool``'s
tensors (the MLA KV rows, the index-key pages and the 0-row placeholders of shared top-k
layers), ``DefaultPoolConfigurator``'s token budgets, the HiCache assembler's ``_DsaStrategy``
host pools and its transfer maps, and ``dsa_layer_skips_topk`` for every top-k rule.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sglang", reason="sglang not installed (runs in .venv-sglang)")

from sglang.srt.configs.model_config import dsa_layer_skips_topk  # noqa: E402
from sglang.srt.runtime_context import get_schedule  # noqa: E402
from sglang_families import (  # noqa: E402
    build_family_stage,
    host_stack,
    layout_ids,
    model_dirs,
    on_h100,
    pools_json,
)
from sglang_real import on_cpu, partition_env, published  # noqa: E402
from stagecache.runtime.errors import ConfigError  # noqa: E402
from stagecache.runtime.model.families import spec_from_config  # noqa: E402
from stagecache.runtime.model.families.dsa import INDEXER, SHARED  # noqa: E402
from stagecache.runtime.model.layer_map import build_layout  # noqa: E402
from stagecache.runtime.model.partition import parse_partition  # noqa: E402

TOKENS = 262_144
LAYOUTS = [("glm-5.2", 1, None), ("glm-5.2", 2, None), ("glm-5.2", 4, None), ("glm-5.2", 4, (3, 3, 33, 39)),
           ("glm-5.2", 3, (4, 37, 37)), ("deepseek-v3.2", 1, None), ("deepseek-v3.2", 2, None),
           ("deepseek-v3.2", 4, None), ("deepseek-v3.2", 2, (10, 51))]
IDS = layout_ids(LAYOUTS)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return model_dirs(tmp_path_factory.mktemp("models"), "glm-5.2", "deepseek-v3.2")


def layout_of(model: str, pp: int, partition):
    from stagecache.runtime.model.families import load_spec

    return build_layout(load_spec(model), pp, partition=parse_partition(partition))


def assert_stage_matches(ours: dict, stage, layer_map) -> None:
    """Per kind: buffers, tensor rows and row bytes, page bytes, device pages and bytes; the
    placeholders at exactly the shared layers' local ids."""
    kv = stage.kvcache
    page = get_schedule().page_size
    assert (ours["start_layer"], ours["end_layer"]) == (kv.start_layer, kv.end_layer) == (stage.start, stage.end)
    assert ours["full_tokens"] == stage.config.max_total_num_tokens
    rows = {r["pool"]: r for r in ours["pools"]}
    assert set(rows) == {"kv", "indexer"}
    mla, idx = list(kv.kv_buffer), list(kv.index_k_with_scale_buffer)
    r = rows["kv"]
    assert {"buffers": len(mla), "tensor_rows": {t.shape[0] for t in mla},
            "tensor_row_bytes": {t[0].nbytes for t in mla}, "page_bytes": page * mla[0][0].nbytes,
            "device_pages": stage.allocator.size // page, "device_bytes": sum(t.nbytes for t in mla)} == {
        "buffers": r["buffers"], "tensor_rows": {r["tensor_rows"]}, "tensor_row_bytes": {r["tensor_row_bytes"]},
        "page_bytes": r["page_bytes"], "device_pages": r["device_pages"], "device_bytes": r["device_bytes"]}
    held = [t for t in idx if t.shape[0]]
    placeholders = [i for i, t in enumerate(idx) if t.shape[0] == 0]
    assert placeholders == [e.local for e in layer_map.layers if e.kind == SHARED]
    assert [i for i, t in enumerate(idx) if t.shape[0]] == [e.local for e in layer_map.layers if e.kind == INDEXER]
    assert all(t.nbytes == 0 for i, t in enumerate(idx) if i in placeholders)
    r = rows["indexer"]
    assert r["buffers"] == len(held)
    if held:
        assert {t.shape[0] for t in held} == {r["tensor_rows"]}
        assert {t[0].nbytes for t in held} == {r["tensor_row_bytes"], r["page_bytes"]}
    assert r["device_bytes"] == sum(t.nbytes for t in idx)
    assert ours["device_bytes"] == sum(t.nbytes for t in (*mla, *idx))  # the stage total, to the byte


@pytest.mark.parametrize("page", [64, 256])
@pytest.mark.parametrize(("model", "pp", "partition"), LAYOUTS, ids=IDS)
def test_pools_json_equals_sglangs_pools(capsys, models, model, pp, partition, page):
    report = pools_json(capsys, model, pp, partition, page, "--max-total-tokens", str(TOKENS))
    layout = layout_of(model, pp, partition)
    with on_h100(), partition_env(partition), \
            published(models[model], pp_size=pp, page_size=page, max_total_tokens=TOKENS) as (sa, mc):
        assert report["page_size"] == get_schedule().page_size == 64  # sglang forces 64 on DSA
        assert report["requested_page_size"] == page
        assert bool(report["notes"]) == (page != 64)
        assert len(report["stages"]) == pp
        for ours, m in zip(report["stages"], layout.stages, strict=True):
            assert_stage_matches(ours, build_family_stage(sa, mc, ours["stage"], pp), m)


@pytest.mark.parametrize(("model", "pp", "partition"), [LAYOUTS[2], LAYOUTS[3], LAYOUTS[4], LAYOUTS[7]],
                         ids=[IDS[2], IDS[3], IDS[4], IDS[7]])
def test_host_pools_and_id_spaces_are_sglangs(capsys, models, model, pp, partition):
    """The real assembler (``_DsaStrategy``) on small real CPU pools: which kinds it mirrors, their
    layers, pages and bytes, and the ids HiCache transfers and the host indexer pool use."""
    tokens = "4096"
    report = pools_json(capsys, model, pp, partition, 64, "--max-total-tokens", tokens,
                        "--max-running-requests", "4")
    layout = layout_of(model, pp, partition)
    with on_h100(), partition_env(partition), \
            published(models[model], pp_size=pp, page_size=64, max_total_tokens=int(tokens),
                      max_running_requests=4) as (sa, mc), on_cpu():
        for ours, m in zip(report["stages"], layout.stages, strict=True):
            stage = build_family_stage(sa, mc, ours["stage"], pp, device="cpu")
            assert_stage_matches(ours, stage, m)
            strategy, result = host_stack(stage)
            assert type(strategy).__name__ == "_DsaStrategy"
            entries = {str(e.name.value): e for e in result.host_pool_group.entries}
            rows = {r["pool"]: r for r in ours["pools"]}
            owners = [e for e in m.layers if e.kind == INDEXER]
            # no indexer host pool on a stage whose every layer shares its top-k
            assert set(entries) == ({"kv", "indexer"} if owners else {"kv"})
            assert ours["host_bytes"] == sum(rows[p]["host_bytes"] for p in entries)
            hkv = entries["kv"].host_pool
            assert (hkv.layer_num, hkv.page_num, hkv.kv_buffer.nbytes) == (
                rows["kv"]["buffers"], rows["kv"]["host_pages"], rows["kv"]["host_bytes"])
            bound = result.cache_controller.transfer_layer_id_max
            assert bound == m.local_layers  # every transfer id is below it
            assert [entries["kv"].layer_mapper(i) for i in range(bound)] == \
                [m.pool_map("kv")[i] for i in range(m.local_layers)]
            if owners:
                hidx = entries["indexer"].host_pool
                assert (hidx.layer_num, hidx.indexer_page_num, hidx.index_k_with_scale_buffer.nbytes) == (
                    rows["indexer"]["buffers"], rows["indexer"]["host_pages"], rows["indexer"]["host_bytes"])
                # transfers name the local layer (holes at shared layers), the host pool numbers the
                # computing layers compactly: stagecache's indexer_id
                assert [entries["indexer"].layer_mapper(i) for i in range(bound)] == \
                    [e.local if e.kind == INDEXER else None for e in m.layers]
                assert hidx._device_to_host_layer == {e.local: e.indexer_id for e in owners}
            # device reads wait on layer_id - start_layer: the local id, for every layer
            assert stage.kvcache.start_layer == m.start


def test_mem_budget_gives_sglangs_tokens_each_stage_and_the_minimum(capsys, models):
    budget_gb = 3
    report = pools_json(capsys, "glm-5.2", 4, (3, 3, 33, 39), 64, "--mem-budget-gb", str(budget_gb))
    with on_h100(), partition_env((3, 3, 33, 39)), published(models["glm-5.2"], pp_size=4, page_size=64) as (sa, mc):
        alone = [build_family_stage(sa, mc, r, 4, budget_bytes=budget_gb << 30).config.max_total_num_tokens
                 for r in range(4)]
    assert [s["capacity"]["tokens_alone"] for s in report["stages"]] == alone
    # sglang all-reduces the token capacity with MIN across PP ranks
    assert {s["full_tokens"] for s in report["stages"]} == {min(alone)}
    assert len(set(alone)) > 1  # the ranks do differ (21 vs 0 indexer layers)


def test_fp8_rows_are_sglangs_scaled_layout(capsys, models):
    """``--kv-cache-dtype fp8_e4m3`` sizes sglang's scaled FP8 layout (656 B per token)."""
    report = pools_json(capsys, "deepseek-v3.2", 2, None, 64, "--kv-cache-dtype", "fp8_e4m3",
                        "--max-total-tokens", str(TOKENS))
    layout = layout_of("deepseek-v3.2", 2, None)
    with on_h100(), published(models["deepseek-v3.2"], pp_size=2, page_size=64, max_total_tokens=TOKENS,
                              kv_cache_dtype="fp8_e4m3") as (sa, mc):
        for ours, m in zip(report["stages"], layout.stages, strict=True):
            stage = build_family_stage(sa, mc, ours["stage"], 2)
            assert stage.kvcache.kv_buffer[0][0].nbytes == 656
            assert_stage_matches(ours, stage, m)


#: Every rule of ``dsa_layer_skips_topk`` (and the order they are tried in).
RULES = [
    {},
    {"index_topk_freq": 1},
    {"index_topk_freq": 4},
    {"index_topk_freq": 4, "index_skip_topk_offset": 3},
    {"index_topk_freq": 3, "index_skip_topk_offset": 1},
    {"index_topk_freq": None},
    {"index_topk_pattern": "FFSFSS"},
    {"index_topk_pattern": "FSFS" * 8, "index_topk_freq": 4},
    {"cli_factor": 2},
    {"cli_factor": 3, "index_topk_pattern": "FFFFFF"},
    {"cli_factor": 1, "index_topk_freq": 2},
    {"indexer_types": ["full", "shared", "shared", "full"] * 4},
    {"indexer_types": ["full", "full", "shared"], "cli_factor": 2, "index_topk_freq": 4},
]


@pytest.mark.parametrize("rule", RULES, ids=[json.dumps(r) for r in RULES])
def test_topk_rules_are_sglangs(rule):
    from types import SimpleNamespace

    layers = 24
    cfg = {"architectures": ["GlmMoeDsaForCausalLM"], "index_topk": 2048, "num_hidden_layers": layers,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128, **rule}
    spec = spec_from_config(cfg, "rule")
    theirs = SimpleNamespace(**cfg)
    assert spec.shared_topk == tuple(dsa_layer_skips_topk(theirs, i) for i in range(layers))


def test_offset_sglang_asserts_is_refused_in_one_line():
    from types import SimpleNamespace

    cfg = {"architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048, "num_hidden_layers": 8,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128, "index_topk_freq": 2,
           "index_skip_topk_offset": 0}
    with pytest.raises(AssertionError):
        dsa_layer_skips_topk(SimpleNamespace(**cfg), 1)
    with pytest.raises(ConfigError, match="index_skip_topk_offset"):
        spec_from_config(cfg, "bad")
