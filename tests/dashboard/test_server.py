"""The dashboard's HTTP server as ``serve`` runs it: TCP_NODELAY on accepted connections, idle
keep-alive connections closed, a loud warning for a non-loopback ``--host``.

Latency itself is measured by ``stagecache bench http`` (docs/serve.md), not here.
"""

from __future__ import annotations

import select
import socket
import time

import pytest
from stagecache.dashboard.server import DashboardThread, bind_dashboard_socket
from stagecache.runtime.live.source import StaticSource
from stagecache.runtime.net import exposure_warning, is_loopback


def _serving(keep_alive_s: float = 5.0) -> DashboardThread:
    dash = DashboardThread(StaticSource(None), bind_dashboard_socket("127.0.0.1", 0), "t",
                           keep_alive_s=keep_alive_s)
    dash.start()
    assert dash.server.started
    return dash


def _request(s: socket.socket) -> bytes:
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b'"ok"}'):
        chunk = s.recv(4096)
        assert chunk, "server closed the connection before answering"
        data += chunk
    return data


def test_every_accepted_connection_has_tcp_nodelay():
    dash = _serving()
    try:
        assert dash.sock.proto == socket.IPPROTO_TCP
        with socket.create_connection(("127.0.0.1", dash.sock.getsockname()[1])) as s:
            assert _request(s).startswith(b"HTTP/1.1 200")
            conns = list(dash.server.server_state.connections)
            assert len(conns) == 1
            server_side = conns[0].transport.get_extra_info("socket")
            assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        dash.stop()


def test_an_idle_keep_alive_connection_is_closed_by_the_server():
    dash = _serving(keep_alive_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", dash.sock.getsockname()[1])) as s:
            _request(s)
            _request(s)  # still open right after a response: keep-alive works
            t0 = time.monotonic()
            ready, _, _ = select.select([s], [], [], 10)
            assert ready and s.recv(1) == b"", "idle connection not closed within 10 s"
            assert time.monotonic() - t0 >= 0.4  # closed for idleness, not right away
    finally:
        dash.stop()


def test_loopback_is_told_apart_from_every_other_bind_address():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert is_loopback(host) and exposure_warning("--host", host, "x") is None, host
    for host in ("0.0.0.0", "", "::", "192.0.2.1"):
        warning = exposure_warning("--host", host, "the dashboard")
        assert warning and warning.startswith("WARNING: --host") and "no authentication" in warning


def test_serve_warns_for_every_listener_that_is_not_loopback():
    """Checked on the options (tests bind loopback only); serve prints each on stderr."""
    from stagecache.runtime.cli.main import build_parser
    from stagecache.runtime.cli.serve import exposure_warnings, options_from_args

    def warnings(*argv: str) -> list[str]:
        return exposure_warnings(options_from_args(build_parser().parse_args(
            ["serve", "--requests", "8", *argv])))

    assert warnings() == []
    assert warnings("--host", "localhost", "--dist-host", "::1") == []
    [host] = warnings("--host", "0.0.0.0")
    assert host.startswith("WARNING: --host 0.0.0.0 is not a loopback address")
    assert warnings("--host", "0.0.0.0", "--no-dashboard") == []  # nothing listens there then
    own = _own_address()
    if own is None:
        pytest.skip("this machine has no non-loopback address to try --dist-host with")
    [dist] = warnings("--dist-host", own)
    assert dist.startswith(f"WARNING: --dist-host {own} is not a loopback address") and "data plane" in dist


def _own_address() -> str | None:
    """A non-loopback address of this machine (the one a UDP socket would send from), if any."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: connect only picks the source address
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if is_loopback(addr) else addr


def _watch_threads(dash: DashboardThread) -> list:
    """The threads judging ``dash``'s source (``Reader.watch``)."""
    import threading

    reader = dash.server.config.app.app.state.reader
    watching = reader._watching
    return [t for t in threading.enumerate() if watching is not None and t is watching[1]]


def test_a_stopped_dashboard_leaves_no_thread_reading_its_source():
    dash = _serving()
    reader = dash.server.config.app.app.state.reader
    try:
        assert len(_watch_threads(dash)) == 1 and _watch_threads(dash)[0].is_alive()
        thread = reader._watching[1]
    finally:
        dash.stop()
    assert reader._watching is None and not thread.is_alive()


#: A process whose dashboard reader is mid-reading when the interpreter exits.
_EXIT_MID_READING = """
import sys, time
from stagecache.dashboard.reader import Reader
from stagecache.runtime.live.source import StaticSource

log = open(sys.argv[1], "a", buffering=1)

class SlowSource(StaticSource):
    def stages(self):
        log.write("start\\n")
        time.sleep(0.5)  # a reading in progress (sglang's pools: torch calls)
        log.write("end\\n")
        return {}

reader = Reader(SlowSource(None))
reader.watch(interval_s=0.01)
while "start" not in open(sys.argv[1]).read():
    time.sleep(0.01)
"""


def test_the_interpreter_waits_for_a_reading_in_progress_before_it_exits(tmp_path):
    """A daemon thread still reading at interpreter exit is killed where it stands (in torch's C++
    code for sglang's pools, which aborts the process): the reader stops and joins it first."""
    import subprocess
    import sys

    log = tmp_path / "log"
    log.write_text("")
    proc = subprocess.run([sys.executable, "-c", _EXIT_MID_READING, str(log)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().split()
    assert lines and lines[0] == "start" and lines.count("start") == lines.count("end"), lines
