"""Every HiCache backup and load of ``serve`` checked against the stage's plan, seen from outside.

Real stage processes (gloo), real HTTP.  ``--fault backup-without-indexer@2`` makes stage 2's
backups leave DeepSeek V4's indexer kinds (``indexer``, ``c4_indexer_state``) out while its host
set holds them -- sglang #38031's pages.  Start-up validation cannot see that (the host set is
right), so the run starts; the first incomplete backup is then named -- stage, pool kinds, host
page, bytes against the plan -- on /readyz, the dashboard, the log and
``stagecache_hicache_incomplete_transfers_total``, and when such a page is loaded back the stage's
KV check finds its indexer bytes wrong.  A healthy run checks every transfer and reports nothing.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import SMALL, read_json, run_phase, start, stop, wait_for

pytestmark = pytest.mark.timeout(300)


def _samples(text: str, name: str) -> dict[str, float]:
    return {s.labels.get("pool", ""): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


ALL_KINDS = ("swa", "c4", "c128", "c4_state", "c128_state", "indexer", "c4_indexer_state")


def _pools(model: str, pp: int, stage: int, kinds: tuple[str, ...]) -> list[dict]:
    """``stagecache pools --json``'s rows of ``kinds`` on ``stage``."""
    out = subprocess.run([sys.executable, "-m", "stagecache.runtime", "pools", "--model", model,
                          "--pp-size", str(pp), "--json"], capture_output=True, text=True, timeout=120, check=True)
    return [p for p in json.loads(out.stdout)["stages"][stage]["pools"] if p["pool"] in kinds]


def _finished_run(tmp_path: Path, port: int, extra: list[str]) -> dict:
    """One held run: until it is over (done or failed), then what an operator sees."""
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    base = f"http://127.0.0.1:{port}"
    proc = start([*SMALL, "--port", str(port), "--run-dir", str(run_dir), *extra], out)
    try:
        wait_for(lambda: run_phase(run_dir) in ("done", "failed"), 180, "the run to end", proc, out)
        seen = {"readyz": httpx.get(f"{base}/readyz", timeout=10).json(),
                "startupz": httpx.get(f"{base}/startupz", timeout=10).status_code,
                "metrics": httpx.get(f"{base}/metrics", timeout=10).text,
                "page": httpx.get(f"{base}/", timeout=20).text,
                "stages": {k: read_json(run_dir / f"stage-{k}.json") for k in range(4)},
                "run": read_json(run_dir / "run.json")}
    finally:
        stop(proc, signal.SIGINT)
    seen["log"] = out.read_text()
    return seen


def test_a_healthy_run_checks_every_backup_and_load_and_reports_nothing(tmp_path, free_port):
    seen = _finished_run(tmp_path, free_port, [])
    assert seen["run"]["phase"] == "done", seen["log"]
    for k, s in seen["stages"].items():
        check, moves = s["transfer_check"], s["transfer_count"]
        assert moves["h2d"] > 0 and moves["d2h"] > 0, (k, moves)  # loads and backups both happened
        assert check["checked"] == moves["d2h"] + moves["h2d"], (k, check, moves)
        assert check["count"] == 0 and check["incomplete"] == {} and check["first"] is None, (k, check)
    body = seen["readyz"]
    assert not [r for r in body["reasons"] + body["warnings"] if "incomplete HiCache transfer" in r], body
    for k, s in seen["stages"].items():  # the kinds each stage mirrors page by page (pools --json)
        mirrored = {p["pool"] for p in _pools("tiny-v4", 4, k, ALL_KINDS) if p["host_pages"] and p["present"]
                    and p["budget"] != "request"}
        assert set(s["transfer_check"]["kinds"]) == mirrored and "indexer" in mirrored, (k, mirrored)
    # every kind checked, at 0
    kinds = set().union(*(s["transfer_check"]["kinds"] for s in seen["stages"].values()))
    assert _samples(seen["metrics"], "stagecache_hicache_incomplete_transfers_total") == dict.fromkeys(kinds, 0.0)
    assert "incomplete HiCache transfer" not in seen["page"] + seen["log"]


