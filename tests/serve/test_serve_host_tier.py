"""``serve`` with planted host-tier faults, seen from outside: /readyz, /metrics and the stage files.

Stage 1 asks for pinned host memory where it is refused (this CPU host: torch's own refusal) and
falls back to pageable memory; stage 2 runs short of RAM after its first micro-batch.  The run
goes not ready naming stage 2 (exceeds_ram), lists stage 1's refusal as a warning, and the
healthy stages say ok; every stage reports the occupancy of each of its pool kinds.
"""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import SMALL, read_json, start, stop, wait_for
from stagecache.runtime.model.families.deepseek_v4 import HOST_CACHED

PACED = [a for a in SMALL]
PACED[PACED.index("--rate") + 1] = "4"
PACED[PACED.index("--requests") + 1] = "400"


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None


def _samples(text: str, name: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def test_host_tier_faults_turn_readyz_and_the_gauges(tmp_path: Path, free_port: int):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    base = f"http://127.0.0.1:{free_port}"
    proc = start([*PACED, "--port", str(free_port), "--run-dir", str(run_dir),
                  "--fault", "pin-refused@1", "--fault", "host-ram-short@2"], out)
    try:
        def short() -> httpx.Response | None:
            r = _get(f"{base}/readyz")
            return r if r is not None and r.status_code == 503 and any(
                "stage 2 host tier: host RAM short" in x for x in r.json()["reasons"]) else None

        r = wait_for(short, 90, "/readyz 503 naming stage 2's host tier", proc, out)
        metrics = _get(f"{base}/metrics").text
        stages = [read_json(run_dir / f"stage-{k}.json") for k in range(4)]
    finally:
        stop(proc)
    body = r.json()
    assert body["phase"] == "serving" and [h["up"] for h in body["stages"]] == [True] * 4
    assert body["reasons"] == [x for x in body["reasons"] if x.startswith("stage 2 host tier")]
    assert any(w.startswith("stage 1 host tier: pinned host memory refused (pin_memory=True requires")
               for w in body["warnings"])
    assert [h["host_tier"] for h in body["stages"]] == [["ok"], ["pin_refused"], ["exceeds_ram"], ["ok"]]
    states = {(s.labels["pp_rank"], s.labels["stagecache_host_tier_status"]): s.value
              for s in _samples(metrics, "stagecache_host_tier_status")}
    assert states["2", "exceeds_ram"] == 1 and states["2", "ok"] == 0
    assert states["1", "pin_refused"] == 1 and states["0", "ok"] == 1 and states["3", "exceeds_ram"] == 0
    avail = {s.labels["pp_rank"]: s.value for s in _samples(metrics, "stagecache_host_memory_available_bytes")}
    reserve = {s.labels["pp_rank"]: s.value for s in _samples(metrics, "stagecache_host_memory_reserve_bytes")}
    assert avail["2"] < reserve["2"] and avail["0"] > reserve["0"] > 0
    # occupancy: every kind the stage holds, device and host, from the stage's own allocators
    s1 = stages[1]
    assert not s1["host_tier"]["pinned"] and s1["host_tier"]["pin_error"]
    occ = {(o["pool"], o["tier"]): o for o in s1["pool_occupancy"]}
    assert {p for p, t in occ if t == "host"} == set(HOST_CACHED)
    assert occ["c128_state", "device"]["unit"] == "slot" and occ["c128_state", "device"]["capacity"] == 2
    assert occ["c128_state", "device"]["peak"] == 2  # --micro-batch 2: two requests at once
    space = s1["page_spaces"]["device"]
    assert occ["c4_indexer_state", "device"]["used"] == occ["swa", "device"]["used"]
    assert 0 < occ["indexer", "device"]["capacity"] == space["total"] == 24
    used = {s.labels["pool"]: s.value for s in _samples(metrics, "stagecache_pool_used_pages")
            if s.labels["pp_rank"] == "1" and s.labels["tier"] == "device"}
    assert set(used) == {p for p, t in occ if t == "device" and p != "c128_state"}
