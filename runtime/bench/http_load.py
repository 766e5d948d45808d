"""``stagecache bench http``: the dashboard server's latency and throughput, measured from outside.

The server under test is a real ``stagecache serve`` (a subprocess), loaded over real TCP on
127.0.0.1 the way a Prometheus scraper, a browser and a probe would: ``/healthz`` one request at
a time (keep-alive and a fresh connection each), N concurrent keep-alive clients over
``/metrics``, ``/api/*`` and ``/healthz``, and how long an idle keep-alive connection stays open.
The same-run baseline is the same app on a protocol-0 socket (asyncio sets no ``TCP_NODELAY``).
The client is ``http.client`` in threads (lighter than an async client on a machine it shares
with the server), so its latencies are an upper bound of the server's.  docs/serve.md ("HTTP
performance") describes the figures.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

TARGETS = {"healthz_p50_ms": 5.0, "healthz_p99_ms": 20.0, "load_p99_ms": 100.0, "load_errors": 0}
SERVE_ARGS = ("--model", "tiny-v4", "--pp-size", "4", "--device-pages", "24", "--micro-batch", "2")
IDLE_SERVE_ARGS = ("--rate", "0", "--requests", "40")
LIVE_SERVE_ARGS = ("--rate", "10", "--requests", "4000")


@dataclass(frozen=True)
class HttpBenchOptions:
    url: str | None
    clients: int
    requests: int
    idle_requests: int
    while_serving: bool
    baseline: bool
    keep_alive_check: bool


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    """Nearest-rank p50/p90/p99, max and mean of latencies in milliseconds."""
    if not samples_ms:
        return {"p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "mean_ms": 0.0}
    xs = sorted(samples_ms)

    def rank(q: float) -> float:
        return xs[min(len(xs) - 1, max(0, int(q * len(xs) + 0.999999) - 1))]

    return {"p50_ms": rank(0.50), "p90_ms": rank(0.90), "p99_ms": rank(0.99), "max_ms": xs[-1],
            "mean_ms": sum(xs) / len(xs)}


def _split(url: str) -> tuple[str, int]:
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port
    except ValueError as exc:  # a port out of range or not a number
        raise ConfigError(f"--url {url[:80]!r}: {exc}; expected http://HOST:PORT/") from None
    if u.scheme != "http" or not u.hostname:
        raise ConfigError(f"--url {url[:80]!r}: expected http://HOST:PORT/")
    return u.hostname, port or 80


def check_url(url: str, timeout_s: float = 5.0) -> None:
    """``--url`` names a server that answers /healthz: exit 2 before any load is sent otherwise."""
    host, port = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        status, _ms = _get(conn, "/healthz")
    except (OSError, http.client.HTTPException) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise ConfigError(f"--url {url[:80]!r}: cannot reach /healthz ({why}); expected the URL "
                          "of a running stagecache dashboard") from None
    finally:
        conn.close()
    if status != 200:
        raise ConfigError(f"--url {url[:80]!r}: /healthz answered {status}; expected the URL of a "
                          "running stagecache dashboard")


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    conn.request("GET", path)
    resp = conn.getresponse()
    resp.read()
    return resp.status, (time.perf_counter() - t0) * 1e3


def sequential(url: str, path: str, n: int, fresh: bool) -> dict[str, Any]:
    """``n`` requests one after another: one keep-alive connection, or a new one per request."""
    host, port = _split(url)
    lat, errors = [], 0
    conn = None
    for _ in range(n):
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=10)
        try:
            status, ms = _get(conn, path)  # fresh: the TCP handshake is inside the request
            lat.append(ms)
            errors += status != 200
        except (OSError, http.client.HTTPException):
            errors += 1
            conn.close()
            conn = None
    if conn is not None:
        conn.close()
    return {"requests": n, "errors": errors, **percentiles(lat)}


def load(url: str, paths: list[str], clients: int, total: int) -> dict[str, Any]:
    """``clients`` threads, one keep-alive connection each, ``total`` requests round-robin over ``paths``."""
    host, port = _split(url)
    counter = itertools.count()
    results: list[list[tuple[int, float, int]]] = [[] for _ in range(clients)]

    def client(out: list[tuple[int, float, int]]) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=30)
        while (i := next(counter)) < total:
            k = i % len(paths)
            try:
                status, ms = _get(conn, paths[k])
            except (OSError, http.client.HTTPException):
                status, ms = -1, 0.0
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=30)
            out.append((k, ms, status))
        conn.close()

    threads = [threading.Thread(target=client, args=(results[c],)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    flat = [r for rs in results for r in rs]
    statuses = dict(Counter(str(st) for _, _, st in flat))
    per_path = {p: {"requests": sum(1 for k, _, _ in flat if k == i),
                    **percentiles([ms for k, ms, st in flat if k == i and st > 0])}
                for i, p in enumerate(paths)}
    return {
        "clients": clients, "requests": len(flat), "paths": paths, "wall_s": wall,
        "requests_per_s": len(flat) / wall if wall else 0.0,
        "errors": sum(1 for _, _, st in flat if st != 200), "status_counts": statuses,
        **percentiles([ms for _, ms, st in flat if st > 0]), "per_path": per_path,
    }


def keep_alive_close_s(url: str, limit_s: float = 30.0) -> float | None:
    """Seconds after its last response until the server closes an idle keep-alive connection."""
    host, port = _split(url)
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        s.recv(65536)  # the whole (small) response
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            ready, _, _ = select.select([s], [], [], 0.1)
            if ready and s.recv(65536) == b"":
                return time.monotonic() - t0
    return None


def server_fds(pid: int | None) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd")) if pid else None
    except OSError:
        return None


def _drain(stream: Any, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def _wait(pred: Any, timeout: float, what: str, proc: subprocess.Popen, out: list[str]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before {what}:\n{''.join(out)}")
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}:\n{''.join(out)}")


@contextlib.contextmanager
def _spawn(argv: list[str], url_prefix: str) -> Iterator[tuple[str, subprocess.Popen, list[str]]]:
    """Start a server process, yield (its URL from the line starting with ``url_prefix``, it, output)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    threading.Thread(target=_drain, args=(proc.stdout, out), daemon=True).start()
    try:
        line = _wait(lambda: next((ln for ln in out if ln.startswith(url_prefix)), None), 120,
                     "its URL", proc, out)
        yield line[len(url_prefix):].split()[0], proc, out
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def serve_target(while_serving: bool) -> Iterator[tuple[str, int, str]]:
    """A real ``stagecache serve``: idle after its trace (stages exited), or in the middle of one."""
    from ..live.run_dir import RunDirSource

    with tempfile.TemporaryDirectory(prefix="stagecache-bench-http-") as run_dir:
        argv = [sys.executable, "-m", "stagecache.runtime", "serve", *SERVE_ARGS,
                *(LIVE_SERVE_ARGS if while_serving else IDLE_SERVE_ARGS), "--port", "0",
                "--run-dir", run_dir, "--hold-seconds", "3600"]
        with _spawn(argv, "dashboard: ") as (url, proc, out):
            source = RunDirSource(run_dir)
            if while_serving:
                _wait(lambda: all(s.steps > 0 for s in source.stages().values())
                      and len(source.stages()) == 4, 120, "every stage to serve", proc, out)
            else:
                _wait(lambda: (r := source.run()) is not None and r.phase == "done", 120,
                      "the trace to finish", proc, out)
            yield url, proc.pid, run_dir


