"""The stages' rendezvous (torch TCPStore) and data plane (gloo/nccl), bound to one address.

torch's TCPStore, left to itself, listens on every interface (``[::]:port``) and
answers anyone, unauthenticated.  So rank 0 binds the listening socket itself,
on ``--dist-host`` (loopback by default), and hands it to the store
(``master_listen_fd``); the port it got goes to the other stages through the run
directory (``rendezvous.json``), so no port is guessed and none can be stolen
between a check and its use.  gloo and nccl pick their interface from
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, set to the interface that
carries the same address.  Nothing a stage opens listens anywhere else.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import ipaddress
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..net import bind_listener

_SIOCGIFADDR = 0x8915
RENDEZVOUS_POLL_S = 0.02


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_interfaces() -> dict[str, str]:
    out: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6:
                out[str(ipaddress.IPv6Address(bytes.fromhex(parts[0])))] = parts[5]
    return out


def interface_for(address: str) -> str | None:
    """The network interface that carries ``address`` (an IP literal), or None."""
    ip = ipaddress.ip_address(address)
    if ip.is_loopback:  # 127.0.0.0/8 is all on the loopback interface, which carries 127.0.0.1
        ip = ipaddress.ip_address("::1" if ip.version == 6 else "127.0.0.1")
    if ip.version == 6:
        return _ipv6_interfaces().get(str(ip))
    for _index, name in socket.if_nameindex():
        if _ipv4_of(name) == str(ip):
            return name
    return None


def resolve_dist_host(host: str) -> tuple[str, str]:
    """``--dist-host`` -> (IP literal, interface name); exit 2 unless it is an address of this host."""
    accepted = "expected an IP address (or name) of this machine, e.g. 127.0.0.1"
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP) if host else []
    except OSError as exc:
        raise ConfigError(f"--dist-host {host!r}: cannot resolve ({exc.strerror or exc}); "
                          f"{accepted}") from None
    if not infos:
        raise ConfigError(f"--dist-host {host!r}: {accepted}")
    address = infos[0][4][0]
    if ipaddress.ip_address(address).is_unspecified:
        raise ConfigError(f"--dist-host {host!r} is the wildcard address; {accepted}")
    try:  # bind, never listen: this only checks the address belongs to this machine
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
            probe.bind((address, 0))
    except OSError as exc:
        raise ConfigError(f"--dist-host {host!r}: cannot bind {address}: "
                          f"{exc.strerror or exc}; {accepted}") from None
    iface = interface_for(address)
    if iface is None:
        raise ConfigError(f"--dist-host {host!r}: no network interface carries {address}; {accepted}")
    return address, iface


def data_plane_env(interface: str) -> dict[str, str]:
    """Environment that makes gloo and nccl bind (and connect) on ``interface`` only."""
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}


def make_store(rank: int, world_size: int, host: str, run_dir: str, timeout_s: float,
               alive: Any = None) -> Any:
    """Rank 0: the TCPStore server on a socket bound to ``host``; others: a client of it.

    ``alive()`` (optional) is polled while waiting for rank 0's port, so a stage
    whose parent died stops waiting at once.
    """
    import torch.distributed as dist

    from ..live.run_dir import RENDEZVOUS_FILE, read_json, write_json_atomic

    timeout = datetime.timedelta(seconds=timeout_s)
    path = Path(run_dir) / RENDEZVOUS_FILE
    if rank == 0:
        sock = bind_listener(host, 0)
        port = sock.getsockname()[1]
        store = dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                              master_listen_fd=sock.detach())
        write_json_atomic(path, {"host": host, "port": port, "pid": os.getpid()})
        return store
    deadline = time.monotonic() + timeout_s
    while True:
        data = read_json(path)
        if isinstance(data, dict) and isinstance(data.get("port"), int):
            return dist.TCPStore(host, data["port"], world_size, False, timeout)
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for rank 0's rendezvous port")
        if alive is not None and not alive():
            raise RuntimeError("the serve parent process is gone")
        time.sleep(RENDEZVOUS_POLL_S)
