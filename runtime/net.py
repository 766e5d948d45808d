"""Listening sockets and bind addresses: what every server of stagecache binds with (the dashboard,
the stages' rendezvous), and the warning a non-loopback address gets.  Below every package."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address ("" and 0.0.0.0 are not)."""
    text = host.strip("[]")
    if not text:
        return False
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(text, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def exposure_warning(flag: str, host: str, what: str) -> str | None:
    """The loud warning for a non-loopback bind address, or None when it is loopback."""
    if is_loopback(host):
        return None
    shown = host if host else '"" (every interface)'
    return (f"WARNING: {flag} {shown} is not a loopback address: {what} can be reached from "
            "other machines, with no authentication. Use it only on a trusted network.")


def bind_listener(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on exactly ``host:port`` (protocol IPPROTO_TCP, so asyncio sets
    TCP_NODELAY on every connection it accepts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock
