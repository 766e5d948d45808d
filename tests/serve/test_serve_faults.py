"""``stagecache serve`` under faults, seen from outside: exposure, stopped and killed stages, leftovers.

Real stage processes (gloo), real HTTP, real signals; each test starts the CLI
as a subprocess with a paced trace so the run is still going when the fault
is planted.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import (
    SMALL,
    alive,
    listening_sockets,
    process_tree,
    read_json,
    run_phase,
    stage_pids,
    start,
    stop,
    wait_for,
)

PACED = [a for a in SMALL]
PACED[PACED.index("--rate") + 1] = "4"
PACED[PACED.index("--requests") + 1] = "400"


def _serving(run_dir: Path, stage: int):
    def check():
        s = read_json(run_dir / f"stage-{stage}.json")
        return s if s and s.get("phase") == "serving" and s.get("steps", 0) >= 1 else None
    return check


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None


def _gauge(text: str, name: str, stage: int) -> float | None:
    """The value of ``name`` for PP rank ``stage`` in an exposition text (None: no such series)."""
    return next((s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                 if s.name == name and s.labels.get("pp_rank") == str(stage)), None)


def test_every_listening_socket_of_the_serve_tree_is_loopback(tmp_path, free_port):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    proc = start([*PACED, "--port", str(free_port), "--run-dir", str(run_dir)], out)
    try:
        for k in range(4):  # every stage past dist init and the first micro-batch
            wait_for(_serving(run_dir, k), 90, f"stage {k} to serve", proc, out)
        tree = process_tree(proc.pid)
        socks = listening_sockets(tree)
    finally:
        stop(proc)
    stages = set(stage_pids(run_dir))
    assert stages <= set(tree), "stage processes are not below the serve process"
    ports = {port for _, _, _, port in socks}
    assert free_port in ports  # the dashboard; the rendezvous is a file in the run dir, no port
    assert {pid for pid, *_ in socks} & stages, "no stage holds a (gloo) listener: test sees nothing"
    exposed = [s for s in socks if not ipaddress.ip_address(s[2]).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_sigstop_turns_readyz_503_and_stage_up_0_within_10s_then_back(tmp_path, free_port):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    base = f"http://127.0.0.1:{free_port}"
    proc = start([*PACED, "--port", str(free_port), "--run-dir", str(run_dir)], out)
    try:
        wait_for(lambda: (r := _get(f"{base}/readyz")) is not None and r.status_code == 200, 90,
                 "/readyz 200", proc, out)
        victim = read_json(run_dir / "stage-2.json")["pid"]
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            r = wait_for(lambda: (r := _get(f"{base}/readyz")) is not None and r.status_code == 503
                         and _gauge(_get(f"{base}/metrics").text, "stagecache_stage_up", 2) == 0 and r,
                         15, "/readyz 503 and stagecache_stage_up 0", proc, out)
            took = time.monotonic() - t0
            metrics = _get(f"{base}/metrics").text
        finally:
            os.kill(victim, signal.SIGCONT)
        wait_for(lambda: (r := _get(f"{base}/readyz")) is not None and r.status_code == 200, 15,
                 "/readyz 200 again after SIGCONT", proc, out)
    finally:
        stop(proc)
    assert took < 10, f"stopped stage noticed after {took:.1f} s"
    body = r.json()
    assert [h["up"] for h in body["stages"]] == [True, True, False, True]  # peers beat while waiting
    assert body["stages"][2]["reason"].startswith("no heartbeat for")
    assert _gauge(metrics, "stagecache_stage_up", 1) == 1
    assert _gauge(metrics, "stagecache_stage_last_heartbeat_timestamp_seconds", 2) < time.time() - 4
    assert f"stage 2 (pid {victim}): no heartbeat for" in out.read_text()


def test_a_dead_stage_leaves_the_dashboard_and_metrics_up_naming_it(tmp_path, free_port):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    base = f"http://127.0.0.1:{free_port}"
    proc = start([*PACED, "--port", str(free_port), "--run-dir", str(run_dir)], out)  # hold: until ^C
    try:
        victim = wait_for(_serving(run_dir, 1), 90, "stage 1 to serve", proc, out)["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: run_phase(run_dir) == "failed", 20, "the failure", proc, out)
        time.sleep(3)  # the dashboard must stay: the failure is what an operator comes to see
        ready, metrics, page = _get(f"{base}/readyz"), _get(f"{base}/metrics"), _get(f"{base}/")
        pids = stage_pids(run_dir)
        assert proc.poll() is None, "serve exited after the failure"
    finally:
        code = stop(proc, signal.SIGINT)
    assert code == 1, out.read_text()
    why = f"stage 1 (pid {victim}) exited with code -9 (was killed by SIGKILL)"
    assert ready.status_code == 503 and ready.json()["failure"] == why
    assert ready.json()["failed_stage"] == 1 and ready.json()["failed_at"] > time.time() - 60
    assert _gauge(metrics.text, "stagecache_stage_failed", 1) == 1
    assert _gauge(metrics.text, "stagecache_stage_failed", 0) == 0
    assert _gauge(metrics.text, "stagecache_stage_up", 1) == 0
    assert 'id="run-failure"' in page.text and why in page.text
    assert not [p for p in pids if alive(p)], "stage processes left behind"


def test_exit_on_error_exits_1_when_a_stage_dies(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    proc = start([*PACED, "--port", "0", "--run-dir", str(run_dir), "--exit-on-error"], out)
    try:
        victim = wait_for(_serving(run_dir, 2), 90, "stage 2 to serve", proc, out)["pid"]
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 1 and f"stage 2 (pid {victim}) exited with code -9" in out.read_text()
    assert "exiting: --exit-on-error" in out.read_text()


def test_a_killed_serve_leaves_a_run_dir_that_the_next_start_removes(tmp_path):
    env = {"TMPDIR": str(tmp_path), "XDG_RUNTIME_DIR": ""}  # the run root under $TMPDIR
    root = tmp_path / f"stagecache-serve-{os.getuid()}"
    out = tmp_path / "out1.txt"
    proc = start([*PACED, "--no-dashboard"], out, env=env)
    try:
        wait_for(lambda: "startup ok" in out.read_text(), 90, "startup", proc, out)
        [stale] = list(root.iterdir())
        pids = wait_for(lambda: len(p := stage_pids(stale)) == 4 and p, 30, "stage pids", proc, out)
        os.kill(proc.pid, signal.SIGKILL)  # no cleanup can run
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert stale.is_dir(), "the killed run's dir should still be there"
    wait_for(lambda: not [p for p in pids if alive(p)], 30, "the orphaned stages to exit")
    r = subprocess.run([sys.executable, "-m", "stagecache.runtime", "serve", *SMALL, "--requests", "4",
                        "--no-dashboard", "--exit-after-run"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **env})
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"removed 1 run dir(s) left by killed runs: {stale}" in r.stdout
    assert list(root.iterdir()) == [], "the second run's own dir must go at exit too"
