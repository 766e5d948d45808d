"""Startup validation of a plan: per stage (buffers against the layer map) and across stages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from plans import run_plan
from stagecache.runtime.model.families import load_spec, spec_from_config
from stagecache.runtime.model.families.deepseek_v4 import POOLS
from stagecache.runtime.model.layer_map import build_layout
from stagecache.runtime.model.partition import StageSlice
from stagecache.runtime.plan.inventory import PoolInventory
from stagecache.runtime.validation.checks import validate_stage, validate_tiling
from stagecache.runtime.validation.deployment import preflight

FLASH = load_spec("deepseek-v4-flash")


def test_clean_flash_pp4_has_no_errors():
    report = preflight(run_plan(FLASH, 4, tp=2))
    assert report.ok and report.all_errors == []


def test_global_swa_fault_reports_every_stage_with_counts():
    report = preflight(run_plan(FLASH, 4, ["global-swa"]))
    errs = report.all_errors
    assert [(e.stage, e.pool, e.expected, e.got) for e in errs] == [
        (0, "swa", 10, 43), (1, "swa", 11, 43), (2, "swa", 11, 43), (3, "swa", 11, 43)]
    assert errs[1].message == "DeepSeek V4 SWA KV pool must be PP-stage-local: got 43 buffers for 11 local layers"


def test_global_sized_swa_is_harmless_without_pp():
    assert preflight(run_plan(FLASH, 1, ["global-swa"])).ok


def test_none_state_pool_is_the_startup_crash_message():
    report = preflight(run_plan(FLASH, 4, ["missing-c4-state"]))
    errs = report.all_errors
    assert {e.stage for e in errs} == {1, 2, 3}
    assert all(e.pool == "c4_state" and "state_pools must not contain None" in e.message for e in errs)


def test_missing_pool_entirely():
    stage = run_plan(FLASH, 4).stage(0)
    buffers = dict(stage.inventory().buffers)
    del buffers["indexer"]
    errs = validate_stage(stage.layer_map, PoolInventory(0, buffers))
    assert [(e.pool, e.expected, e.got) for e in errs] == [("indexer", 4, None)]
    assert "missing" in errs[0].message


def test_global_c4_and_global_compress_ids():
    r = preflight(run_plan(FLASH, 4, ["global-c4"]))
    assert {(e.pool, e.got) for e in r.all_errors if e.stage == 0} == {
        ("c4", 21), ("c4_state", 21), ("indexer", 21), ("c4_indexer_state", 21)}
    r = preflight(run_plan(FLASH, 4, ["global-compress-ids"]))
    assert r.stages[0].ok  # stage 0's ids are the same either way
    bad = [e for e in r.all_errors if e.stage == 3]
    assert bad and all("out of range" in e.message for e in bad)
    assert {e.pool for e in bad} == {"c4", "c128", "c4_state"}


def test_duplicate_compress_id():
    r = preflight(run_plan(FLASH, 4, ["duplicate-compress-id@1"]))
    errs = r.all_errors
    assert [(e.stage, e.pool, e.got) for e in errs] == [(1, "c128", 0)]
    assert "global layers 11 and 13 share compress_layer_id 0" in errs[0].message


@pytest.mark.parametrize("fault,word", [("overlap", "overlap"), ("gap", "gap")])
def test_tiling_faults(fault, word):
    r = preflight(run_plan(FLASH, 4, [fault]))
    assert not r.ok
    assert any(e.stage is None and e.pool == "partition" and e.message.startswith(word) for e in r.cross_errors)


def test_validate_tiling_catches_each_shape():
    assert validate_tiling([StageSlice(0, 0, 5), StageSlice(1, 5, 10)], 10) == []
    msgs = [e.message for e in validate_tiling([StageSlice(0, 0, 4), StageSlice(1, 5, 10)], 10)]
    assert msgs == ["gap: layers [4, 5) belong to no stage (stage 1 starts at 5)"]
    msgs = [e.message for e in validate_tiling([StageSlice(0, 0, 6), StageSlice(1, 5, 10)], 10)]
    assert msgs[0].startswith("overlap: layers [5, 6)")
    errs = validate_tiling([StageSlice(0, 0, 10), StageSlice(1, 10, 10)], 10)
    assert [e.pool for e in errs] == ["partition"] and "empty" in errs[0].message
    errs = validate_tiling([StageSlice(0, 0, 12)], 10)
    assert "outside the model's 10 layers" in errs[0].message
    assert validate_tiling([StageSlice(0, 0, 8)], 10)[0].message == "gap: layers [8, 10) belong to no stage"


def test_validation_returns_all_errors_at_once():
    r = preflight(run_plan(FLASH, 4, ["global-swa", "missing-c4-state", "gap"]))
    pools = {e.pool for e in r.all_errors}
    assert {"swa", "c4_state", "partition"} <= pools




def test_a_report_carries_the_planned_bytes_of_a_page_per_pool():
    plan = run_plan(FLASH, 4, ["global-swa@2"])
    rows = preflight(plan).to_dict()["stages"]
    for stage, row in zip(plan.stages, rows, strict=True):
        assert row["pool_page_bytes"] == stage.pool_page_bytes()
    assert rows[2]["pool_page_bytes"]["swa"] == 43 * plan.stage(2).pool("swa").page_bytes


ratios_st = st.lists(st.sampled_from([0, 4, 128]), min_size=1, max_size=80)


@given(ratios=ratios_st, data=st.data())
def test_property_every_pool_count_equals_its_layer_count(ratios, data):
    spec = spec_from_config({"num_hidden_layers": len(ratios), "compress_ratios": ratios,
                             "sliding_window": 128, "head_dim": 512, "qk_rope_head_dim": 64,
                             "index_head_dim": 128})
    pp = data.draw(st.integers(1, min(len(ratios), 8)))
    layout = build_layout(spec, pp)
    report = preflight(run_plan(spec, pp))
    assert report.ok, report.all_errors
    covered = [e.global_id for s in layout.stages for e in s.layers]
    assert covered == list(range(len(ratios)))
    for s in layout.stages:
        local = [spec.compress_ratios[g] for g in range(s.start, s.end)]
        assert s.expected_buffers() == {
            "swa": len(local), "c4": local.count(4), "c128": local.count(128),
            "c4_state": local.count(4), "c128_state": local.count(128), "indexer": local.count(4),
            "c4_indexer_state": local.count(4)}
        for pool in POOLS:  # every id in range and unique: a bijection onto the pool's buffers
            ids = sorted(s.pool_map(pool).values())
            assert ids == list(range(s.expected_buffers()[pool]))
