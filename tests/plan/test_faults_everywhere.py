"""One plan, three readers: every ``--fault`` gives the same buffer counts and bytes in ``check``
(the plan validated), ``pools`` (the plan sized the sglang way) and ``serve`` (real pools, four real
stage processes, measured by each stage and gathered at rank 0)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from stagecache.runtime.cli.main import main
from stagecache.runtime.model.families.deepseek_v4 import FAMILY as V4
from stagecache.runtime.model.families.deepseek_v4 import POOLS
from stagecache.runtime.plan.faults import GENERIC_FAULTS

#: DeepSeek V4's faults and every family's (each other family tests its own with its presets).
FAULTS = sorted({k.name for k in (*V4.faults, *GENERIC_FAULTS)})

#: Every fault, in two sets whose faults hit different stages of tiny-v4 at pp 4 (stage 1 is the
#: one with two C128 layers, which duplicate-compress-id needs).
FAULT_SETS = (
    ("global-swa@0", "duplicate-compress-id@1", "missing-c4-state@2", "overlap@3"),
    ("global-c4@0", "radix-skew@1", "gap@2", "global-compress-ids@3", "pin-refused@0", "host-ram-short@3",
     "backup-without-indexer@2"),
)
LAYOUT = ["--model", "tiny-v4", "--pp-size", "4"]


def test_the_fault_sets_cover_every_fault():
    assert sorted(f.split("@")[0] for s in FAULT_SETS for f in s) == sorted(FAULTS)


def _flags(faults: tuple[str, ...]) -> list[str]:
    return [x for f in faults for x in ("--fault", f)]


def _json(capsys, *argv: str) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _from_check(report: dict) -> list[dict[str, tuple[int, int]]]:
    return [{p: (s["buffers"][p], s["pool_page_bytes"][p]) for p in POOLS} for s in report["stages"]]


def _from_pools(report: dict) -> list[dict[str, tuple[int, int]]]:
    return [{r["pool"]: (r["buffers"], r["present"] * r["page_bytes"]) for r in s["pools"]} for s in report["stages"]]


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_check_and_pools_agree_on_every_fault(capsys, fault):
    flags = [*LAYOUT, "--fault", f"{fault}@1"]
    _, checked = _json(capsys, "check", *flags)
    assert _json(capsys, "pools", *flags)[0] == 0
    _, pooled = _json(capsys, "pools", *flags)
    assert _from_check(checked) == _from_pools(pooled)
    assert [(s["start_layer"], s["end_layer"]) for s in checked["stages"]] == \
        [(s["start_layer"], s["end_layer"]) for s in pooled["stages"]]


def test_pools_shows_the_faulted_layout(capsys):
    _, healthy = _json(capsys, "pools", *LAYOUT)
    _, overlap = _json(capsys, "pools", *LAYOUT, "--fault", "overlap@1")
    assert [(s["start_layer"], s["end_layer"]) for s in overlap["stages"]][:2] == [(0, 3), (2, 6)]
    assert overlap["stages"][1]["pools"][0]["buffers"] == healthy["stages"][1]["pools"][0]["buffers"] + 1
    assert overlap["stages"][1]["device_bytes"] > healthy["stages"][1]["device_bytes"]
    _, swa = _json(capsys, "pools", *LAYOUT, "--fault", "global-swa")
    assert all(s["pools"][0]["buffers"] == 12 for s in swa["stages"])
    assert swa["faults"] == ["global-swa"]


@pytest.mark.parametrize("faults", FAULT_SETS, ids=["set1", "set2"])
def test_check_pools_and_serve_report_the_same_buffers_and_bytes(capsys, tmp_path, faults):
    _, checked = _json(capsys, "check", *LAYOUT, *_flags(faults))
    _, pooled = _json(capsys, "pools", *LAYOUT, *_flags(faults))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "stagecache.runtime", "serve", *LAYOUT, *_flags(faults), "--no-dashboard",
         "--exit-on-error", "--requests", "8", "--rate", "0", "--device-pages", "24", "--micro-batch", "2", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # every set holds a mapping fault: refused
    served = json.loads((run_dir / "startup.json").read_text())
    assert not served["ok"] and served["faults"] == list(faults)
    assert _from_check(served) == _from_check(checked) == _from_pools(pooled)
    assert [e["message"] for s in served["stages"] for e in s["errors"]] == \
        [e["message"] for s in checked["stages"] for e in s["errors"]]
