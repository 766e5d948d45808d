"""The stages' rendezvous (a file in the private run dir) and data plane (gloo/nccl) on one address.

The rendezvous is a torch ``FileStore`` inside the run directory, which is 0700 and ours
(``private_fs``): no other user can open it, and nothing listens for it.  (torch's
``TCPStore`` answers anyone who connects to its port, unauthenticated: on a shared host any
local user could read every key or write its own -- e.g. a rank's data-plane address, so a
stage connects to them.)  Each run gets a store file of its own name, so a reused
``--run-dir`` never hands a stage the keys of an earlier run.  gloo and nccl pick their
interface from ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, set to the interface that
carries ``--dist-host`` (loopback by default); what travels over that data plane at startup
is sealed JSON (``exchange``), never pickle.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import ipaddress
import secrets
import socket
import struct
from pathlib import Path
from typing import Any

from ..errors import ConfigError

_SIOCGIFADDR = 0x8915


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


def new_store_path(run_dir: str) -> str:
    """A fresh rendezvous file name in ``run_dir`` for one run (``rendezvous-<random>.store``)."""
    return str(Path(run_dir) / f"rendezvous-{secrets.token_hex(8)}.store")


def make_store(store_path: str, world_size: int, timeout_s: float) -> Any:
    """The run's rendezvous: a ``FileStore`` at ``store_path`` (the same file for every stage)."""
    import torch.distributed as dist

    store = dist.FileStore(store_path, world_size)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store
