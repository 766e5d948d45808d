"""Three hosts on one machine: network namespaces joined by veth pairs (root only).

::

    host A (stagecache-host-a)  10.231.1.1 ==veth== 10.231.1.2  host B (stagecache-host-b)
                                10.231.2.1 ==veth== 10.231.2.2  host C (stagecache-host-c, an outsider)

A and B are the deployment's two hosts; the A-B link is the one the tests cut.  C is joined to
A only: a third machine on A's network, without the deployment's secret.  Every address lives
inside the namespaces -- nothing outside them is ever addressed -- and each namespace gets its
own ``/etc/netns/<ns>/hosts`` (``ip netns exec`` mounts it over ``/etc/hosts``), so the hosts
reach each other by name.  Everything is removed when the fixture ends, also after a failure.

The test process itself stays in the root namespace; ``Hosts.http`` runs a request from a thread
that entered a namespace (``setns`` moves only the calling thread), so the test talks to host A
as a client on host A would.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

IP = shutil.which("ip") or "/usr/sbin/ip"
CLONE_NEWNET = 0x40000000
SUBNET_AB, SUBNET_AC = "10.231.1", "10.231.2"
NAMES = {"a": "stagecache-host-a", "b": "stagecache-host-b", "c": "stagecache-host-c"}
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
#: Seconds the two-host tests cut the A-B link for.
CUT_S = 20.0


def two_host_marks(timeout: int) -> list:
    """A two-host test module's ``pytestmark``: its time limit and a skip without libfaketime (the
    tests move host B's wall clocks, process by process)."""
    return [pytest.mark.timeout(timeout), pytest.mark.skipif(
        not os.path.exists(FAKETIME_LIB), reason=f"no {FAKETIME_LIB} (Debian package libfaketime)")]