def test_backups_without_the_indexer_on_stage_2_are_flagged_with_the_kinds_and_page(tmp_path, free_port):
    seen = _finished_run(tmp_path, free_port, ["--fault", "backup-without-indexer@2"])
    assert seen["startupz"] == 200  # the host set is right: start-up validation passes
    stages = seen["stages"]
    check = stages[2]["transfer_check"]
    first = check["first"]
    # the stage's first backup: the first micro-batch's new pages, from host page 0
    assert (first["stage"], first["direction"], first["page"], first["missing"]) == (
        2, "d2h", 0, ["indexer", "c4_indexer_state"]), first
    lacking = sum(p["present"] * p["page_bytes"] for p in _pools("tiny-v4", 4, 2, ("indexer", "c4_indexer_state")))
    assert lacking > 0 and first["expected_bytes"] - first["got_bytes"] == first["pages"] * lacking, first
    assert check["count"] >= 1 and check["incomplete"] == {"indexer": check["count"],
                                                           "c4_indexer_state": check["count"]}
    assert check["checked"] > check["count"]  # its loads are complete (they move every kind)
    for k in (0, 1, 3):  # the fault's stage alone
        assert stages[k]["transfer_check"]["count"] == 0 and stages[k]["transfer_check"]["checked"] > 0
    line = (f"incomplete HiCache transfer(s); first: stage 2: backup of host page 0 ({first['pages']} page(s)) "
            f"lacks pool kind(s) indexer, c4_indexer_state: {first['got_bytes']} bytes moved, the stage's plan "
            f"says {first['expected_bytes']}")
    assert any(r.endswith(line) for r in seen["readyz"]["reasons"]), seen["readyz"]["reasons"]
    assert re.search(r"not ready: \d+ " + re.escape(line), seen["log"]), seen["log"][-3000:]  # the log, once
    assert seen["log"].count("first: stage 2: backup") == 1
    assert 'id="pp-divergence"' in seen["page"] and "stage 2: backup of host page 0" in seen["page"]
    counts = _samples(seen["metrics"], "stagecache_hicache_incomplete_transfers_total")
    assert {k: n for k, n in counts.items() if n} == {"indexer": check["count"], "c4_indexer_state": check["count"]}
    assert set(counts) == set(check["kinds"])  # the complete kinds at 0
    # a page backed up without its indexer and loaded back: the stage's KV check finds it wrong
    assert seen["run"]["phase"] == "failed" and seen["run"]["failed_stage"] == 2, seen["run"]
    assert "KvMismatchError" in seen["run"]["failure"] and "device indexer" in seen["run"]["failure"]


def test_dsa_backups_without_the_indexer_are_flagged_on_deepseek_v32(tmp_path):
    """The same fault on a DSA model: its one indexer kind (``indexer``), every stage."""
    out = subprocess.run([sys.executable, "-m", "stagecache.runtime", "serve", "--model", "deepseek-v3.2",
                          "--pp-size", "2", "--requests", "12", "--rate", "0", "--device-pages", "24",
                          "--micro-batch", "2", "--fault", "backup-without-indexer", "--exit-after-run",
                          "--port", "0", "--run-dir", str(tmp_path / "run"), "--json"],
                         capture_output=True, text=True, timeout=240)
    summary = json.loads(out.stdout)
    assert summary["startup_ok"] and summary["faults"] == ["backup-without-indexer"], out.stderr[-2000:]
    for s in summary["stages"]:
        first = s["transfer_check"]["first"]
        assert first is not None and (first["stage"], first["direction"], first["page"], first["missing"]) == (
            s["stage"], "d2h", 0, ["indexer"]), s["transfer_check"]
        # sglang pins DSA's page at 64 tokens (what ``pools`` prices); serve pages by --page-size
        lacking = sum(p["present"] * p["row_bytes"] * summary["page_size"]
                      for p in _pools("deepseek-v3.2", 2, s["stage"], ("indexer",)))
        assert first["expected_bytes"] - first["got_bytes"] == first["pages"] * lacking


@pytest.mark.parametrize(("model", "args"), [("tiny-v4", ["--fault", "backup-without-indexer@1"]),
                                             ("glm-5.2", ["--fault", "backup-without-indexer"])])
def test_check_says_the_fault_is_live_only_and_passes(model, args):
    out = subprocess.run([sys.executable, "-m", "stagecache.runtime", "check", "--model", model,
                          "--pp-size", "2", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all stages valid" in out.stdout
    assert ("--fault backup-without-indexer: live only: it leaves the layout healthy and acts on a serving "
            "stage (stagecache serve, or the sglang plugin's STAGECACHE_FAULT); check has nothing to find"
            in " ".join(out.stdout.split()))


def test_a_family_without_an_indexer_refuses_the_fault_in_one_line():
    out = subprocess.run([sys.executable, "-m", "stagecache.runtime", "check", "--model", "llama-3.1-8b",
                          "--pp-size", "2", "--fault", "backup-without-indexer"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "stagecache check: error: --fault backup-without-indexer is not a fault of MHA models; theirs: "
        "global-mha, overlap, gap, radix-skew, pin-refused, host-ram-short"]
