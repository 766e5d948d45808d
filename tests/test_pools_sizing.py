"""Byte accounting: geometry of every pool kind, and real pools equal the accounting."""

from __future__ import annotations

import json

import pytest
from stagecache.runtime.cli.main import main
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.memory.pools import StagePools
from stagecache.runtime.memory.sizing import (
    PoolGeometry,
    host_pages_for,
    pages_for_budget,
    pages_for_tokens,
    pool_geometry,
    stage_pool_bytes,
    stage_token_page_bytes,
)
from stagecache.runtime.model.layer_map import POOLS, build_layout
from stagecache.runtime.model.spec import load_spec
from stagecache.runtime.validation.faults import buffer_plan, parse_faults

FLASH = load_spec("deepseek-v4-flash")
TINY = load_spec("tiny-v4")


def test_flash_page_geometry_at_256_tokens():
    got = {p: pool_geometry(FLASH, p, 256) for p in POOLS}
    assert got["swa"] == PoolGeometry("swa", 256, 584) and got["swa"].page_bytes == 149_504
    assert got["c4"] == PoolGeometry("c4", 64, 584)
    assert got["c128"] == PoolGeometry("c128", 2, 584)
    assert got["indexer"] == PoolGeometry("indexer", 64, FLASH.indexer_row_bytes)
    assert got["c4_state"] == PoolGeometry("c4_state", 256, FLASH.compress_state_row_bytes(4))
    assert got["c128_state"] == PoolGeometry("c128_state", 256, FLASH.compress_state_row_bytes(128))


def test_stage_bytes_follow_local_layer_counts():
    layout = build_layout(FLASH, 4)
    s1 = layout.stages[1]
    b = stage_pool_bytes(FLASH, s1, 256, 10)
    assert b["swa"] == s1.local_layers * 149_504 * 10
    assert b["c128"] == len(s1.pool_layers("c128")) * 1168 * 10
    assert stage_token_page_bytes(FLASH, s1, 256) * 10 == sum(b.values())


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_real_pools_equal_accounting_for_tiny(pp):
    layout = build_layout(TINY, pp)
    for m in layout.stages:
        pools = StagePools(TINY, m, 128, 3)
        assert pools.pool_bytes() == stage_pool_bytes(TINY, m, 128, 3)
        for pool, bufs in pools.buffers.items():
            for t in bufs:
                assert t.shape == (3, pools.page_bytes(pool)) and str(t.dtype) == "torch.uint8"


def test_faulty_pools_priced_by_their_plan():
    layout = build_layout(TINY, 2)
    faults = parse_faults(["global-swa"], 2)
    m = layout.stages[1]
    pools = StagePools(TINY, m, 128, 2, faults=faults, pp_size=2, allow_invalid=True)
    counts = {p: len(s) for p, s in buffer_plan(m, TINY.compress_ratios, faults, 2).items()}
    assert counts["swa"] == TINY.num_layers
    assert pools.pool_bytes() == stage_pool_bytes(TINY, m, 128, 2, counts)
    assert pools.pool_bytes()["swa"] == 2 * stage_pool_bytes(TINY, m, 128, 2)["swa"]


def test_page_counts_from_tokens_and_budget():
    assert pages_for_tokens(1000, 256) == 4
    assert pages_for_tokens(1024, 256) == 4
    m = build_layout(FLASH, 4).stages[0]
    per_page = stage_token_page_bytes(FLASH, m, 256)
    assert pages_for_budget(FLASH, m, 256, per_page * 7 + 5) == 7
    with pytest.raises(ConfigError, match="stage 0: memory budget"):
        pages_for_budget(FLASH, m, 256, per_page - 1)
    with pytest.raises(ConfigError, match="max-total-tokens"):
        pages_for_tokens(0, 256)


def test_host_pages_ratio_and_size():
    assert host_pages_for(100) == 200
    assert host_pages_for(100, hicache_ratio=0.5) == 50
    assert host_pages_for(100, hicache_ratio=3, hicache_size_bytes=1000, token_page_bytes=100) == 10
    with pytest.raises(ConfigError, match="hicache-ratio"):
        host_pages_for(100, hicache_ratio=0)
    with pytest.raises(ConfigError, match="smaller than one host page"):
        host_pages_for(100, hicache_size_bytes=10, token_page_bytes=100)


@pytest.mark.parametrize("size", [0, -256, 100, 200])
def test_bad_page_sizes(size):
    with pytest.raises(ConfigError, match="page"):
        StagePools(FLASH, build_layout(FLASH, 4).stages[0], size, 4)


def test_cli_pools_json_matches_real_tiny_pools(capsys):
    assert main(["pools", "--model", "tiny-v4", "--pp-size", "2", "--page-size", "128",
                 "--max-total-tokens", "300", "--hicache-ratio", "1.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    layout = build_layout(TINY, 2)
    assert report["totals"]["device_bytes"] == sum(
        sum(StagePools(TINY, m, 128, 3).pool_bytes().values()) for m in layout.stages)
    s0 = report["stages"][0]
    assert (s0["device_pages"], s0["host_pages"]) == (3, 4)
    assert s0["host_bytes"] == s0["token_page_bytes"] * 4


def test_cli_pools_table_for_flash_pp4(capsys):
    assert main(["pools", "--model", "deepseek-v4-flash", "--pp-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "149,504" in out and "stage total" in out and "[32, 43)" in out


def test_cli_pools_bad_budget_is_one_line_exit_2(capsys):
    assert main(["pools", "--model", "deepseek-v4-flash", "--pp-size", "4", "--mem-budget-gb", "0.000001"]) == 2
    err = capsys.readouterr().err
    assert "memory budget" in err and len(err.strip().splitlines()) == 1
