"""The SWA-hybrid family's faults on its preset (gpt-oss-20b): ``check`` refuses each in one line
naming the stage, the pool and the layer, ``pools`` shows the faulted buffers, and ``serve``
refuses at startup."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from stagecache.runtime.cli.main import main
from stagecache.runtime.model.families.swa_hybrid import FAMILY

LAYOUT = ["--model", "gpt-oss-20b", "--pp-size", "4", "--page-size", "16"]
#: fault -> (the stage it hits at @2, the pools it names, words of its message)
EXPECTED = {
    "global-swa-subpool": ({"swa"}, "got 12 buffers for 3 local sliding-window layers (its layers 12, 14, 16)"),
    "global-full-subpool": ({"full"}, "got 12 buffers for 3 local full-attention layers (its layers 13, 15, 17)"),
    "no-swa-layer": ({"swa"}, "got 0 buffers for 3 local sliding-window layers (its layers 12, 14, 16)"),
    "stage-local-transfer-ids": ({"swa", "full"}, "HiCache signals global layer 12's transfer as id 0 but the "
                                 "pool waits on id 12"),
}


def test_every_fault_of_the_family_is_tested():
    assert set(EXPECTED) == {k.name for k in FAMILY.faults}


def _json(capsys, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_check_refuses_the_fault_naming_stage_pool_and_layer(capsys, fault):
    pools, words = EXPECTED[fault]
    code, report = _json(capsys, "check", *LAYOUT, "--fault", f"{fault}@2")
    assert code == 1 and not report["ok"]
    errors = [e for s in report["stages"] for e in s["errors"]]
    assert {e["stage"] for e in errors} == {2}
    assert {e["pool"] for e in errors} == pools
    assert any(words in e["message"] for e in errors), [e["message"] for e in errors]
    healthy_code, healthy = _json(capsys, "check", *LAYOUT)
    assert healthy_code == 0 and healthy["ok"]


@pytest.mark.parametrize("fault", ["global-swa-subpool", "global-full-subpool", "no-swa-layer"])
def test_pools_shows_the_faulted_buffers_as_check_counts_them(capsys, fault):
    _, checked = _json(capsys, "check", *LAYOUT, "--fault", f"{fault}@1")
    code, pooled = _json(capsys, "pools", *LAYOUT, "--fault", f"{fault}@1")
    assert code == 0
    for c, p in zip(checked["stages"], pooled["stages"], strict=True):
        rows = {r["pool"]: r for r in p["pools"]}
        assert {k: rows[k]["buffers"] for k in c["buffers"]} == c["buffers"]
        assert {k: rows[k]["present"] * rows[k]["page_bytes"] for k in c["buffers"]} == c["pool_page_bytes"]


def test_stage_local_transfer_ids_needs_two_stages(capsys):
    assert main(["check", "--model", "gpt-oss-20b", "--pp-size", "1", "--fault", "stage-local-transfer-ids"]) == 2
    assert "needs --pp-size >= 2" in capsys.readouterr().err


def test_another_familys_fault_is_refused_in_one_line(capsys):
    assert main(["check", *LAYOUT, "--fault", "missing-c4-state"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a fault of SWA hybrid models" in err


def test_serve_refuses_a_faulted_stage_at_startup(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "stagecache.runtime", "serve", "--model", "gpt-oss-20b", "--requests", "4",
         "--no-dashboard", "--exit-after-run", "--fault", "global-swa-subpool@1"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "startup validation FAILED" in proc.stdout
    assert "[stage 1] pool=swa" in proc.stdout and "its layers 6, 8, 10" in proc.stdout
