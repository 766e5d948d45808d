"""Dense MLA (DeepSeek-V3) and plain MHA (Llama-3.1-8B): ``stagecache pools --json`` == sglang 0.5.23.

Runs in ``.venv-sglang``.  sglang's ``MLATokenToKVPool`` / ``MHATokenToKVPool`` are built on CPU
from the presets' real ``config.json`` by its ``KVCacheConfigurator`` and
``DefaultPoolConfigurator`` (tests/support/sglang_families.py); the host pools and transfer maps
come from the HiCache assembler's ``_PlainKvStrategy``.  One stagecache ``kv`` buffer is one
layer's latent row (MLA) or its K and V tensors together (MHA).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sglang", reason="sglang not installed (runs in .venv-sglang)")

from sglang.srt.runtime_context import get_schedule  # noqa: E402
from sglang_families import build_family_stage, host_stack, layout_ids, model_dirs, pools_json  # noqa: E402
from sglang_real import on_cpu, partition_env, published  # noqa: E402

TOKENS = 262_144
LAYOUTS = [("deepseek-v3", 1, None), ("deepseek-v3", 2, None), ("deepseek-v3", 4, None),
           ("deepseek-v3", 3, (10, 25, 26)), ("llama-3.1-8b", 1, None), ("llama-3.1-8b", 2, None),
           ("llama-3.1-8b", 4, None), ("llama-3.1-8b", 3, (5, 13, 14))]
IDS = layout_ids(LAYOUTS)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return model_dirs(tmp_path_factory.mktemp("models"), "deepseek-v3", "llama-3.1-8b")


def layer_tensors(kv) -> list[list]:
    """Per stage layer, the tensors sglang holds for it: the latent buffer, or K and V."""
    if hasattr(kv, "k_buffer"):
        return [[k, v] for k, v in zip(kv.k_buffer, kv.v_buffer, strict=True)]
    return [[t] for t in kv.kv_buffer]


def assert_stage_matches(ours: dict, stage) -> None:
    kv, page = stage.kvcache, get_schedule().page_size
    assert (ours["start_layer"], ours["end_layer"]) == (kv.start_layer, kv.end_layer) == (stage.start, stage.end)
    assert ours["full_tokens"] == stage.config.max_total_num_tokens
    (r,) = ours["pools"]
    layers = layer_tensors(kv)
    assert {"pool": "kv", "buffers": len(layers), "tensor_rows": {t.shape[0] for ts in layers for t in ts},
            "tensor_row_bytes": {sum(t[0].nbytes for t in ts) for ts in layers},
            "page_bytes": {page * sum(t[0].nbytes for t in ts) for ts in layers},
            "device_pages": stage.allocator.size // page,
            "device_bytes": sum(t.nbytes for ts in layers for t in ts)} == {
        "pool": r["pool"], "buffers": r["buffers"], "tensor_rows": {r["tensor_rows"]},
        "tensor_row_bytes": {r["tensor_row_bytes"]}, "page_bytes": {r["page_bytes"]},
        "device_pages": r["device_pages"], "device_bytes": r["device_bytes"]}
    assert ours["device_bytes"] == r["device_bytes"]


@pytest.mark.parametrize("page", [64, 256])
@pytest.mark.parametrize(("model", "pp", "partition"), LAYOUTS, ids=IDS)
def test_pools_json_equals_sglangs_pools(capsys, models, model, pp, partition, page):
    report = pools_json(capsys, model, pp, partition, page, "--max-total-tokens", str(TOKENS))
    with partition_env(partition), \
            published(models[model], pp_size=pp, page_size=page, max_total_tokens=TOKENS) as (sa, mc):
        assert report["page_size"] == get_schedule().page_size == page and not report["notes"]
        assert len(report["stages"]) == pp
        for ours in report["stages"]:
            assert_stage_matches(ours, build_family_stage(sa, mc, ours["stage"], pp))


@pytest.mark.parametrize(("model", "pp", "partition"), [LAYOUTS[3], LAYOUTS[7]], ids=[IDS[3], IDS[7]])
def test_host_pools_and_ids_are_sglangs(capsys, models, model, pp, partition):
    """``_PlainKvStrategy`` on small real CPU pools: one host KV pool of the stage's layers, its
    pages and bytes, transfer ids ``{i: i}`` bounded by the stage's layer count."""
    report = pools_json(capsys, model, pp, partition, 64, "--max-total-tokens", "2048",
                        "--max-running-requests", "4")
    with partition_env(partition), published(models[model], pp_size=pp, page_size=64, max_total_tokens=2048,
                                             max_running_requests=4) as (sa, mc), on_cpu():
        for ours in report["stages"]:
            stage = build_family_stage(sa, mc, ours["stage"], pp, device="cpu")
            assert_stage_matches(ours, stage)
            strategy, result = host_stack(stage)
            assert type(strategy).__name__ == "_PlainKvStrategy"
            (entry,) = result.host_pool_group.entries
            (r,) = ours["pools"]
            hp = entry.host_pool
            assert (hp.layer_num, hp.page_num, hp.kv_buffer.nbytes) == (r["buffers"], r["host_pages"], r["host_bytes"])
            assert ours["host_bytes"] == hp.kv_buffer.nbytes
            bound = result.cache_controller.transfer_layer_id_max
            layers = ours["end_layer"] - ours["start_layer"]
            assert bound == layers
            assert [entry.layer_mapper(i) for i in range(bound)] == list(range(layers))


