"""``stagecache serve`` end to end: real stage processes (gloo), real HTTP scrape, real signals.

Each test starts the CLI as a subprocess on a free port with a small trace,
then looks at it from outside the way an operator would: /metrics, /startupz,
the run directory, exit codes, and which processes are still alive.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from metric_samples import sample_value, series_by_name
from serve_helpers import SMALL, alive, read_json, run_phase, stage_pids, start, stop, wait_for
from stagecache.exporters.families import all_families
from stagecache.runtime.cache.insight import MISS_REASONS
from stagecache.runtime.live.numbers import DECISION_NAMES

#: What serve exposes: every family but those of a compared sglang deployment (``deployment`` scope).
SERVE_METRIC_NAMES = tuple(f.name for scope, f in all_families() if scope != "deployment")
DEPLOYMENT_NAMES = {f.name for scope, f in all_families() if scope == "deployment"}


def _check_stage_series(smp: dict[str, list], st: str) -> None:
    """One stage's series after the SMALL trace: its map, requests, hits, transfers, pages, phase."""
    assert sample_value(smp, "stagecache_stage_local_layers", pp_rank=st) == 3
    assert sample_value(smp, "stagecache_stage_mapping_ok", pp_rank=st) == 1
    assert sample_value(smp, "stagecache_stage_mapping_errors", pp_rank=st) == 0
    assert sample_value(smp, "stagecache_stage_buffers", pp_rank=st, pool="swa") == 3
    for pool in ("swa", "c4", "c128", "c4_state", "c128_state", "indexer"):
        assert sample_value(smp, "stagecache_stage_buffers", pp_rank=st, pool=pool) == sample_value(
            smp, "stagecache_stage_expected_buffers", pp_rank=st, pool=pool)
    assert sample_value(smp, "stagecache_requests_total", pp_rank=st, model_name="tiny-v4") == 40
    lookups = sample_value(smp, "stagecache_prefix_lookup_tokens_total", pp_rank=st)
    hits = [sample_value(smp, "stagecache_prefix_hit_tokens_total", pp_rank=st, tier=t) for t in ("device", "host")]
    assert all(h > 0 for h in hits) and sum(hits) < lookups  # device hits, host hits and misses
    for d in ("d2h", "h2d"):
        assert sample_value(smp, "stagecache_transfers_total", pp_rank=st, direction=d) > 0
        # every pool kind the stage mirrors moved, queue wait and DMA time measured per kind
        pools = {s.labels["pool"] for s in smp["stagecache_transfer_bytes_total"]
                 if s.labels["pp_rank"] == st and s.labels["direction"] == d}
        assert {"swa", "c4"} <= pools and "all" not in pools, pools
        for pool in pools:
            assert sample_value(smp, "stagecache_transfer_bytes_total", pp_rank=st, direction=d, pool=pool) > 0
            assert sample_value(smp, "stagecache_transfer_dma_seconds_sum", pp_rank=st, direction=d, pool=pool) > 0
            assert sample_value(smp, "stagecache_transfer_queue_wait_seconds_sum", pp_rank=st, direction=d,
                                pool=pool) > 0
    assert sample_value(smp, "stagecache_page_space_capacity_pages", pp_rank=st, space="device") == 24
    assert sample_value(smp, "stagecache_page_space_used_pages", pp_rank=st, space="device") <= 24
    assert sample_value(smp, "stagecache_pool_bytes", pp_rank=st, pool="swa", tier="host") == 2 * sample_value(
        smp, "stagecache_pool_bytes", pp_rank=st, pool="swa", tier="device")
    assert sample_value(smp, "stagecache_stage_busy_seconds_total", pp_rank=st) > 0
    assert sample_value(smp, "stagecache_stage_phase", pp_rank=st, stagecache_stage_phase="done") == 1
    if st != "0":  # activations flow 0 -> 1 -> 2 -> 3
        assert sample_value(smp, "stagecache_activation_received_bytes_total", pp_rank=st) > 0


