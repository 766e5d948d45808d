"""``plan.mirror``: the kinds a stage's transfers must move, and the one rule they are checked by."""

from __future__ import annotations

from stagecache.runtime.model.families import load_spec
from stagecache.runtime.plan.faults import backup_left_out, parse_faults
from stagecache.runtime.plan.mirror import mirror_bytes, transfer_gap
from stagecache.runtime.plan.plan import Sizing, build_plan


def test_mirror_bytes_are_the_paged_host_kinds_of_the_stage():
    plan = build_plan(load_spec("tiny-v4"), 2, sizing=Sizing.runtime(24))
    stage = plan.stage(1)
    got = mirror_bytes(stage)
    # c128_state is per request (no host pages): not mirrored page by page
    assert set(got) == {"swa", "c4", "c128", "c4_state", "indexer", "c4_indexer_state"}
    assert got["indexer"] == stage.pool("indexer").present * stage.pool("indexer").page_bytes > 0


def test_a_fault_leaving_the_kind_out_of_the_host_set_leaves_it_out_of_the_mirror():
    spec = load_spec("glm-5.2")
    faulted = build_plan(spec, 2, faults=parse_faults(["indexer-not-host-cached@1"], 2, spec.family))
    assert "indexer" in mirror_bytes(faulted.stage(0)) and "indexer" not in mirror_bytes(faulted.stage(1))


def test_backup_without_indexer_names_each_familys_indexer_kinds_on_its_stages():
    v4 = load_spec("tiny-v4")
    faults = parse_faults(["backup-without-indexer@1"], 4, v4.family)
    assert [backup_left_out(faults, k, 4) for k in range(4)] == [
        frozenset(), frozenset({"indexer", "c4_indexer_state"}), frozenset(), frozenset()]
    dsa = load_spec("deepseek-v3.2")
    every = parse_faults(["backup-without-indexer"], 2, dsa.family)
    assert [backup_left_out(every, k, 2) for k in range(2)] == [frozenset({"indexer"})] * 2
    # the host set stays whole: start-up validation has nothing to see
    assert build_plan(v4, 4, faults=faults).to_dict()["stages"] == build_plan(v4, 4).to_dict()["stages"]


PLAN = {"kv": 100, "indexer": 10}


def test_a_complete_transfer_has_no_gap():
    assert transfer_gap(PLAN, {"kv": 4, "indexer": 4}, 4, 440) is None
    assert transfer_gap(PLAN, {"kv": 4, "indexer": 4, "other": 9}, 4, None) is None  # bytes unknown
    assert transfer_gap(PLAN, {}, 0, 0) is None  # nothing moved
    assert transfer_gap({}, {"kv": 4}, 4, 400) is None  # nothing planned


def test_a_missing_kind_a_short_kind_and_other_bytes_are_gaps():
    assert transfer_gap(PLAN, {"kv": 4}, 4, 400) == (["indexer"], 440)
    assert transfer_gap(PLAN, {"kv": 4, "indexer": 0}, 4, 400) == (["indexer"], 440)
    assert transfer_gap(PLAN, {"kv": 4, "indexer": 3}, 4, 430) == ([], 440)
    assert transfer_gap(PLAN, {"kv": 4, "indexer": 4}, 4, 441) == ([], 440)
    assert transfer_gap(PLAN, {"kv": 4}, 4, None) == (["indexer"], 440)
