"""What keeps a hostile or careless client from starving the dashboard or abusing its origin.

Per connection (``GuardedH11Protocol``): a request head must arrive within ``HEADER_TIMEOUT_S``
(slowloris), and one connection past ``max_connections`` evicts the one that has waited longest
without a request in flight, so sockets one client holds open cannot lock everyone else out.
Per listening socket (``GatedListener``): no more accepted sockets than the process's descriptor
limit leaves room for, since asyncio accepts a whole burst before any protocol sees it; out of
descriptors anyway, an idle connection is shed instead of asyncio's one-second accept pause.
Per request (``RequestGuard``): a ``Host`` that names this server (DNS rebinding), HEAD on every
GET route, and at most ``MAX_IN_FLIGHT`` requests at once (503 with Retry-After beyond).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
from collections import OrderedDict, deque
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
#: Accepted sockets allowed above the connection cap: a burst accepted in one loop pass is
#: counted before eviction brings it back under the cap.
ACCEPT_SLACK = 64
#: The fewest connections a server is given, whatever the descriptor limit says.
MIN_CONNECTIONS = 16
#: Connections past their head deadline closed per event-loop pass.
CLOSE_PER_PASS = 32
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


def open_fds() -> int:
    """Descriptors this process holds now (``/proc/self/fd``; 0 where there is none)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def socket_budget() -> int:
    """Accepted sockets one listener may hold open: the descriptor limit (raised first), less
    what the process already holds and ``FD_RESERVE``; at most ``MAX_CONNECTIONS`` plus
    ``ACCEPT_SLACK``."""
    soft = raise_fd_limit()
    most = MAX_CONNECTIONS + ACCEPT_SLACK
    if soft == resource.RLIM_INFINITY:
        return most
    return max(MIN_CONNECTIONS + ACCEPT_SLACK, min(most, soft - open_fds() - FD_RESERVE))


def connection_cap(budget: int | None = None) -> int:
    """Open connections at most: ``ACCEPT_SLACK`` below the socket budget."""
    return max(MIN_CONNECTIONS, (socket_budget() if budget is None else budget) - ACCEPT_SLACK)


class GatedListener(socket.socket):
    """A listening socket that accepts no more sockets than ``budget`` at once.

    asyncio calls ``accept()`` in a loop until it raises ``BlockingIOError``; at the budget
    this one raises it (after shedding an idle connection, so the budget frees up), and on
    ``EMFILE`` it sheds one and does the same, so accepting goes on next loop pass.  The
    sockets it hands out count themselves off when closed (``_Accepted``).
    """

    def __init__(self, sock: socket.socket, budget: int, shed: Any) -> None:
        """Listen on a duplicate of ``sock``'s descriptor (its owner still closes ``sock``);
        ``shed()`` drops the oldest idle connection and says whether there was one."""
        super().__init__(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
        self.budget = budget
        self.accepted = 0
        self.shed = shed

    def accept(self) -> tuple[socket.socket, Any]:  # type: ignore[override]
        if self.accepted >= self.budget:
            self.shed()
            raise BlockingIOError(errno.EAGAIN, "accepted-socket budget reached")
        try:
            fd, addr = self._accept()  # type: ignore[attr-defined]
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE) and self.shed():
                raise BlockingIOError(errno.EAGAIN, "out of descriptors; an idle one was shed") from None
            raise  # asyncio pauses accepting for a second: nothing could be freed
        self.accepted += 1
        return _Accepted(self, fd), addr


class _Accepted(socket.socket):
    """An accepted socket that gives its place in the listener's budget back when closed."""

    def __init__(self, listener: GatedListener, fd: int) -> None:
        super().__init__(listener.family, listener.type, listener.proto, fileno=fd)
        self._listener: GatedListener | None = listener

    def _release(self) -> None:
        if self._listener is not None:
            self._listener.accepted -= 1
            self._listener = None

    def close(self) -> None:
        self._release()
        super().close()

    def detach(self) -> int:
        self._release()
        return super().detach()

    def __del__(self) -> None:  # closed by the garbage collector, not by close()
        self._release()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a request-head deadline and a cap on open connections.

    ``waiting`` holds the connections waiting for a request head, oldest first (one per
    server: ``protocol_class`` makes a subclass each), so an eviction costs O(1) however
    many sockets a client holds open.
    """

    header_timeout_s = HEADER_TIMEOUT_S
    max_connections = MAX_CONNECTIONS
    waiting: ClassVar[OrderedDict[GuardedH11Protocol, None]] = OrderedDict()
    expired: ClassVar[deque[GuardedH11Protocol]] = deque()  # past their head deadline, to close

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
        """Drop the connection that has waited longest for a request head (never one that is
        being answered); this new one when every other is busy."""
        if not self.shed_one():
            self.transport.abort()

    @classmethod
    def shed_one(cls) -> bool:
        """Abort the oldest connection waiting for a request head; False when there is none."""
        while cls.waiting:
            victim, _ = cls.waiting.popitem(last=False)
            if not victim._in_flight() and not victim.transport.is_closing():
                victim._disarm()
                victim.transport.abort()  # the descriptor is free on the next loop pass
                return True
        return False

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
        expired = self.expired
        expired.append(self)
        if len(expired) == 1:
            self.loop.call_soon(self._close_expired)

    @classmethod
    def _close_expired(cls) -> None:
        """Close connections whose head deadline passed, ``CLOSE_PER_PASS`` per loop pass: a
        flood's sockets reach their deadlines together, and closing hundreds in one pass would
        hold every other connection's answer (/healthz's) for that long."""
        expired = cls.expired
        for _ in range(min(CLOSE_PER_PASS, len(expired))):
            conn = expired.popleft()
            if not conn._in_flight() and not conn.transport.is_closing():
                conn.transport.abort()
        if expired:
            expired[0].loop.call_soon(cls._close_expired)

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
    limits = {"header_timeout_s": header_timeout_s, "max_connections": max_connections or connection_cap(),
              "waiting": OrderedDict(), "expired": deque()}
    return type("DashboardH11Protocol", (GuardedH11Protocol,), limits)


def gate(sock: socket.socket, protocol: type[GuardedH11Protocol]) -> GatedListener:
    """``sock`` as a listener whose accepted sockets fit the descriptors left: ``ACCEPT_SLACK``
    above the protocol's connection cap, shedding that protocol's idle connections."""
    budget = min(protocol.max_connections + ACCEPT_SLACK, socket_budget())
    return GatedListener(sock, budget, protocol.shed_one)


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
