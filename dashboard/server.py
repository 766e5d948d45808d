"""Serving the dashboard: a uvicorn server on a pre-bound socket, in a thread of its own.

Binding happens before anything else starts, so "port in use" is a clean exit 2
for ``serve`` instead of a dashboard that silently never comes up.  The socket
is created with protocol ``IPPROTO_TCP``: asyncio sets ``TCP_NODELAY`` only on
connections accepted from such a socket, and without it every keep-alive
response waits out Nagle's algorithm against the client's delayed ACK (~40 ms).
Idle keep-alive connections are closed after ``KEEP_ALIVE_S``; ``guard`` adds the rest of
what a hostile client meets (Host allowlist, request-head deadline, connection and request caps).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from stagecache.runtime.errors import ConfigError
from stagecache.runtime.live.source import SnapshotSource
from stagecache.runtime.net import bind_listener

from .advise_models import AdviseReport
from .app import create_app
from .guard import HEADER_TIMEOUT_S, RequestGuard, allowed_hosts, gate, protocol_class

#: Seconds an idle keep-alive connection stays open (uvicorn's ``timeout_keep_alive``).
KEEP_ALIVE_S = 5.0
#: Pending connections the kernel queues before the server accepts them (capped by the kernel's
#: somaxconn): deep enough that a burst of a few thousand connections is queued, not dropped
#: (a dropped handshake costs the client a 1 s SYN retransmit).
BACKLOG = 4096


def bind_dashboard_socket(host: str, port: int) -> socket.socket:
    """Bind the dashboard port *before* starting stages, so "port in use" is a clean exit 2."""
    try:
        return bind_listener(host, port, backlog=BACKLOG)
    except OSError as exc:
        raise ConfigError(
            f"cannot bind the dashboard to {host}:{port}: {exc.strerror or exc}; expected a free "
            "--port N (0 = any free port) on an address of this machine, or --no-dashboard"
        ) from None


class DashboardThread:
    """The dashboard app (with /metrics) in a daemon thread: on a pre-bound socket (``serve``),
    or (``sock`` None) on ``host:port``, bound by the server itself."""

    def __init__(self, source: Any, sock: socket.socket | None, title: str, *, host: str = "127.0.0.1",
                 port: int = 8000, keep_alive_s: float = KEEP_ALIVE_S,
                 header_timeout_s: float = HEADER_TIMEOUT_S, advise: AdviseReport | None = None,
                 configure: Callable[[Any], None] | None = None, extra_hosts: Iterable[str] = ()):
        if sock is not None:
            host, port = sock.getsockname()[:2]
        self.sock = sock
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
        self.server = make_server(source, host, port, title=title, keep_alive_s=keep_alive_s,
                                  header_timeout_s=header_timeout_s, advise=advise, configure=configure,
                                  extra_hosts=extra_hosts)
        self.thread = threading.Thread(target=self._run, name=f"stagecache-dashboard:{port}", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock] if self.sock is not None else None)
        except BaseException as exc:  # noqa: BLE001 - the caller reports it (uvicorn exits when it cannot bind)
            self.error = exc

    def start(self, timeout: float = 10.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()


def make_server(
    source: SnapshotSource, host: str = "127.0.0.1", port: int = 8000, *,
    title: str = "stagecache", log_level: str = "warning", keep_alive_s: float = KEEP_ALIVE_S,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    advise: AdviseReport | None = None,
    configure: Callable[[Any], None] | None = None,
    extra_hosts: Iterable[str] = (),
) -> Any:
    """A ``uvicorn.Server`` for the dashboard; ``.run()`` it (any thread), set ``.should_exit`` to stop.

    Hardened (``guard``): a Host allowlist, HEAD on every GET route, a request-head deadline,
    a cap on open connections and on requests in flight, a raised file-descriptor limit.
    ``advise``: the report ``/advise`` shows.  ``configure(app)`` adds routes of the caller's
    (the sglang deployment's push route); ``extra_hosts``: more ``Host`` names answered (the
    address other hosts reach this one by).
    """
    inner = create_app(source, title=title, advise=advise)
    if configure is not None:
        configure(inner)
    hosts = allowed_hosts(host) | {h.strip("[]").lower() for h in extra_hosts}
    app = RequestGuard(inner, hosts)
    # asyncio's own loop: uvloop (installed wherever sglang is) accepts in C, past ``gate``
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_keep_alive=keep_alive_s, backlog=BACKLOG, loop="asyncio",
                            http=protocol_class(header_timeout_s))
    return GatedServer(config)


class GatedServer(uvicorn.Server):
    """``uvicorn.Server`` that accepts only through ``guard.gate``, on the sockets it is given
    or (none given) on ``config.host:port``, bound here as uvicorn would and failing the same way."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        own = sockets is None
        if own:
            try:
                sockets = [bind_listener(self.config.host, self.config.port, backlog=BACKLOG)]
            except OSError as exc:
                raise SystemExit(f"cannot bind {self.config.host}:{self.config.port}: {exc}") from None
        gated = [gate(s, self.config.http_protocol_class) for s in sockets]
        if own:
            for s in sockets:
                s.close()  # the gate listens on its own duplicate
        await super().startup(sockets=gated)


def serve_dashboard(
    source: SnapshotSource, host: str = "127.0.0.1", port: int = 8000, *,
    title: str = "stagecache", log_level: str = "warning",
) -> None:
    """Serve the dashboard until interrupted (blocks; run it in a thread or a process)."""
    make_server(source, host, port, title=title, log_level=log_level).run()


@contextmanager
def dashboard_in_thread(
    source: SnapshotSource, host: str = "127.0.0.1", port: int = 8000, *,
    title: str = "stagecache", startup_timeout_s: float = 15.0, advise: AdviseReport | None = None,
    configure: Callable[[Any], None] | None = None, extra_hosts: Iterable[str] = (),
) -> Iterator[str]:
    """Serve the dashboard in a daemon thread while the block runs; yields its base URL.

    Startup waits are bounded; a port that cannot be bound is a RuntimeError naming it, not a
    silently dead thread.
    """
    dash = DashboardThread(source, None, title, host=host, port=port, advise=advise, configure=configure,
                           extra_hosts=extra_hosts)
    dash.start(startup_timeout_s)
    if not dash.server.started:
        dash.stop()
        why = f" ({dash.error!r}; uvicorn logged the cause)" if dash.error else ""
        raise RuntimeError(f"dashboard did not start on {host}:{port} within {startup_timeout_s:.0f} s{why}")
    try:
        yield f"http://{host}:{port}"
    finally:
        dash.stop()
