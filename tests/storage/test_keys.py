"""The one key scheme: every key names deployment, TP rank, stage, kind and page; spaces never mix."""

from __future__ import annotations

import pytest
from plans import run_plan
from stagecache.runtime.storage.keys import check_key, key_space


def test_keys_carry_deployment_stage_kind_and_page():
    plan = run_plan("tiny-v4", pp=4)
    s1 = key_space(plan, 1)
    key = s1.key("c4", 0xABC)
    fields = key.split(".")
    assert fields == ["sc1", plan.fingerprint.digest, "t0", "p1",
                      f"L{plan.stage(1).layer_map.start}-{plan.stage(1).layer_map.end}", "c4",
                      "0000000000000abc"]
    assert check_key(key) == key and s1.owns(key)


def test_every_stage_of_a_run_has_its_own_key_space():
    plan = run_plan("deepseek-v4-flash", pp=4)
    spaces = [key_space(plan, k) for k in range(4)]
    assert len({s.prefix for s in spaces}) == 4
    assert len({s.key("swa", 7) for s in spaces}) == 4


def test_another_partition_dtype_or_page_size_changes_every_key():
    a = run_plan("deepseek-v4-flash", pp=4)
    b = run_plan("deepseek-v4-flash", pp=4, partition=[12, 11, 10, 10])
    c = run_plan("deepseek-v4-flash", pp=4, page_size=512)
    keys = {key_space(p, 0).key("swa", 1) for p in (a, b, c)}
    assert len(keys) == 3


@pytest.mark.parametrize("bad", ["", ".hidden", "a/b", "a..b", "x" * 300, "a b", "../etc"])
def test_keys_that_are_not_safe_names_are_refused(bad):
    with pytest.raises(ValueError, match="L3 key"):
        check_key(bad)
