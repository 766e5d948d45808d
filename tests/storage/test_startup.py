"""At startup: the store must hold this deployment's manifest, and each stage's probe its own."""

from __future__ import annotations

from plans import run_plan
from stagecache.runtime.storage.file import FileStore
from stagecache.runtime.storage.keys import KeySpace, key_space
from stagecache.runtime.storage.startup import check_manifest, check_probe, write_probe


def test_a_fresh_store_takes_the_deployments_manifest(tmp_path):
    plan = run_plan("tiny-v4", pp=4)
    store = FileStore(tmp_path / "l3")
    fp = plan.fingerprint.to_dict()
    assert check_manifest(store, fp, "here") is None
    assert check_manifest(FileStore(tmp_path / "l3"), fp, "here") is None  # the same deployment again


def test_another_deployments_store_is_refused_naming_both(tmp_path):
    a = run_plan("tiny-v4", pp=4).fingerprint.to_dict()
    b = run_plan("tiny-v4", pp=2).fingerprint.to_dict()
    store = FileStore(tmp_path / "l3")
    assert check_manifest(store, a, "file store x") is None
    err = check_manifest(store, b, "file store x")
    assert err is not None and a["digest"] in err and b["digest"] in err
    assert "pp_size: 4 != 2" in err and "--l3-reset" in err
    store.reset()
    assert check_manifest(store, b, "file store x") is None


def test_each_stage_reads_its_own_probe_back(tmp_path):
    plan = run_plan("tiny-v4", pp=4)
    store = FileStore(tmp_path / "l3")
    spaces = [key_space(plan, k) for k in range(4)]
    for s in spaces:
        assert write_probe(store, s, "run-1") is None
    assert all(check_probe(store, s, "run-1") is None for s in spaces)


def test_two_stages_writing_one_key_space_are_refused_naming_both(tmp_path):
    store = FileStore(tmp_path / "l3")
    # a key scheme without the stage (as some sglang backends have): both stages get one space
    stage1 = KeySpace("0123456789abcdef", 0, 0, 0, 43)
    stage2 = KeySpace("0123456789abcdef", 0, 0, 0, 43)
    write_probe(store, stage1, "run-a")
    write_probe(store, stage2, "run-b")
    err = check_probe(store, stage1, "run-a")
    assert err is not None and "overlap" in err and "run run-a" in err and "run run-b" in err