@contextlib.contextmanager
def baseline_server(run_dir: str) -> Iterator[str]:
    """The same app over the same run dir, on a protocol-0 socket (no TCP_NODELAY): the old way."""
    argv = [sys.executable, "-m", "stagecache.runtime.bench.http_load", "--baseline-server", run_dir]
    with _spawn(argv, "baseline: ") as (url, _proc, _out):
        yield url


def _baseline_main(run_dir: str) -> None:
    from stagecache.dashboard.server import make_server

    from ..live.run_dir import RunDirSource

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # protocol 0: asyncio skips TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    host, port = sock.getsockname()
    print(f"baseline: http://{host}:{port}/", flush=True)
    make_server(RunDirSource(run_dir), host, port).run(sockets=[sock])


def mixed_paths(url: str) -> list[str]:
    """``/metrics``, every ``/api/*`` route (each stage's layer map) and ``/healthz``."""
    host, port = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("GET", "/api/stages")
    stages = [s["stage"] for s in json.loads(conn.getresponse().read())["stages"]]
    conn.close()
    return ["/healthz", "/metrics", "/api/startup", "/api/stages", "/api/metrics/summary",
            *(f"/api/stages/{k}/layer-map" for k in stages)]


def verdict(res: dict[str, Any]) -> dict[str, bool]:
    idle, ld = res["idle_healthz"], res["load"]
    return {
        "healthz_keepalive_p50": idle["keepalive"]["p50_ms"] < TARGETS["healthz_p50_ms"],
        "healthz_keepalive_p99": idle["keepalive"]["p99_ms"] < TARGETS["healthz_p99_ms"],
        "healthz_fresh_p50": idle["fresh"]["p50_ms"] < TARGETS["healthz_p50_ms"],
        "healthz_fresh_p99": idle["fresh"]["p99_ms"] < TARGETS["healthz_p99_ms"],
        "load_errors": ld["errors"] == TARGETS["load_errors"],
        "load_p99": ld["p99_ms"] < TARGETS["load_p99_ms"],
    }


def run_bench(opts: HttpBenchOptions) -> dict[str, Any]:
    """Every figure of the module docstring, as one JSON-ready dict."""
    with contextlib.ExitStack() as stack:
        if opts.url:
            url, pid, run_dir = opts.url, None, None
        else:
            url, pid, run_dir = stack.enter_context(serve_target(opts.while_serving))
        res: dict[str, Any] = {
            "bench": "http", "url": url, "server_pid": pid, "cpus": os.cpu_count(),
            "server_state": "external" if opts.url else "serving a trace" if opts.while_serving
            else "idle (trace done, stages exited)",
            "loadavg_before": list(os.getloadavg()), "server_fds_before": server_fds(pid),
        }
        res["idle_healthz"] = {"keepalive": sequential(url, "/healthz", opts.idle_requests, False),
                               "fresh": sequential(url, "/healthz", opts.idle_requests, True)}
        paths = mixed_paths(url)
        for path in paths:  # warm-up, not measured: first requests parse the report, draw figures
            sequential(url, path, 1, False)
        res["load"] = load(url, paths, opts.clients, opts.requests)
        if opts.keep_alive_check:
            res["keep_alive_close_s"] = keep_alive_close_s(url)
        res["server_fds_after"] = server_fds(pid)
        if opts.baseline and run_dir is not None:
            with baseline_server(run_dir) as burl:
                n = min(opts.idle_requests, 200)
                res["baseline_no_nodelay"] = {"keepalive": sequential(burl, "/healthz", n, False)}
            base = res["baseline_no_nodelay"]["keepalive"]["p50_ms"]
            now = res["idle_healthz"]["keepalive"]["p50_ms"]
            res["keepalive_p50_speedup_vs_baseline"] = base / now if now else None
        res["loadavg_after"] = list(os.getloadavg())
    res["targets"] = TARGETS
    res["checks"] = verdict(res)
    res["ok"] = all(res["checks"].values())
    return res


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--baseline-server":
    _baseline_main(sys.argv[2])