def test_serve_pp4_metrics_match_the_run(tmp_path, free_port):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    proc = start([*SMALL, "--port", str(free_port), "--run-dir", str(run_dir),
                  "--hold-seconds", "120", "--json"], out)
    try:
        wait_for(lambda: run_phase(run_dir) == "done", 80, "the trace to finish", proc, out)
        base = f"http://127.0.0.1:{free_port}"
        assert httpx.get(f"{base}/startupz", timeout=10).status_code == 200
        text = httpx.get(f"{base}/metrics", timeout=10).text
        live = httpx.get(f"{base}/api/metrics/summary", timeout=10).json()
        pids = stage_pids(run_dir)
    finally:
        code = stop(proc)
    assert code == 143, out.read_text()  # SIGTERM while holding the finished run
    smp = series_by_name(text)
    names = {n for n in smp}
    for name in SERVE_METRIC_NAMES:
        assert any(n == name or n.startswith(name + "_") for n in names), f"{name} missing from /metrics"
    compared = [n for n in names for d in DEPLOYMENT_NAMES if n == d or n.startswith(d + "_")]
    assert not compared, f"ranks compared where no sglang ranks are: {compared}"
    for st in ("0", "1", "2", "3"):
        _check_stage_series(smp, st)
    assert sample_value(smp, "stagecache_activation_sent_bytes_total", pp_rank="0") == sample_value(
        smp, "stagecache_activation_received_bytes_total", pp_rank="1")
    assert sample_value(smp, "stagecache_activation_sent_bytes_total", pp_rank="3") == 0
    # every stage took the same cache decisions on the same stream
    toks = {tuple(sample_value(smp, "stagecache_prefix_hit_tokens_total", pp_rank=st, tier=t)
                  for t in ("device", "host")) for st in ("0", "1", "2", "3")}
    assert len(toks) == 1
    # stage 0 and 3 differ in layers, so in bytes moved per page: the numbers are per stage, not copies
    def moved(st: str) -> float:
        return sum(s.value for s in smp["stagecache_transfer_bytes_total"]
                   if s.labels["pp_rank"] == st and s.labels["direction"] == "d2h")

    assert moved("0") != moved("3")
    _insight_of_a_clean_run(smp)
    # the dashboard's view of the same run: done, not live, and each stage's pipeline timeline
    assert live["run"]["phase"] == "done" and live["run"]["live"] is False
    kinds = {st["stage"]: {e["kind"] for e in st["timeline"]} for st in live["stages"]}
    assert all("compute" in k for k in kinds.values()), kinds
    assert all("recv_wait" in kinds[k] for k in (1, 2, 3)) and "recv_wait" not in kinds[0], kinds
    summary = json.loads(out.read_text()[out.read_text().index("{\n"):])
    assert summary["phase"] == "done" and summary["exit_code"] == code  # the process exit code
    assert [s["requests"] for s in summary["stages"]] == [40] * 4
    assert all(s["bubble_seconds"] >= 0 for s in summary["stages"])
    snap = read_json(run_dir / "snapshot.json")
    assert snap["startup"]["ok"] is True and set(snap["stages"]) == {"0", "1", "2", "3"}
    assert len(pids) == 4 and not any(alive(p) for p in pids)


def _insight_of_a_clean_run(smp: dict[str, list]) -> None:
    """Stage agreement and miss reasons of a clean run: every request compared, no stage ever
    disagrees, and per stage and tier the reasons sum exactly to the misses."""
    for st in ("0", "1", "2", "3"):
        assert all(sample_value(smp, "stagecache_stage_disagreements_total", pp_rank=st, kind=k) == 0
                   for k in DECISION_NAMES)
        assert sample_value(smp, "stagecache_stage_compared_requests_total", pp_rank=st) == 40
        hits = {t: sample_value(smp, "stagecache_prefix_hit_tokens_total", pp_rank=st, tier=t) for t in ("device", "host")}
        misses = sample_value(smp, "stagecache_prefix_lookup_tokens_total", pp_rank=st) - sum(hits.values())
        reasons = {t: {r: sample_value(smp, "stagecache_prefix_miss_tokens_total", pp_rank=st, tier=t, reason=r)
                       for r in MISS_REASONS} for t in ("device", "host")}
        assert sum(reasons["host"].values()) == misses > 0
        assert sum(reasons["device"].values()) == misses + hits["host"]
        assert reasons["device"]["evicted_from_device"] == hits["host"] > 0
        assert reasons["host"]["stage_disagreement"] == 0 and reasons["host"]["never_seen"] > 0
        # lifetimes: device pages were evicted, and both tiers were hit again
        for name in ("lifetime", "idle"):
            assert sample_value(smp, f"stagecache_cache_entry_{name}_seconds_count", pp_rank=st, tier="device") > 0
        for tier in ("device", "host"):
            assert sample_value(smp, "stagecache_cache_entry_reuse_gap_seconds_count", pp_rank=st, tier=tier) > 0


