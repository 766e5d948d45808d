"""Ctrl-C stops any command within a second, with exit code 130.

Each command is started as the real executable would be (``python -m stagecache.runtime``),
left to get into its work (a benchmark's loop, a server answering), then sent SIGINT; the
time from the signal to the process's exit is what a person at the terminal waits.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "stagecache.runtime"]
#: CPU seconds after which a benchmark is past its imports and inside its work (``bench check``
#: imports neither torch nor the cache: half a CPU second to its first check).
BUSY_CPU_S = {"bench-check": 2.0}
BUSY_CPU_DEFAULT_S = 4.0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait(pred, proc: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


COMMANDS = {
    "bench-check": ["bench", "check", "--repeat", "100000000"],
    "bench-hicache": ["bench", "hicache", "--requests", "100000"],
    "bench-transfer": ["bench", "transfer", "--device", "cpu", "--budget", "1000",
                       "--min-reps", "100000", "--max-reps", "1000000"],
    "dashboard": ["dashboard", "--from-check", "--port", "0"],
    "serve": ["serve", "--port", "0", "--rate", "1", "--requests", "4000"],
}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_ctrl_c_stops_the_command_within_a_second_with_130(name, tmp_path):
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen([*CLI, *COMMANDS[name]], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "TMPDIR": str(tmp_path), "XDG_RUNTIME_DIR": ""})
    try:
        if name == "dashboard":
            _wait(lambda: "http://" in out.read_text(), proc, "the dashboard's URL")
        elif name == "serve":
            _wait(lambda: "startup ok" in out.read_text(), proc, "the stages to serve")
        else:
            busy = BUSY_CPU_S.get(name, BUSY_CPU_DEFAULT_S)
            _wait(lambda: _cpu_seconds(proc.pid) > busy, proc, "the benchmark to work")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(10)
        waited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 130, out.read_text()[-2000:]
    assert waited < 1.0, f"{name} took {waited:.2f} s to stop"
    assert "Traceback" not in out.read_text()
