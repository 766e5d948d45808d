"""Shared helpers of the ``stagecache serve`` process tests: start it, wait on it, look at it from outside."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

SMALL = ["--model", "tiny-v4", "--pp-size", "4", "--rate", "0", "--requests", "40",
         "--device-pages", "24", "--micro-batch", "2"]


def start(args: list[str], out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    f = open(out, "w")  # noqa: SIM115 - closed by the OS when the child exits; read via the path
    return subprocess.Popen([sys.executable, "-m", "stagecache.runtime", "serve", *args],
                            stdout=f, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env} if env else None)


def wait_for(pred, timeout: float, what: str, proc: subprocess.Popen | None = None, out: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            text = out.read_text() if out else ""
            pytest.fail(f"serve exited with {proc.returncode} while waiting for {what}:\n{text}")
        time.sleep(0.2)
    text = out.read_text() if out else ""
    pytest.fail(f"timed out after {timeout} s waiting for {what}:\n{text}")


def get_once_up(proc: subprocess.Popen, url: str, timeout: float = 30) -> httpx.Response:
    """GET ``url`` as soon as the server ``proc`` starts answers (``proc`` must stay up meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(url, timeout=5)
        except httpx.TransportError:
            assert proc.poll() is None and time.monotonic() < deadline, "dashboard did not start"
            time.sleep(0.1)


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def run_phase(run_dir: Path) -> str | None:
    data = read_json(run_dir / "run.json")
    return data.get("phase") if data else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def stage_pids(run_dir: Path) -> list[int]:
    data = read_json(run_dir / "run.json") or {}
    return [int(p) for p in data.get("pids", {}).values() if p]


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"serve did not exit within {timeout} s of {signal.Signals(sig).name}")


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (forkserver, stages, resource tracker), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listening_sockets(pids: list[int]) -> list[tuple[int, str, str, int]]:
    """Every listening TCP socket (and bound UDP socket) the processes hold: (pid, proto, addr, port)."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                owner[target[8:-1]] = pid
    out = []
    for proto, listen_state in (("tcp", "0A"), ("tcp6", "0A"), ("udp", "07"), ("udp6", "07")):
        with open(f"/proc/net/{proto}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == listen_state and inode in owner:
                    addr, port = local.split(":")
                    out.append((owner[inode], proto, _address(addr), int(port, 16)))
    return out
