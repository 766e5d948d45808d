"""``serve`` with L3, seen from outside: a second run reads what the first one left, a store of
another deployment is refused (exit 1, both named) unless reset, a corrupt object on one stage is
a counted miss that never becomes data, and a Mooncake master killed mid-run leaves the stages
serving from device and host with /readyz 200 and L3 marked down, until it comes back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from l3_support import corrupt_records, need_mooncake
from serve_helpers import SMALL, read_json, start, stop, wait_for
from stagecache.runtime.storage.master import MooncakeMaster

RUN = [*SMALL, "--no-dashboard", "--exit-after-run", "--json"]


def _serve(args: list[str], timeout: float = 240) -> tuple[int, dict | None, str]:
    proc = subprocess.run([sys.executable, "-m", "stagecache.runtime", "serve", *args],
                          capture_output=True, text=True, timeout=timeout)
    text = proc.stdout
    summary = json.loads(text[text.index("{\n"):]) if "{\n" in text else None
    return proc.returncode, summary, proc.stderr


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, dict]:
    """One run's L3 directory and summary; each test works on a copy of the directory."""
    l3 = tmp_path_factory.mktemp("first") / "l3"
    code, summary, err = _serve([*RUN, "--l3-dir", str(l3)])
    assert code == 0, err
    return l3, summary


def _copy(first_run, tmp_path: Path) -> Path:
    return Path(shutil.copytree(first_run[0], tmp_path / "l3"))


def test_a_second_run_starts_with_what_the_first_left_in_l3(first_run, tmp_path):
    l3, first = _copy(first_run, tmp_path), first_run[1]
    code, second, err = _serve([*RUN, "--l3-dir", str(l3)])
    assert code == 0, err
    for a, b in zip(first["stages"], second["stages"], strict=True):
        assert b["cache_tokens"]["storage"] > a["cache_tokens"]["storage"] >= 0
        assert b["cache_tokens"]["miss"] < a["cache_tokens"]["miss"]
        assert not any(b["disagreements"].values())
        assert b["kv_verified_pages"] > a["kv_verified_pages"]  # L3 pages verified byte for byte
    # every stage wrote its own key space (its own segments); nothing else but small objects
    names = [p.name for p in l3.iterdir()]
    assert "sc1.manifest.obj" in names
    assert {n.split(".")[3] for n in names if n.count(".") > 3} == {"p0", "p1", "p2", "p3"}


def test_another_deployments_store_is_refused_naming_both_unless_reset(first_run, tmp_path):
    l3 = _copy(first_run, tmp_path)
    other = [*RUN, "--l3-dir", str(l3), "--page-size", "128"]
    code, summary, err = _serve(other)
    assert code == 1 and summary["phase"] == "refused"
    line = " ".join(e["message"] for e in summary["startup_errors"])
    assert "holds another deployment's data" in line and "page_size: 256 != 128" in line
    assert "--l3-reset" in line
    code, summary, err = _serve([*other, "--l3-reset"])
    assert code == 0, err


def test_a_corrupt_object_on_one_stage_is_a_counted_miss_and_the_stages_still_agree(first_run, tmp_path):
    l3 = _copy(first_run, tmp_path)
    assert corrupt_records(l3, ".p2.", ".swa.") > 0  # every SWA object of stage 2: one flipped byte each
    code, summary, err = _serve([*RUN, "--l3-dir", str(l3)])
    assert code == 0, err
    stages = {r["stage"]: r for r in summary["stages"]}
    assert stages[2]["l3"]["errors"]["corrupt"] > 0 and stages[2]["l3"]["fallback_pages"] > 0
    assert all(stages[k]["l3"]["errors"]["corrupt"] == 0 for k in (0, 1, 3))
    assert all(not any(r["disagreements"].values()) for r in summary["stages"])
    assert summary["ok"]  # every loaded page verified: nothing wrong ever reached a stage


def test_killing_the_mooncake_master_mid_run_keeps_serving_and_readyz_200(tmp_path, free_port):
    need_mooncake()
    master = MooncakeMaster()
    address = master.start()
    port = int(address.rsplit(":", 1)[1])
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    paced = [*SMALL, "--requests", "200", "--rate", "16", "--port", str(free_port),
             "--run-dir", str(run_dir), "--l3", "mooncake", "--l3-mooncake-master", address,
             "--hold-seconds", "60"]
    base = f"http://127.0.0.1:{free_port}"
    proc = start(paced, out)
    again = None
    try:
        def stages() -> dict[int, dict]:
            return {k: read_json(run_dir / f"stage-{k}.json") or {} for k in range(4)}

        wait_for(lambda: all(s.get("l3", {}).get("objects", {}).get("backup", 0) > 0
                             for s in stages().values()), 120, "L3 writes on every stage", proc, out)
        master.stop()  # by the pid it started

        def down() -> dict | None:
            r = httpx.get(f"{base}/readyz", timeout=5)
            body = r.json()
            return body if r.status_code == 200 and any(h["l3"] == "down" for h in body["stages"]) else None

        body = wait_for(down, 60, "/readyz 200 with L3 down", proc, out)
        assert body["ready"] and any("L3 down" in w for w in body["warnings"])
        served = sum(s.get("requests", 0) for s in stages().values())
        wait_for(lambda: sum(s.get("requests", 0) for s in stages().values()) > served + 8, 60,
                 "requests served while L3 is down", proc, out)
        again = MooncakeMaster(rpc_port=port)
        again.start()
        wait_for(lambda: all(s.get("l3", {}).get("up") for s in stages().values()), 60,
                 "L3 up again on every stage", proc, out)
        r = httpx.get(f"{base}/readyz", timeout=5)
        assert r.status_code == 200 and all(h["l3"] == "up" for h in r.json()["stages"])
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        final = stages()
    finally:
        stop(proc)
        master.stop()
        if again is not None:
            again.stop()
    assert all(s["l3"]["downs"] >= 1 for s in final.values())
    assert sum(s["l3"]["errors"]["failed"] + s["l3"]["skipped"] for s in final.values()) > 0
    assert all(not any(s["agreement"]["disagreements"].values()) for s in final.values())
    up = [line for line in metrics.splitlines() if line.startswith("stagecache_l3_up{")]
    assert len(up) == 4 and all('storage_backend="mooncake"' in x and x.endswith(" 1.0") for x in up)
