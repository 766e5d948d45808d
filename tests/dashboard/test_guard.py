"""What a hostile client meets at the dashboard (``dashboard/guard.py``), on a real server.

Host header allowlist (DNS rebinding), HEAD on every GET route, a request-head deadline for
silent and half-sent connections, a cap on open connections that evicts the longest-waiting
idle one, and -- against a real ``stagecache serve`` -- 2,000 idle sockets held open by one
client while /healthz keeps answering fast and serve keeps running.
"""

from __future__ import annotations

import http.client
import resource
import signal
import socket
import statistics
import time

import httpx
import pytest
from plans import report
from stagecache.dashboard.app import create_app
from stagecache.dashboard.server import DashboardThread, bind_dashboard_socket
from stagecache.runtime.live.source import StaticSource

HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # no blank line: the head never ends


def _serving(**kw) -> DashboardThread:
    dash = DashboardThread(StaticSource(report("tiny-v4", 2)), bind_dashboard_socket("127.0.0.1", 0),
                           "t", **kw)
    dash.start()
    assert dash.server.started
    return dash


def _port(dash: DashboardThread) -> int:
    return dash.sock.getsockname()[1]


def _closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_only_this_servers_names_are_accepted_in_host():
    dash = _serving()
    port = _port(dash)
    try:
        url = f"http://127.0.0.1:{port}/healthz"
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST", "127.0.0.1"):
            assert httpx.get(url, headers={"Host": host}, timeout=5).status_code == 200, host
        for host in (f"evil.example:{port}", "attacker.test", f"127.0.0.2:{port}", "[::2]:80", "a:b:c"):
            r = httpx.get(url, headers={"Host": host}, timeout=5)
            assert r.status_code == 400, host
            assert r.text.startswith(f"Host {host!r} is not served here; allowed: 127.0.0.1, [::1], localhost")
    finally:
        dash.stop()


def test_head_is_answered_on_every_get_route_with_the_get_headers_and_no_body():
    dash = _serving()
    base = f"http://127.0.0.1:{_port(dash)}"
    app = create_app(StaticSource(report("tiny-v4", 2)))
    paths = [r.path.replace("{stage}", "0") for r in app.routes
             if "GET" in getattr(r, "methods", ()) and "{" not in r.path.replace("{stage}", "")]
    assert {"/", "/healthz", "/readyz", "/metrics", "/docs", "/redoc", "/api/stages"} <= set(paths)
    try:
        with httpx.Client(base_url=base, timeout=30) as c:
            for path in paths:
                get, head = c.get(path), c.head(path)
                assert head.status_code == get.status_code != 405, path
                assert head.content == b"", path
                assert head.headers.get("content-type") == get.headers.get("content-type"), path
    finally:
        dash.stop()


def test_a_silent_or_half_sent_connection_is_closed_at_the_head_deadline():
    dash = _serving(header_timeout_s=0.5, keep_alive_s=30)
    port = _port(dash)
    try:
        silent = socket.create_connection(("127.0.0.1", port))
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(HEAD)  # slowloris: a head that never ends
        t0 = time.monotonic()
        assert _closed_by_server(silent, 10) and _closed_by_server(slow, 10)
        assert 0.4 <= time.monotonic() - t0 < 5
        # after a response, the next head has the same deadline (keep-alive is 30 s here)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(HEAD + b"\r\n")
            answer = b""
            while not answer.endswith(b'"ok"}'):
                answer += s.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200")
            s.sendall(b"GET /he")
            assert _closed_by_server(s, 10)
        silent.close()
        slow.close()
    finally:
        dash.stop()


def test_past_the_connection_cap_the_longest_waiting_idle_connection_goes():
    dash = _serving()
    dash.server.config.http_protocol_class.max_connections = 8
    port = _port(dash)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        closed = [_closed_by_server(s, 5 if i < 13 else 0.05) for i, s in enumerate(idle)]
        assert all(closed[:13]) and not any(closed[13:])  # the oldest went first, the newest stay
    finally:
        for s in idle:
            s.close()
        dash.stop()


