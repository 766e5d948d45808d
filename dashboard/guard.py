"""What keeps a hostile or careless client from starving the dashboard or abusing its origin.

Per connection (``GuardedH11Protocol``, uvicorn's h11 protocol with two rules added):

* a request head must arrive within ``HEADER_TIMEOUT_S`` of connecting, or of the previous
  response; a socket that sends nothing, or half a request (slowloris), is closed then.
  Between requests uvicorn's own keep-alive timeout (``server.KEEP_ALIVE_S``) applies too.
* at most ``max_connections`` are open at once; one more evicts the connection that has
  waited longest without a request in flight, so sockets held open by one client cannot lock
  everyone else out (and never exhaust the process's file descriptors: ``raise_fd_limit``).

Per request (``RequestGuard``, plain ASGI middleware in front of the app):

* the ``Host`` header must name this server (127.0.0.1, localhost, [::1] or the configured
  ``--host``), else 400: a web page elsewhere cannot read the dashboard through DNS
  rebinding;
* HEAD is answered on every GET route (the GET response's headers, no body);
* at most ``MAX_IN_FLIGHT`` requests are handled at once; more get 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

#: Seconds a connection may take to send a complete request head.
HEADER_TIMEOUT_S = 10.0
#: Open connections at most (fewer when the file-descriptor limit is lower).
MAX_CONNECTIONS = 1000
#: Requests handled at once at most; more are answered 503.
MAX_IN_FLIGHT = 64
#: File descriptors kept for everything else the process opens (run-dir files, logs, pipes).
FD_RESERVE = 256
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def raise_fd_limit(wanted: int = MAX_CONNECTIONS + 4 * FD_RESERVE) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards ``wanted`` (never above the hard limit);
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap() -> int:
    """``MAX_CONNECTIONS``, or fewer when the file-descriptor limit leaves less room."""
    soft = raise_fd_limit()
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft - FD_RESERVE))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a request-head deadline and a cap on open connections.

    ``waiting`` holds the connections waiting for a request head, oldest first (one per
    server: ``protocol_class`` makes a subclass each), so an eviction costs O(1) however
    many sockets a client holds open.
    """

    header_timeout_s = HEADER_TIMEOUT_S
    max_connections = MAX_CONNECTIONS
    waiting: ClassVar[OrderedDict[GuardedH11Protocol, None]] = OrderedDict()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._evict()
        if not transport.is_closing():
            self._arm()

    def _in_flight(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _evict(self) -> None:
        """Close the connection that has waited longest for a request head (never one that is
        being answered); this new one when every other is busy."""
        while self.waiting:
            victim, _ = self.waiting.popitem(last=False)
            if not victim._in_flight() and not victim.transport.is_closing():
                victim._disarm()
                victim.transport.close()
                return
        self.transport.close()

    def _arm(self) -> None:
        """Start waiting for a request head: the deadline, and the back of the eviction line."""
        self._disarm()
        self.waiting[self] = None
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        self.waiting.pop(self, None)
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timeout(self) -> None:
        self._head_deadline = None
        self.waiting.pop(self, None)
        if not self._in_flight() and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_flight():  # the head came in time
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's head has the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def protocol_class(header_timeout_s: float = HEADER_TIMEOUT_S,
                   max_connections: int | None = None) -> type[GuardedH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits (one per server)."""
    limits = {"header_timeout_s": header_timeout_s,
              "max_connections": max_connections or connection_cap(), "waiting": OrderedDict()}
    return type("DashboardH11Protocol", (GuardedH11Protocol,), limits)


def allowed_hosts(host: str | None) -> frozenset[str]:
    """Host header names this server answers: the loopback names and the bind address."""
    names = {*LOOPBACK_HOSTS}
    if host:
        names.add(host.strip("[]").lower())
    return frozenset(names)


def _host_name(value: str) -> str:
    """``Host`` without its port: ``[::1]:8000`` -> ``::1``, ``localhost:80`` -> ``localhost``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


async def _plain(send: Any, status: int, text: str, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = text.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """ASGI middleware: Host allowlist (400), HEAD as GET without a body, in-flight cap (503)."""

    def __init__(self, app: Any, hosts: frozenset[str], max_in_flight: int = MAX_IN_FLIGHT):
        self.app = app
        self.hosts = hosts
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
        if host is not None and _host_name(host) not in self.hosts:
            allowed = ", ".join(sorted(f"[{h}]" if ":" in h else h for h in self.hosts))
            await _plain(send, 400, f"Host {host[:100]!r} is not served here; allowed: {allowed}\n")
            return
        if self.in_flight >= self.max_in_flight:
            await _plain(send, 503, "too many requests in flight; retry\n", [(b"retry-after", b"1")])
            return
        self.in_flight += 1
        try:
            if scope["method"] == "HEAD":
                await self.app({**scope, "method": "GET"}, receive, _without_body(send))
            else:
                await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def _without_body(send: Any) -> Any:
    """A ``send`` that passes the response head on and drops the body (HEAD)."""

    async def head_only(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            if not message.get("more_body", False):
                await send({"type": "http.response.body", "body": b""})
            return
        await send(message)

    return head_only
