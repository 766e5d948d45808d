"""A real sglang 0.5.23 PP deployment over two hosts: link cut and restored, a rank killed, a clock off.

Two network namespaces joined by a veth pair are the two hosts (tests/support/netns.py; a third,
C, is an outsider on host A's network).  Four real sglang ranks on CPU, each a process of its
own (tests/support/sglang_rank_proc.py: sglang's distributed state over gloo, its own
``load_plugins()``, the real flash pool and the real ``build_deepseek_v4_hicache_stack``), ranks
0-1 on host A and 2-3 on host B, gloo over the veth link.  Rank 0 serves the deployment's one
endpoint on A; ranks 2-3 push to it by the advertised name ``stagecache-host-a``; Debian's
Prometheus runs on A and scrapes it by that name.  Host B's ranks run under libfaketime, rank 2's
wall clock 30 s ahead and rank 3's 30 s behind (the monotonic clock untouched), so one launch sees
both skews: no verdict may change.

Runs in the main environment as root (network namespaces); the ranks run in .venv-sglang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from netns import CUT_S, NAMES, Prometheus, Watch, stage_states, three_hosts, two_host_marks, wait
from sglang_env import checkout_on_path, sglang_python
from stagecache.runtime.defaults import SGLANG_PUSH_TIMEOUT_S
from stagecache.runtime.model.config_file import preset_text

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
PORT, PROM_PORT, MASTER_PORT = 18000, 19090, 29500
FLASH = "deepseek-v4-flash"

pytestmark = [pytest.mark.sglang_venv, *two_host_marks(420)]
#: Each of host B's ranks with its wall clock moved (libfaketime): one ahead, one behind.
SKEW = {2: "+30s", 3: "-30s"}


@pytest.fixture(scope="module")
def sglang_model(tmp_path_factory) -> tuple[Path, str, str]:
    """.venv-sglang's python, the PYTHONPATH of its processes (this checkout first) and the model
    folder sglang resolves offline (the flash preset's real ``config.json`` alone, as
    ``cpu_stage.model_dir`` makes it)."""
    python = sglang_python()
    tmp = tmp_path_factory.mktemp("sglang-model")
    folder = tmp / FLASH
    folder.mkdir()
    (folder / "config.json").write_text(preset_text(FLASH))
    return python, f"{checkout_on_path(tmp)}:{SUPPORT}", str(folder)


def test_sglang_pp4_over_two_hosts(tmp_path, sglang_model):
    python, path, folder = sglang_model
    with three_hosts() as hosts:
        ab, ba = hosts.link
        procs: dict[int, subprocess.Popen] = {}
        logs: dict[int, Path] = {}
        prom = None
        try:
            for rank in range(4):
                host = "a" if rank < 2 else "b"
                env = {**os.environ, "PYTHONPATH": path, "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2",
                       "STAGECACHE_SGLANG": "1", "STAGECACHE_SGLANG_DASHBOARD_PORT": str(PORT),
                       "STAGECACHE_SGLANG_DASHBOARD_HOST": hosts.addr["a"],
                       "STAGECACHE_SGLANG_ADVERTISE_HOST": NAMES["a"],
                       "GLOO_SOCKET_IFNAME": ab if host == "a" else ba}
                argv = [str(python), str(SUPPORT / "sglang_rank_proc.py"), "--rank", str(rank), "--pp", "4",
                        "--master", f"{NAMES['a']}:{MASTER_PORT}", "--model-dir", str(folder)]
                if rank >= 2:
                    argv.append("--traffic")
                logs[rank] = tmp_path / f"rank{rank}.log"
                with logs[rank].open("w") as out:
                    procs[rank] = subprocess.Popen(hosts.argv(host, argv, faketime=SKEW.get(rank)),
                                                   stdout=out, stderr=subprocess.STDOUT, env=env,
                                                   start_new_session=True)

            def line(rank: int) -> dict | None:
                for text in logs[rank].read_text(errors="replace").splitlines():
                    if text.startswith('{"rank"'):
                        return json.loads(text)
                if procs[rank].poll() is not None:
                    pytest.fail(f"rank {rank} exited {procs[rank].returncode}:\n{logs[rank].read_text()[-3000:]}")
                return None

            started = {r: wait(lambda r=r: line(r), 240, f"rank {r} built") for r in range(4)}
            assert all(s.get("built") for s in started.values()), started
            assert started[0]["url"] == f"http://{hosts.addr['a']}:{PORT}"
            assert started[2]["pushes_to"] == f"http://{NAMES['a']}:{PORT}/api/sglang/push"
            pids = {r: s["pid"] for r, s in started.items()}

            # -- one view across hosts -----------------------------------------------------
            # (the test's own threads resolve no namespace's /etc/hosts: address + the name in Host)
            watch = Watch(hosts, f"http://{hosts.addr['a']}:{PORT}", PORT)
            status, body = wait(lambda: (lambda r: r if r[0] == 200 else None)(watch.ready()), 30,
                                "/readyz 200 on host A", show=lambda: watch.last_ready)
            assert sorted(stage_states(body)) == [0, 1, 2, 3] and set(stage_states(body).values()) == {"up"}, body
            remote = {s["stage"]: s for s in body["stages"]}
            assert [remote[k]["remote"] for k in range(4)] == [False, True, True, True]
            assert remote[2]["host"] == remote[3]["host"] == hosts.addr["b"]
            assert remote[1]["host"] == hosts.addr["a"]
            # the dashboard's times are host A's, whatever B's clock says
            summary = json.loads(watch.get("/api/metrics/summary")[1])
            for s in summary["stages"]:
                assert abs(s["heartbeat_at"] - time.time()) < 5, (s["stage"], s["heartbeat_at"], time.time())
                if s["remote"]:
                    assert abs(s["time"] - time.time()) < 5, (s["stage"], s["time"], time.time())
            offsets = {s["stage"]: s["clock_offset_s"] for s in summary["stages"]}
            expect = {rank: -30.0 if s.startswith("+") else 30.0 for rank, s in SKEW.items()}
            assert abs(offsets[2] - expect[2]) < 3 and abs(offsets[3] - expect[3]) < 3, offsets
            assert abs(offsets[1]) < 3, offsets

            # Prometheus on host A scrapes the endpoint by its advertised name
            prometheus = Prometheus(hosts, tmp_path / "prom", PROM_PORT, PORT)
            prom, query = prometheus.proc, prometheus.query
            up = wait(lambda: (lambda r: r if len(r) == 4 else None)(query("stagecache_stage_up == 1")), 60,
                      "Prometheus on A sees 4 stages up")
            assert sorted(x["metric"]["pp_rank"] for x in up) == ["0", "1", "2", "3"]

            # -- refusals: an outsider on A's network ---------------------------------------
            from stagecache.runtime.serve.exchange import seal

            forged = seal(os.urandom(32), {"stage": 2, "seq": 10**9, "live": {"stage": 2}})
            status, text = hosts.http("c", f"http://{hosts.addr['a']}:{PORT}/api/sglang/push", data=forged,
                                      headers={"Host": f"{NAMES['a']}:{PORT}"})
            assert status == 403, (status, text)
            status, _ = hosts.http("c", f"http://{hosts.addr['a']}:{PORT}/readyz", headers={"Host": "evil.example"})
            assert status == 400
            assert hosts.http("c", f"http://{hosts.addr['a']}:{PORT}/healthz",
                              headers={"Host": f"{NAMES['a']}:{PORT}"})[0] == 200  # C does reach A

            # -- the link between the hosts cut for 20 s, then restored -------------------------
            hosts.set_link(False)
            cut = time.monotonic()
            status, body = wait(lambda: (lambda r: r if r[0] == 503 and {2, 3} <= {
                k for k, v in stage_states(r[1]).items() if v == "unreachable"} else None)(watch.ready()), 10,
                "/readyz 503 naming stages 2 and 3 unreachable")
            unreachable_after = time.monotonic() - cut
            assert stage_states(body) == {0: "up", 1: "up", 2: "unreachable", 3: "unreachable"}, body
            assert any(r.startswith("stage 2: unreachable") for r in body["reasons"]), body["reasons"]
            assert any(r.startswith("stage 3: unreachable") for r in body["reasons"]), body["reasons"]
            assert not any("crashed" in r for r in body["reasons"])
            ready_after, body = watch.through_cut(cut, 20)  # the whole gap: never crashed, never ready
            assert {s["stage"]: s["pid"] for s in body["stages"]} == pids  # nothing restarted
            assert all(p.poll() is None for p in procs.values())
            for _ in range(6):  # the counters go on growing, never backwards
                watch.ready()
                time.sleep(0.5)
            assert not watch.backwards, watch.backwards
            assert any(v > 0 for (n, labels), v in watch.last.items()
                       if n == "stagecache_prefix_lookup_tokens_total" and ("pp_rank", "2") in labels)
            # the dashboard marks the gap
            summary = json.loads(watch.get("/api/metrics/summary")[1])
            gaps = {o["stage"]: o for o in summary.get("outages", [])}
            assert {2, 3} <= set(gaps), summary.get("outages")
            assert gaps[2]["state"] == "unreachable" and gaps[2]["end"] is not None
            # the cut less the silence that makes a stage unreachable, less the verdicts' lag on a
            # loaded machine (the gap opens at a verdict, every 0.5 s at best, and closes at a push)
            silent_s = SGLANG_PUSH_TIMEOUT_S
            assert CUT_S - silent_s - 3 < gaps[2]["end"] - gaps[2]["start"] < CUT_S + 10, gaps[2]
            # Prometheus saw the gap (stage_up 0) and no counter reset
            assert query("min_over_time(stagecache_stage_up{pp_rank=\"2\"}[2m]) == 0")
            assert not query("resets(stagecache_prefix_lookup_tokens_total[5m]) > 0")

            # -- a rank killed on host B is named as such ----------------------------------------
            os.kill(pids[2], signal.SIGKILL)
            killed = time.monotonic()
            status, body = wait(lambda: (lambda r: r if stage_states(r[1]).get(2) == "crashed" else None)(watch.ready()),
                                10, "stage 2 named crashed")
            crashed_after = time.monotonic() - killed
            assert status == 503 and stage_states(body)[3] == "up", body
            reason = next(r for r in body["reasons"] if r.startswith("stage 2"))
            assert f"pid {pids[2]} is gone" in reason and "stage 3 on the same host" in reason, reason
            print(f"\nsglang two hosts, B's ranks {SKEW}: unreachable after {unreachable_after:.1f} s, "
                  f"ready after restore {ready_after:.1f} s, kill named after {crashed_after:.1f} s")
        finally:
            for p in [*procs.values(), prom]:
                if p is not None and p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