def _healthz_ms(port: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    t0 = time.perf_counter()
    conn.request("GET", "/healthz")
    resp = conn.getresponse()
    resp.read()
    conn.close()
    assert resp.status == 200
    return (time.perf_counter() - t0) * 1e3


def test_two_thousand_idle_sockets_do_not_starve_a_real_serve(tmp_path):
    from serve_helpers import start, stop, wait_for

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2300:
        pytest.skip(f"the fd hard limit ({hard}) is too low for 2,000 client sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2300), hard))
    out = tmp_path / "out.txt"
    proc = start(["--model", "tiny-v4", "--pp-size", "2", "--requests", "8", "--rate", "0",
                  "--hold-seconds", "300", "--port", "0", "--run-dir", str(tmp_path / "run")], out)
    held: list[socket.socket] = []
    try:
        line = wait_for(lambda: next((ln for ln in out.read_text().splitlines()
                                      if ln.startswith("dashboard serving")), None),
                        120, "the run to finish and the dashboard to hold", proc, out)
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        for i in range(2000):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 2:
                s.sendall(HEAD)
            held.append(s)
        # the first answer waits for the server to accept the burst (~0.5 ms a connection);
        # from then on the 2,000 sockets are only held open
        first = _healthz_ms(port)
        latencies = sorted(_healthz_ms(port) for _ in range(50))
        assert proc.poll() is None, out.read_text()
        print(f"/healthz with 2,000 idle sockets held: first (behind the burst) {first:.0f} ms; "
              f"then p50 {statistics.median(latencies):.1f} ms, p90 {latencies[44]:.1f} ms, "
              f"max {latencies[-1]:.1f} ms")
        # the figure is the typical answer (median); the slowest of 50 only has to stay
        # an answer (a host shared with other jobs delays single requests by a scheduler slice)
        assert first < 5000 and statistics.median(latencies) < 100 and latencies[-1] < 1000, latencies
        # past the cap (1,000) the oldest waiting sockets were closed at once; every other one
        # at its head deadline (10 s)
        deadline = time.monotonic() + 30
        assert all(_closed_by_server(s, max(0.01, deadline - time.monotonic())) for s in held)
        assert proc.poll() is None and _healthz_ms(port) < 1000
        assert stop(proc, signal.SIGINT) == 130  # Ctrl-C while holding a finished run: interrupted
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


#: 2,000 connections as fast as one client opens them, every other one with half a request head,
#: held open until the process is killed; prints how many it opened.
FLOOD = f"""
import resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (2300, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
for i in range(2000):
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
    if i % 2:
        s.sendall({HEAD!r})
    held.append(s)
print(len(held), flush=True)
time.sleep(600)
"""


def _fd_limit_1024() -> None:
    """``ulimit -n 1024`` in the child (soft and hard, as the shell sets them)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


#: The issue's figure: every /healthz probe from the first second of the flood on answers within this.
PROBE_MS = 100


@pytest.mark.alone
def test_under_ulimit_1024_a_flood_of_2000_idle_sockets_leaves_healthz_fast(tmp_path):
    """The issue's measurement: a real ``stagecache dashboard`` in a shell with ``ulimit -n 1024``,
    2,000 idle connections opened as fast as a client can (half with half-sent heads), and a
    /healthz probe every 50 ms for 12 s (the flood outnumbers the descriptors the process may
    open).  Before the gate, probes timed out for about 10 s.  Every probe from the first second on
    must answer within 100 ms.  That is a latency of the machine as much as of the server (a core
    taken by another job delays a probe by a scheduler slice), so the test is marked ``alone``:
    tests/run.sh runs it after the parallel run, with nothing else running."""
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2300:
        pytest.skip(f"the fd hard limit ({hard}) is too low for 2,000 client sockets")
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "stagecache.runtime", "dashboard", "--from-check",
                                 "--model", "tiny-v4", "--pp-size", "2", "--port", "0"],
                                stdout=f, stderr=subprocess.STDOUT, preexec_fn=_fd_limit_1024)
    flood: subprocess.Popen | None = None
    try:
        deadline = time.monotonic() + 60
        while "http://" not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        port = int(out.read_text().split("http://127.0.0.1:")[1].split("/")[0])
        assert _healthz_ms(port) < 1000
        # the flood from a process of its own, so that it never holds this one's GIL mid-probe
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(port)], stdout=subprocess.PIPE, text=True)
        probes: list[tuple[float, float | None]] = []
        t0 = time.monotonic()
        while (at := time.monotonic() - t0) < 12:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
            start_probe = time.perf_counter()
            try:
                conn.request("GET", "/healthz")
                resp = conn.getresponse()
                resp.read()
                ms = (time.perf_counter() - start_probe) * 1e3 if resp.status == 200 else None
            except OSError:
                ms = None
            finally:
                conn.close()
            probes.append((at, ms))
            time.sleep(max(0.0, 0.05 - (time.monotonic() - t0 - at)))
        assert flood.poll() is None and flood.stdout.readline().strip() == "2000", "the flood did not open 2,000"
        assert proc.poll() is None, out.read_text()[-2000:]
        late = [(round(at, 2), ms) for at, ms in probes if at >= 1.0 and (ms is None or ms > PROBE_MS)]
        worst = max((ms or 3000.0) for at, ms in probes if at >= 1.0)
        print(f"{len(probes)} probes; slowest from 1 s on: {worst:.1f} ms")
        assert not late, f"{len(late)} of {len(probes)} probes from 1 s on failed or took > {PROBE_MS} ms: {late[:10]}"
        assert "Too many open files" not in out.read_text()
    finally:
        if flood is not None:
            flood.kill()
            flood.wait(10)
        proc.terminate()
        proc.wait(10)


def _in_child(code: str) -> str:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_socket_budget_follows_the_descriptor_limit():
    """``ulimit -n 1024``: the limit less what the process holds and the reserve; a high limit:
    the connection cap plus the slack.  The connection cap is the slack below the budget."""
    first = _in_child("""
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
from stagecache.dashboard import guard
held = guard.open_fds()
print(guard.socket_budget(), held, guard.connection_cap(guard.socket_budget()))
""")
    budget, held, cap = map(int, first.split())
    from stagecache.dashboard.guard import ACCEPT_SLACK, FD_RESERVE, MAX_CONNECTIONS

    assert abs(budget - (1024 - held - FD_RESERVE)) <= 1 and cap == budget - ACCEPT_SLACK
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] >= 4096:  # room for the whole cap: all of it
        second = _in_child("from stagecache.dashboard import guard; print(guard.socket_budget())")
        assert int(second) == MAX_CONNECTIONS + ACCEPT_SLACK


def test_the_gate_accepts_up_to_its_budget_and_a_closed_socket_makes_room():
    from stagecache.dashboard.guard import GatedListener

    shed: list[int] = []
    with socket.create_server(("127.0.0.1", 0)) as sock:
        gate = GatedListener(sock, 3, lambda: shed.append(1) or False)
        gate.setblocking(False)
        clients = [socket.create_connection(sock.getsockname()) for _ in range(5)]
        time.sleep(0.1)  # every handshake done: the kernel's queue holds five
        accepted = [gate.accept()[0] for _ in range(3)]
        with pytest.raises(BlockingIOError):
            gate.accept()  # the budget is spent: nothing accepted, an idle one asked to go
        assert gate.accepted == 3 and shed == [1]
        accepted.pop().close()
        accepted.append(gate.accept()[0])  # room again
        del accepted[0]  # dropped without close(): the garbage collector's close counts too
        accepted.append(gate.accept()[0])
        assert gate.accepted == 3
        for s in accepted + clients:
            s.close()
        gate.close()
        assert gate.accepted == 0


def test_out_of_descriptors_the_gate_sheds_an_idle_connection_instead_of_pausing():
    """``EMFILE`` on accept: one idle connection is shed and accepting goes on at the next loop
    pass (``BlockingIOError``), where asyncio would stop accepting for a second; with nothing to
    shed, asyncio's own handling (the ``OSError``).  In a child: its descriptor limit is lowered."""
    out = _in_child("""
import errno, os, resource, socket, time
from stagecache.dashboard.guard import GatedListener
sock = socket.create_server(("127.0.0.1", 0))
accepted = []
def shed():
    if not accepted:
        return False
    accepted.pop(0).close()
    return True
gate = GatedListener(sock, 1000, shed)
gate.setblocking(False)
clients = [socket.create_connection(sock.getsockname()) for _ in range(12)]
time.sleep(0.1)
held = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
resource.setrlimit(resource.RLIMIT_NOFILE, (held + 3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
def step():
    try:
        accepted.append(gate.accept()[0])
        return "accepted"
    except BlockingIOError:
        return "shed"
    except OSError as exc:
        return errno.errorcode[exc.errno]
steps = [step() for _ in range(6)]
gate.shed = lambda: False
steps += [step() for _ in range(2)]
print(" ".join(steps))
""")
    assert out == "accepted accepted accepted shed accepted shed accepted EMFILE", out


def test_every_way_of_serving_accepts_through_the_gate_on_asyncios_loop():
    """``serve`` (``DashboardThread``: a pre-bound socket) and the sglang plugin
    (``dashboard_in_thread``: the server binds) both listen on a ``GatedListener``, on asyncio's
    own loop (uvloop accepts in C, around the gate)."""
    import threading

    from stagecache.dashboard.guard import GatedListener
    from stagecache.dashboard.server import make_server

    dash = _serving()
    try:
        assert dash.server.config.loop == "asyncio"
        assert [type(s) for s in dash.server.servers[0]._sockets] == [GatedListener]
    finally:
        dash.stop()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = make_server(StaticSource(report("tiny-v4", 2)), "127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.02)
        assert [type(s) for s in server.servers[0]._sockets] == [GatedListener]
        assert _healthz_ms(port) < 5000
    finally:
        server.should_exit = True
        thread.join(10)
