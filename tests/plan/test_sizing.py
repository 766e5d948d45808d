"""Pool sizing in the plan: the pool-kind table's bytes, sglang's budgets, real pools and
``stagecache pools``."""

from __future__ import annotations

import json

import pytest
from plans import pools, run_plan
from stagecache.runtime.cli.main import main
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.memory.host_pools import HostPools
from stagecache.runtime.memory.pools import StagePools
from stagecache.runtime.model.families import load_spec
from stagecache.runtime.model.families.deepseek_v4 import HOST_CACHED, KINDS, POOLS
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.plan.plan import Sizing, build_plan
from stagecache.runtime.plan.sizing import (
    host_pages_for,
    pages_for_tokens,
    runtime_budget,
    sglang_budget,
    sglang_full_tokens_for_bytes,
)

FLASH = load_spec("deepseek-v4-flash")
TINY = load_spec("tiny-v4")


def test_flash_table_at_256_tokens_is_sglangs_bytes():
    t = FLASH.family.kind_table(FLASH, 256)
    got = {p: (t[p].rows_per_page, t[p].row_bytes, t[p].page_bytes) for p in POOLS}
    assert got == {
        "swa": (256, 584, 149_760),  # 256 x 584 = 149,504 padded to a multiple of 576
        "c4": (64, 584, 37_440),
        "c128": (2, 584, 1_728),
        "c4_state": (8, 8_192, 65_536),  # a ring of 8 fp32 (kv, score) rows with overlap
        "c128_state": (128, 4_096, 524_288),  # per request slot
        "indexer": (64, 132, 8_448),
        "c4_indexer_state": (8, 2_048, 16_384),
    }
    for p in ("swa", "c4", "c128"):
        raw = t[p].rows_per_page * t[p].row_bytes
        assert t[p].page_bytes % 576 == 0 and raw <= t[p].page_bytes < raw + 576
    assert [p for p in POOLS if not KINDS[p].host_cached] == ["c128_state"]
    assert {p: KINDS[p].budget for p in POOLS} == {
        "swa": "swa", "c4": "full", "c128": "full", "c4_state": "swa", "c128_state": "request",
        "indexer": "full", "c4_indexer_state": "swa"}


def test_flash_pp4_stage1_costs_what_sglang_allocates_per_page():
    s1 = build_plan(FLASH, 4).stage(1)
    counts = {p: len(b) for p, b in s1.buffers.items()}
    assert counts == {"swa": 11, "c4": 6, "c128": 5, "c4_state": 6, "c128_state": 5, "indexer": 6,
                      "c4_indexer_state": 6}
    assert s1.token_page_bytes == 2_422_848  # was 5.11 MB


def test_sglang_budget_follows_its_configurator():
    b = sglang_budget(256, 262_144, FLASH.sliding_window)
    assert (b.full_pages, b.swa_pages, b.request_slots) == (1024, 102, 257)  # 26,214 -> 26,112 tokens
    assert sglang_budget(256, 262_144 + 100, 128, swa_ratio=1.0).swa_tokens == 262_144
    assert sglang_budget(256, 1024, 128, 1.0, max_running_requests=1000).request_slots == 513  # 1024 // 2 + 1
    with pytest.raises(ConfigError, match=r"SWA pool \(0 tokens\) cannot hold even one request"):
        sglang_budget(256, 2048, 128)
    with pytest.raises(ConfigError, match="swa-full-tokens-ratio must be in"):
        sglang_budget(256, 262_144, 128, swa_ratio=1.5)
    with pytest.raises(ConfigError, match="less than one page"):
        sglang_budget(256, 100, 128)


