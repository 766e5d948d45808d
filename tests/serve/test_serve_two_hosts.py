"""``stagecache serve`` over two hosts: the real CLI on four nodes, link cut and restored, a stage
killed, clocks on host B 30 s ahead and 30 s behind.

Hosts are network namespaces joined by a veth pair (tests/support/netns.py); C is an outsider
on host A's network.  Every node runs the same command except ``--node-rank`` and
``--dist-host``, one stage each: nodes 0-1 on A (node 0: the hub, the dashboard), 2-3 on B under
libfaketime, node 2's wall clock 30 s ahead and node 3's 30 s behind (the monotonic clock
untouched), so one launch sees both skews.  Debian's Prometheus on A scrapes the dashboard by the
name ``stagecache-host-a``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from netns import NAMES, Prometheus, Watch, stage_states, three_hosts, two_host_marks, wait

PORT, PROM_PORT, HUB_PORT = 18000, 19090, 29400

pytestmark = two_host_marks(400)
#: Each node's host, and the wall clock of host B's nodes (libfaketime): one ahead, one behind.
HOST = {0: "a", 1: "a", 2: "b", 3: "b"}
SKEW = {2: "+30s", 3: "-30s"}


def test_serve_pp4_over_two_hosts(tmp_path):
    with three_hosts() as hosts:
        secret = tmp_path / "secret"
        secret.write_bytes(os.urandom(32))
        secret.chmod(0o600)
        ab, _ = hosts.link
        common = ["--model", "tiny-v4", "--pp-size", "4", "--rate", "2", "--requests", "400",
                  "--micro-batch", "2", "--device-pages", "24", "--nnodes", "4", "--master-addr", NAMES["a"],
                  "--master-port", str(HUB_PORT), "--secret-file", str(secret),
                  "--dist-timeout", "90"]
        node = {n: common + ["--node-rank", str(n), "--dist-host", hosts.addr[HOST[n]], "--no-dashboard"]
                for n in range(1, 4)}
        node[0] = common + ["--node-rank", "0", "--dist-host", hosts.addr["a"], "--host", hosts.addr["a"],
                            "--port", str(PORT), "--allow-host", NAMES["a"]]
        procs: dict[int, subprocess.Popen] = {}
        logs = {n: tmp_path / f"node{n}.log" for n in node}
        prom = None
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            for n, args in node.items():
                with logs[n].open("w") as out:
                    procs[n] = subprocess.Popen(
                        hosts.argv(HOST[n], [sys.executable, "-m", "stagecache.runtime", "serve", *args],
                                   faketime=SKEW.get(n)),
                        stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

            def tails() -> str:
                return "\n".join(f"--- node {n}:\n{logs[n].read_text(errors='replace')[-3000:]}" for n in logs)

            watch = Watch(hosts, f"http://{hosts.addr['a']}:{PORT}", PORT)

            def ready():
                for n, p in procs.items():
                    if p.poll() is not None:
                        pytest.fail(f"node {n} exited {p.returncode}:\n{tails()}")
                r = watch.ready()
                return r if r[0] == 200 else None

            status, body = wait(ready, 180, "/readyz 200 with every node", show=lambda: (watch.last_ready, tails()))
            st = {s["stage"]: s for s in body["stages"]}
            assert [st[k]["remote"] for k in range(4)] == [False, True, True, True], body
            pids = {k: st[k]["pid"] for k in range(4)}
            summary = json.loads(watch.get("/api/metrics/summary")[1])
            expect = {n: -30.0 if skew.startswith("+") else 30.0 for n, skew in SKEW.items()}
            for s in summary["stages"]:
                assert abs(s["heartbeat_at"] - time.time()) < 5, (s["stage"], s["heartbeat_at"])
                assert abs(s["clock_offset_s"] - expect.get(s["stage"], 0.0)) < 3, (s["stage"], s["clock_offset_s"])
                if s["remote"]:
                    assert abs(s["time"] - time.time()) < 5

            # Prometheus on A, by the advertised name
            prometheus = Prometheus(hosts, tmp_path / "prom", PROM_PORT, PORT)
            prom, query = prometheus.proc, prometheus.query
            up = wait(lambda: (lambda r: r if len(r) == 4 else None)(query("stagecache_stage_up == 1")), 60,
                      "Prometheus on A sees 4 stages up")
            assert sorted(x["metric"]["pp_rank"] for x in up) == ["0", "1", "2", "3"]

            # refusals from C: the hub without the secret, junk to its port, a foreign Host
            from stagecache.runtime.serve.nodes import HubRefused, connect

            def join(secret_bytes: bytes, fp: str) -> str:
                def go():
                    try:
                        connect((hosts.addr["a"], HUB_PORT), secret_bytes, fp, timeout=5).sock.close()
                        return "joined"
                    except HubRefused as exc:
                        return f"refused: {exc}"
                    except (OSError, ConnectionError) as exc:
                        return f"closed: {exc}"
                return hosts._pool("c").submit(go).result(20)

            assert not join(os.urandom(32), "x").startswith("joined")
            junk = hosts.connect("c", (hosts.addr["a"], HUB_PORT))
            junk.settimeout(8)
            try:
                junk.recv(64)  # the hub's nonce
                junk.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(100))
                assert junk.recv(64) == b""  # closed, nothing answered
            except (TimeoutError, ConnectionResetError):
                pass
            finally:
                junk.close()
            assert hosts.http("c", f"http://{hosts.addr['a']}:{PORT}/readyz", headers={"Host": "evil.example"})[0] == 400

            # the link cut for 20 s, then restored
            hosts.set_link(False)
            cut = time.monotonic()
            status, body = wait(lambda: (lambda r: r if r[0] == 503 and {2, 3} <= {
                k for k, v in stage_states(r[1]).items() if v == "unreachable"} else None)(watch.ready()), 10,
                "/readyz 503 naming stages 2 and 3 unreachable", show=lambda: watch.last_ready)
            unreachable_after = time.monotonic() - cut
            assert stage_states(body)[2] == stage_states(body)[3] == "unreachable", body
            assert any(r.startswith("stage 2: unreachable") for r in body["reasons"]), body["reasons"]
            ready_after, body = watch.through_cut(cut, 30, show=lambda: (watch.last_ready, tails()))
            assert {s["stage"]: s["pid"] for s in body["stages"]} == pids  # nothing restarted
            for _ in range(6):
                watch.ready()
                time.sleep(0.5)
            assert not watch.backwards, watch.backwards
            summary = json.loads(watch.get("/api/metrics/summary")[1])
            gaps = {o["stage"]: o for o in summary["outages"]}
            assert {2, 3} <= set(gaps) and gaps[2]["state"] == "unreachable" and gaps[2]["end"], summary["outages"]
            assert query("min_over_time(stagecache_stage_up{pp_rank=\"2\"}[3m]) == 0")
            assert not query("resets(stagecache_requests_total[5m]) > 0")

            # a stage killed on host B is named as such
            os.kill(pids[2], signal.SIGKILL)
            killed = time.monotonic()
            status, body = wait(lambda: (lambda r: r if stage_states(r[1]).get(2) == "crashed" else None)(watch.ready()),
                                10, "stage 2 named crashed", show=lambda: watch.last_ready)
            crashed_after = time.monotonic() - killed
            reason = next(r for r in body["reasons"] if r.startswith("stage 2"))
            assert "exited with code -9" in reason, reason
            print(f"\nserve two hosts: unreachable after {unreachable_after:.1f} s, "
                  f"ready after restore {ready_after:.1f} s, kill named after {crashed_after:.1f} s")
        finally:
            for p in [*procs.values(), prom]:
                if p is not None and p.poll() is None:
                    with_group = p.pid
                    os.killpg(with_group, signal.SIGTERM)
                    try:
                        p.wait(15)
                    except subprocess.TimeoutExpired:
                        os.killpg(with_group, signal.SIGKILL)
                        p.wait(5)