@pytest.mark.parametrize(("model", "row"), [("deepseek-v3", 576), ("llama-3.1-8b", 2048)])
def test_fp8_rows_are_sglangs(capsys, models, model, row):
    """``--kv-cache-dtype fp8_e4m3``: one byte per value, as sglang stores it (no scales here)."""
    report = pools_json(capsys, model, 2, None, 64, "--kv-cache-dtype", "fp8_e4m3", "--max-total-tokens",
                        str(TOKENS))
    with published(models[model], pp_size=2, page_size=64, max_total_tokens=TOKENS,
                   kv_cache_dtype="fp8_e4m3") as (sa, mc):
        for ours in report["stages"]:
            stage = build_family_stage(sa, mc, ours["stage"], 2)
            assert {sum(t[0].nbytes for t in ts) for ts in layer_tensors(stage.kvcache)} == {row}
            assert_stage_matches(ours, stage)


def test_mem_budget_gives_sglangs_tokens_each_stage_and_the_minimum(capsys, models):
    budget = 2
    report = pools_json(capsys, "llama-3.1-8b", 3, (5, 13, 14), 64, "--mem-budget-gb", str(budget))
    with partition_env((5, 13, 14)), published(models["llama-3.1-8b"], pp_size=3, page_size=64) as (sa, mc):
        alone = [build_family_stage(sa, mc, r, 3, budget_bytes=budget << 30).config.max_total_num_tokens
                 for r in range(3)]
    assert [s["capacity"]["tokens_alone"] for s in report["stages"]] == alone
    assert {s["full_tokens"] for s in report["stages"]} == {min(alone)}
    assert len(set(alone)) > 1


def test_mha_geometry_falls_back_like_sglang(models, tmp_path):
    """No ``head_dim`` and no ``num_key_value_heads``: sglang's ``hidden_size // heads`` and MHA."""
    from stagecache.runtime.model.families import load_spec

    cfg = json.loads((models["llama-3.1-8b"] / "config.json").read_text())
    for key in ("num_key_value_heads", "head_dim"):
        cfg.pop(key, None)
    folder = tmp_path / "llama-mha"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    spec = load_spec(str(folder / "config.json"))
    with published(folder, pp_size=2, page_size=64, max_total_tokens=8192) as (sa, mc):
        stage = build_family_stage(sa, mc, 1, 2)
        k = stage.kvcache.k_buffer[0]
        assert (spec.num_kv_heads, spec.head_dim) == (k.shape[1], k.shape[2]) == (32, 128)
