"""A local ``mooncake_master``: started on loopback by ``serve`` (or a test), stopped by pid.

A cluster runs its own master and stagecache joins it by address (``--l3-mooncake-master``);
for a single host ``serve`` starts one itself, bound to 127.0.0.1 on free ports, without the
HTTP metadata server (clients use P2P handshakes), and stops it when the run ends: SIGTERM to
the pid it started, SIGKILL after a grace period.  The master keeps object *metadata* in memory
(the bytes live in the clients' segments), so a restarted master starts empty.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .base import StoreUnavailable

log = logging.getLogger(__name__)

BINARY = "mooncake_master"
READY_TIMEOUT_S = 15.0
STOP_GRACE_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _in_package() -> str | None:
    """The binary the wheel ships inside the ``mooncake`` package (an install with --target)."""
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / BINARY
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def master_binary() -> str:
    """The ``mooncake_master`` of this interpreter's environment, else the wheel's own, else PATH."""
    beside = Path(sys.executable).with_name(BINARY)
    found = str(beside) if beside.exists() else _in_package() or shutil.which(BINARY)
    if not found:
        raise StoreUnavailable(f"{BINARY} not found (beside {sys.executable} or on PATH): "
                               "pip install '.[l3]' in a stagecache checkout (mooncake-transfer-engine-non-cuda)")
    return found


def parse_address(text: str, flag: str = "--l3-mooncake-master") -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), or ``StoreUnavailable`` naming the flag."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StoreUnavailable(f"{flag} {text!r}: expected HOST:PORT (e.g. 127.0.0.1:50051)")
    return host.strip("[]"), int(port)


def reachable(address: str, timeout: float = 1.0) -> bool:
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """One ``mooncake_master`` process on loopback (``start`` / ``stop``; a context manager)."""

    def __init__(self, rpc_port: int = 0, host: str = "127.0.0.1", log_path: str | None = None):
        self.host = host
        self.rpc_port = rpc_port
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = READY_TIMEOUT_S) -> str:
        """Start the master and wait until its RPC port answers; its ``HOST:PORT``."""
        if not self.rpc_port:
            self.rpc_port = free_port(self.host)
        cmd = [master_binary(), f"--rpc_address={self.host}", f"--rpc_port={self.rpc_port}",
               f"--metrics_host={self.host}", f"--metrics_port={free_port(self.host)}",
               "--enable_http_metadata_server=false"]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            # its own session: a Ctrl-C to the terminal's group reaches serve, which stops it
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                         start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StoreUnavailable(f"{BINARY} exited with code {self.proc.returncode} at start "
                                       f"(port {self.rpc_port}){self._log_hint()}")
            if reachable(self.address, 0.2):
                log.info("mooncake_master pid %d on %s", self.proc.pid, self.address)
                return self.address
            time.sleep(0.05)
        self.stop()
        raise StoreUnavailable(f"{BINARY} did not answer on {self.address} within {timeout:g} s"
                               f"{self._log_hint()}")

    def _log_hint(self) -> str:
        return f"; its log: {self.log_path}" if self.log_path else ""

    def stop(self, grace: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the pid this object started, SIGKILL after ``grace``; the exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5.0)
        return proc.returncode

    def __enter__(self) -> MooncakeMaster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