class Prometheus:
    """Prometheus on host A (``proc``, its own session), scraping A's advertised name on
    ``target_port`` every second and answering on ``port``."""

    def __init__(self, hosts: Hosts, folder: Path, port: int, target_port: int):
        self.hosts, self.port = hosts, port
        folder.mkdir()
        (folder / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"scrape_configs: [{{job_name: stagecache, static_configs: [{{targets: ['{NAMES['a']}:{target_port}']}}]}}]\n")
        self.proc = subprocess.Popen(
            hosts.argv("a", [PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}",
                             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address={hosts.addr['a']}:{port}"]),
            stdout=(folder / "log").open("w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=folder)

    def query(self, q: str) -> list:
        """An instant query: its result ([] until Prometheus answers)."""
        from urllib.parse import quote

        status, body = self.hosts.http("a", f"http://{self.hosts.addr['a']}:{self.port}/api/v1/query?query={quote(q)}")
        return json.loads(body)["data"]["result"] if status == 200 else []


def skip_reason() -> str | None:
    """Why these tests cannot run here (one line), or None."""
    if os.geteuid() != 0:
        return "two-host tests need root (network namespaces); skipped"
    if not os.access(IP, os.X_OK):
        return f"no {IP} (Debian package iproute2, tests/setup.d/10-system-packages.sh)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, timeout=20, check=check)


@dataclass
class Hosts:
    """The namespaces of one test: ``ns["a"|"b"|"c"]`` and their addresses."""

    tag: str
    ns: dict[str, str] = field(default_factory=dict)
    addr: dict[str, str] = field(default_factory=dict)
    _pools: dict[str, concurrent.futures.ThreadPoolExecutor] = field(default_factory=dict)

    @property
    def link(self) -> tuple[str, str]:
        """The A-B veth ends (in A, in B)."""
        return f"scab{self.tag}", f"scba{self.tag}"

    def create(self) -> Hosts:
        self.ns = {h: f"stagecache-{self.tag}-{h}" for h in "abc"}
        self.addr = {"a": f"{SUBNET_AB}.1", "b": f"{SUBNET_AB}.2", "c": f"{SUBNET_AC}.2", "a_c": f"{SUBNET_AC}.1"}
        for h in "abc":
            _ip("netns", "add", self.ns[h])
            _ip("-n", self.ns[h], "link", "set", "lo", "up")
            folder = Path("/etc/netns") / self.ns[h]
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(
                "127.0.0.1 localhost\n"
                f"{self.addr['a']} {NAMES['a']}\n{self.addr['b']} {NAMES['b']}\n{self.addr['c']} {NAMES['c']}\n")
        ab, ba = self.link
        ac, ca = f"scac{self.tag}", f"scca{self.tag}"
        _ip("link", "add", ab, "netns", self.ns["a"], "type", "veth", "peer", "name", ba, "netns", self.ns["b"])
        _ip("link", "add", ac, "netns", self.ns["a"], "type", "veth", "peer", "name", ca, "netns", self.ns["c"])
        for ns, dev, cidr in ((self.ns["a"], ab, f"{self.addr['a']}/24"), (self.ns["b"], ba, f"{self.addr['b']}/24"),
                              (self.ns["a"], ac, f"{self.addr['a_c']}/24"), (self.ns["c"], ca, f"{self.addr['c']}/24")):
            _ip("-n", ns, "addr", "add", cidr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        # C reaches A's deployment address (10.231.1.1) through A's C-side address: A answers for
        # its own addresses on any interface, and does not forward, so C never reaches B
        _ip("-n", self.ns["c"], "route", "add", f"{SUBNET_AB}.0/24", "via", self.addr["a_c"])
        return self

    def remove(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for h in "abc":
            if h in self.ns:
                _ip("netns", "del", self.ns[h], check=False)  # removes its veth ends too
                shutil.rmtree(Path("/etc/netns") / self.ns[h], ignore_errors=True)

    # -- the A-B link -----------------------------------------------------------------------------
    def set_link(self, up: bool) -> None:
        ab, ba = self.link
        state = "up" if up else "down"
        _ip("-n", self.ns["a"], "link", "set", ab, state)
        _ip("-n", self.ns["b"], "link", "set", ba, state)

    # -- processes and requests inside a namespace --------------------------------------------------
    def argv(self, host: str, argv: list[str], *, faketime: str | None = None) -> list[str]:
        """``argv`` run on ``host``; ``faketime``: its wall clock moved (``"+30s"``, libfaketime)."""
        env = []
        if faketime:
            here = Path(__file__).resolve().parent / "faketime_site"
            env = ["env", f"LD_PRELOAD={FAKETIME_LIB}", f"FAKETIME={faketime}", "FAKETIME_DONT_FAKE_MONOTONIC=1",
                   "FAKETIME_NO_CACHE=1",
                   f"PYTHONPATH={here}:{os.environ.get('PYTHONPATH', '')}".rstrip(":")]
        return [IP, "netns", "exec", self.ns[host], *env, *argv]

    def _pool(self, host: str) -> concurrent.futures.ThreadPoolExecutor:
        if host not in self._pools:
            path = f"/run/netns/{self.ns[host]}"

            def enter() -> None:
                libc = ctypes.CDLL(None, use_errno=True)
                fd = os.open(path, os.O_RDONLY)
                try:
                    if libc.setns(fd, CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns {path}")
                finally:
                    os.close(fd)

            self._pools[host] = concurrent.futures.ThreadPoolExecutor(1, initializer=enter)
        return self._pools[host]

    def http(self, host: str, url: str, *, data: bytes | None = None, headers: dict[str, str] | None = None,
             timeout: float = 15.0) -> tuple[int, bytes]:
        """(status, body) of one request sent from ``host``; (0, error) when nothing answered within
        ``timeout`` (15 s: the suite's other workers share the cores with the ranks that answer;
        a refusal once took over 5 s to come under four workers on 2 cores)."""
        def go() -> tuple[int, bytes]:
            req = urllib.request.Request(url, data=data, headers=headers or {},
                                         method="POST" if data is not None else "GET")
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (http only)
                    return resp.status, resp.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read()
            except (OSError, urllib.error.URLError) as exc:
                return 0, str(exc).encode()
        return self._pool(host).submit(go).result(timeout + 5)

    def connect(self, host: str, address: tuple[str, int], timeout: float = 5.0):
        """A TCP socket connected from ``host`` (usable from any thread afterwards)."""
        import socket

        def go():
            return socket.create_connection(address, timeout=timeout)
        return self._pool(host).submit(go).result(timeout + 5)


@contextlib.contextmanager
def three_hosts() -> Iterator[Hosts]:
    """A, B and C for one test; removed afterwards (``pytest.skip`` with one line without root)."""
    why = skip_reason()
    if why:
        pytest.skip(why)
    hosts = Hosts(secrets.token_hex(3))
    try:
        yield hosts.create()
    finally:
        hosts.remove()


def wait(pred, timeout: float, what: str, every: float = 0.2, show=None):
    """Poll ``pred`` until truthy; its value, or fail naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(every)
    pytest.fail(f"timed out after {timeout} s waiting for {what} (last: {show() if show else last!r})")


def _counters(text: str) -> dict[tuple, float]:
    """Every counter sample of a /metrics page, by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) if f.type == "counter"
            for s in f.samples if s.name.endswith("_total")}


def stage_states(body: dict) -> dict[int, str]:
    """A /readyz body's state per stage."""
    return {s["stage"]: s.get("state") for s in body.get("stages", [])}


class Watch:
    """Host A's view of an endpoint on ``port``: /readyz and /metrics sampled through host A, with
    its advertised name as Host; counters must never go backwards (``backwards`` lists any)."""

    def __init__(self, hosts: Hosts, base: str, port: int):
        self.hosts, self.base, self.port = hosts, base, port
        self.last: dict[tuple, float] = {}
        self.backwards: list[str] = []
        self.last_ready: tuple = (0, {})

    def get(self, path: str, timeout: float = 10.0):
        """(status, body) of ``path`` from host A; a read may wait 10 s: the suite's other workers
        share the machine's cores with the deployment's processes."""
        return self.hosts.http("a", self.base + path, headers={"Host": f"{NAMES['a']}:{self.port}"},
                               timeout=timeout)

    def ready(self) -> tuple[int, dict]:
        status, body = self.get("/readyz")
        self.metrics()
        try:
            self.last_ready = (status, json.loads(body))
        except ValueError:
            self.last_ready = (status, {"raw": body[:500]})
        return self.last_ready

    def through_cut(self, cut: float, restore_s: float, show=None) -> tuple[float, dict]:
        """The rest of a ``CUT_S`` link cut begun at ``cut`` (monotonic): /readyz 503 throughout and
        no stage crashed; then the link back and /readyz 200 within ``restore_s``.  Returns the
        seconds that took and that /readyz body."""
        while time.monotonic() - cut < CUT_S:
            status, body = self.ready()
            assert status == 503 and "crashed" not in stage_states(body).values(), body
            time.sleep(0.5)
        self.hosts.set_link(True)
        back = time.monotonic()
        _, body = wait(lambda: (lambda r: r if r[0] == 200 else None)(self.ready()), restore_s,
                       "/readyz 200 after the link is back", show=show)
        return time.monotonic() - back, body

    def metrics(self) -> None:
        status, body = self.get("/metrics")
        if status != 200:
            return
        for key, value in _counters(body.decode()).items():
            if value < self.last.get(key, 0.0):
                self.backwards.append(f"{key}: {self.last[key]} -> {value}")
            self.last[key] = max(value, self.last.get(key, 0.0))