def test_a_sglang_sized_plan_sizes_each_kind_by_its_budget():
    plan = build_plan(FLASH, 4, sizing=Sizing.sglang(max_total_tokens=262_144, hicache_ratio=1.5))
    rows = {r.pool: r for r in plan.stage(1).pools}
    assert (rows["swa"].units, rows["swa"].tensor_rows, rows["swa"].host_pages) == (102, 103, 153)
    assert (rows["c4"].units, rows["c4"].tensor_rows, rows["c4"].host_pages) == (1024, 1028, 1536)
    assert rows["c128"].tensor_rows == 1024 + 128  # sglang reserves one 256-token page = 128 C128 pages
    assert rows["c4_state"].tensor_rows == 828 and rows["c4_state"].tensor_row_bytes == 8192  # 102 x 8 + 9 -> x4
    assert rows["c128_state"].tensor_rows == 259 * 128 and rows["c128_state"].host_pages == 0
    assert rows["c128_state"].device_bytes == 5 * 259 * 524_288 and rows["c128_state"].host_bytes == 0
    assert rows["swa"].device_bytes == 11 * 103 * 149_760
    assert rows["c4_indexer_state"].host_bytes == 6 * 153 * 16_384


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_real_pools_allocate_their_budget_pages(pp):
    table = TINY.family.kind_table(TINY, 128)
    for m in build_layout(TINY, pp).stages:
        dp = pools(TINY, m, 128, 4, swa_ratio=0.5, request_slots=3, hicache_ratio=1.5)
        budget = runtime_budget(128, 4, 0.5, 3)
        assert dp.pool_bytes() == {p: m.expected_buffers()[p] * budget.units(KINDS[p]) * table.page_bytes(p)
                                   for p in POOLS}
        assert sum(dp.pool_bytes().values()) == dp.plan.device_bytes
        for pool, bufs in dp.buffers.items():
            units = {"full": 4, "swa": 2, "request": 3}[KINDS[pool].budget]
            assert all(t.shape == (units, table.page_bytes(pool)) and str(t.dtype) == "torch.uint8" for t in bufs)
        host = HostPools(dp)
        assert host.kind_pages == {
            p: int(1.5 * {"full": 4, "swa": 2}[KINDS[p].budget]) for p in HOST_CACHED}
        assert host.buffers["c128_state"] == [] and host.pool_bytes()["c128_state"] == 0
        assert sum(host.pool_bytes().values()) == dp.plan.host_bytes


def test_faulty_pools_priced_by_their_plan():
    plan = run_plan(TINY, 2, ["global-swa"], page_size=128, pages=2)
    dp = StagePools(plan.stage(1))
    assert len(plan.stage(1).buffers["swa"]) == TINY.num_layers
    assert sum(dp.pool_bytes().values()) == plan.stage(1).device_bytes
    healthy = StagePools(run_plan(TINY, 2, page_size=128, pages=2).stage(1))
    assert dp.pool_bytes()["swa"] == 2 * healthy.pool_bytes()["swa"]


def test_full_tokens_for_a_byte_budget():
    table = FLASH.family.kind_table(FLASH, 256)
    counts = build_layout(FLASH, 4).stages[0].expected_buffers()
    full = sglang_full_tokens_for_bytes(table, counts, 20 << 30)
    assert full % 256 == 0 and full > 0

    def priced(tokens: int) -> int:  # sglang prices the budget pages and the request slots, not its reserve
        stage = build_plan(FLASH, 4, sizing=Sizing.sglang(max_total_tokens=tokens)).stage(0)
        return sum(r.present * r.units * r.page_bytes if KINDS[r.pool].paged else r.device_bytes
                   for r in stage.pools)

    assert priced(full) <= 20 << 30 < priced(full + 10 * 256)
    assert sglang_full_tokens_for_bytes(table, counts, 40 << 30) > 2 * full - 256 * 4
    with pytest.raises(ConfigError, match="stage 0: memory budget"):
        sglang_full_tokens_for_bytes(table, counts, 1 << 20, where="stage 0")


def test_host_pages_by_ratio_only():
    assert host_pages_for(100) == 200
    assert host_pages_for(100, hicache_ratio=0.5) == 50
    with pytest.raises(ConfigError, match="hicache-ratio"):
        host_pages_for(100, hicache_ratio=0)
    with pytest.raises(ConfigError, match="does not support a host size in bytes"):  # as sglang does
        build_plan(FLASH, 4, sizing=Sizing.sglang(hicache_size_bytes=1 << 30))
    assert pages_for_tokens(1000, 256) == 4 and pages_for_tokens(1024, 256) == 4
    with pytest.raises(ConfigError, match="max-total-tokens"):
        pages_for_tokens(0, 256)


@pytest.mark.parametrize("size", [0, -256, 100, 200])
def test_bad_page_sizes(size):
    with pytest.raises(ConfigError, match="page"):
        build_plan(FLASH, 4, page_size=size)