def test_serve_global_swa_refuses_and_startupz_shows_errors(tmp_path, free_port):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    proc = start([*SMALL, "--fault", "global-swa", "--port", str(free_port), "--run-dir", str(run_dir),
                  "--hold-seconds", "120"], out)
    base = f"http://127.0.0.1:{free_port}"

    def failed_startupz():
        try:
            r = httpx.get(f"{base}/startupz", timeout=5)
        except httpx.HTTPError:
            return None
        return r if r.status_code == 503 and r.json().get("status") == "failed" else None

    try:
        r = wait_for(failed_startupz, 80, "/startupz to report the failure", proc, out)
        metrics = series_by_name(httpx.get(f"{base}/metrics", timeout=10).text)
        wait_for(lambda: "not serving traffic" in out.read_text(), 20, "the printed errors", proc, out)
    finally:
        code = stop(proc)
    stages = read_json(run_dir / "run.json")
    errors = r.json()["errors"]
    swa = sorted((e["stage"], e["expected"], e["got"]) for e in errors if e["pool"] == "swa")
    assert swa == [(s, 3, 12) for s in range(4)]
    text = out.read_text()
    for s in range(4):
        assert f"[stage {s}] pool=swa expected=3 got=12" in text
    assert "SWA KV pool must be PP-stage-local" in text
    assert code == 1, text  # refused to serve
    assert sample_value(metrics, "stagecache_stage_mapping_ok", pp_rank="2") == 0
    assert sample_value(metrics, "stagecache_stage_buffers", pp_rank="2", pool="swa") == 12
    assert sample_value(metrics, "stagecache_startup_ok") == 0
    # no request was served by any stage
    assert all(s.value == 0 for s in metrics.get("stagecache_requests_total", []))
    assert stages["phase"] == "refused"


def test_serve_exit_on_error_exits_1(tmp_path):
    out = tmp_path / "out.txt"
    proc = start([*SMALL, "--fault", "global-swa", "--port", "0", "--exit-on-error"], out)
    try:
        code = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("serve --exit-on-error did not exit")
    text = out.read_text()
    assert code == 1, text
    assert "[stage 3] pool=swa expected=3 got=12" in text


def test_serve_killed_stage_stops_the_run_naming_it(tmp_path, free_port):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    # a paced, long trace so the run is still going when the stage is killed
    args = [a for a in SMALL]
    args[args.index("--rate") + 1] = "4"
    args[args.index("--requests") + 1] = "400"
    proc = start([*args, "--port", str(free_port), "--run-dir", str(run_dir), "--exit-after-run"], out)
    try:
        def serving():
            s = read_json(run_dir / "stage-2.json")
            return s if s and s.get("phase") == "serving" and s.get("steps", 0) >= 1 else None

        victim = wait_for(serving, 80, "stage 2 to serve", proc, out)["pid"]
        pids = stage_pids(run_dir)
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        code = proc.wait(30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text()
    assert code == 1, text
    assert f"stage 2 (pid {victim}) exited with code -9" in text
    assert took < 30
    time.sleep(0.5)
    assert not [p for p in pids if alive(p)], "stage processes left behind"
    assert run_phase(run_dir) == "failed"


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--page-size", "100"], "--page-size 100 must be a multiple of 128"),
    (["--device-pages", "4"], "raise --device-pages"),
    (["--fault", "bogus"], "unknown --fault 'bogus'"),
    (["--pp-size", "13"], "larger than the model's 12 layers"),
    (["--device-pages", "200000"], "pools together need"),
    (["--rate", "0.01"], "raise --dist-timeout or --rate"),
    (["--trace", "/nonexistent/trace.jsonl"], "no such file"),
])
def test_serve_bad_input_exits_2_with_one_line(args, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "stagecache.runtime", "serve", "--port", "0", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_serve_port_in_use_exits_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "stagecache.runtime", "serve", "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"cannot bind the dashboard to 127.0.0.1:{port}" in r.stderr


def test_serve_sigterm_mid_run_stops_every_stage(tmp_path, free_port):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    args = [a for a in SMALL]
    args[args.index("--rate") + 1] = "4"
    args[args.index("--requests") + 1] = "400"
    proc = start([*args, "--port", str(free_port), "--run-dir", str(run_dir)], out)
    try:
        wait_for(lambda: (read_json(run_dir / "stage-0.json") or {}).get("phase") == "serving", 80,
                 "stage 0 to serve", proc, out)
        pids = stage_pids(run_dir)
        assert len(pids) == 4 and all(alive(p) for p in pids)
    finally:
        code = stop(proc, signal.SIGTERM, timeout=20)
    assert code == 143, out.read_text()
    assert "interrupted by SIGTERM: stopped all stage processes" in out.read_text()
    assert not [p for p in pids if alive(p)], "stage processes left behind"
    if os.path.isdir("/dev/shm"):  # other suites may use /dev/shm at the same time: only ours count
        ours = [n for n in set(os.listdir("/dev/shm")) - shm_before
                if any(str(p) in n for p in [*pids, proc.pid])]
        assert not ours, f"leaked shared memory: {ours}"


def test_serve_malformed_trace_exits_2_listing_the_lines(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"session": "a", "turn": 0, "input_len": 300, "output_len": 8}\n'
                     '{"session": "a", "turn": 1, "input_len": 0, "output_len": 8}\n'
                     'not json\n')
    r = subprocess.run([sys.executable, "-m", "stagecache.runtime", "serve", "--port", "0",
                        "--trace", str(trace)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "2 malformed line(s)" in r.stderr and f"{trace}:2: " in r.stderr and f"{trace}:3: " in r.stderr