def _pools_json(capsys, *argv: str) -> dict:
    assert main(["pools", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_pools_json_for_flash_pp4(capsys):
    report = _pools_json(capsys, "--model", "deepseek-v4-flash", "--pp-size", "4")
    s1 = report["stages"][1]
    assert (s1["start_layer"], s1["end_layer"], s1["token_page_bytes"]) == (10, 21, 2_422_848)
    assert (s1["device_pages"], s1["swa_device_pages"], s1["request_slots"]) == (1024, 102, 257)
    pools = {r["pool"]: r for r in s1["pools"]}
    assert pools["c4_indexer_state"]["buffers"] == 6 and pools["c128_state"]["host_cached"] is False
    assert s1["device_bytes"] == sum(r["device_bytes"] for r in s1["pools"])
    assert report["totals"]["device_bytes"] == sum(s["device_bytes"] for s in report["stages"])
    assert report["notes"] == [] and report["page_size"] == 256


def test_cli_pools_page_size_follows_sglang(capsys):
    at_256 = _pools_json(capsys, "--model", "deepseek-v4-flash", "--pp-size", "2")
    at_64 = _pools_json(capsys, "--model", "deepseek-v4-flash", "--pp-size", "2", "--page-size", "64")
    assert at_64["stages"] == at_256["stages"] and at_64["requested_page_size"] == 64
    assert at_64["notes"] == ["sglang 0.5.23 runs DeepSeek-V4 with page_size 256 (it overrides --page-size 64)"]


def test_cli_pools_runtime_pools_hold_the_budget_pages(capsys):
    report = _pools_json(capsys, "--model", "tiny-v4", "--pp-size", "2", "--max-total-tokens", "4096",
                         "--swa-full-tokens-ratio", "0.5", "--max-running-requests", "2")
    for s in report["stages"]:
        m = build_layout(TINY, 2).stages[s["stage"]]
        dp = pools(TINY, m, 256, s["device_pages"], swa_ratio=0.5, request_slots=s["request_slots"])
        assert dp.pool_bytes() == {r["pool"]: r["buffers"] * r["device_pages"] * r["page_bytes"]
                                   for r in s["pools"]}


def test_cli_pools_table_for_flash_pp4(capsys):
    assert main(["pools", "--model", "deepseek-v4-flash", "--pp-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "149,760" in out and "stage total" in out and "[32, 43)" in out and "2,422,848" in out


@pytest.mark.parametrize(("argv", "match"), [
    (["--mem-budget-gb", "0.000001"], "memory budget"),
    (["--hicache-size-gb", "64"], "does not support a host size in bytes"),
    (["--swa-full-tokens-ratio", "2"], "--swa-full-tokens-ratio: expected a finite number > 0 and <= 1"),
    (["--max-total-tokens", "2048"], "cannot hold even one request"),
])
def test_cli_pools_bad_input_is_one_line_exit_2(capsys, argv, match):
    assert main(["pools", "--model", "deepseek-v4-flash", "--pp-size", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1


def test_cli_pools_host_tier_status_and_this_hosts_ram(capsys):
    """Accounting only (nothing allocated): a host tier smaller than the device tier is flagged per
    stage, and the host tiers of all stages are priced against this host's RAM with a ratio that fits."""
    small = _pools_json(capsys, "--model", "deepseek-v4-flash", "--pp-size", "4", "--hicache-ratio", "0.5")
    assert all(s["host_tier"]["status"] == ["smaller_than_device"] for s in small["stages"])
    assert "512 host pages for 1024 device pages" in small["stages"][2]["host_tier"]["reasons"][0]
    ok = _pools_json(capsys, "--model", "deepseek-v4-flash", "--pp-size", "4")
    assert all(s["host_tier"]["status"] == ["ok"] for s in ok["stages"])
    assert ok["this_host"]["host_bytes"] == ok["totals"]["host_bytes"]
    huge = _pools_json(capsys, "--model", "deepseek-v4-flash", "--pp-size", "4", "--hicache-ratio", "1000")
    host = huge["this_host"]
    assert host["fits"] is False and host["advice"].startswith("lower --hicache-ratio to ")
    fit = host["advice"].rsplit(" ", 1)[1]
    again = _pools_json(capsys, "--model", "deepseek-v4-flash", "--pp-size", "4", "--hicache-ratio", fit)
    assert again["totals"]["host_bytes"] <= host["mem_available_bytes"] - host["reserve_bytes"]
    assert main(["pools", "--model", "deepseek-v4-flash", "--pp-size", "4", "--hicache-ratio", "0.5"]) == 0
    assert "warning: stage 0 host tier: host tier smaller than the device tier" in capsys.readouterr().out
