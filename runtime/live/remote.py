"""Stages on other hosts: their numbers judged on the receiver's clocks, and processes seen gone.

Across hosts two clocks are never the same clock.  A stage's report carries its own wall time
(``StageLive.time``); taken as a sign of life, a host 30 s ahead would look alive for 30 s after
it fell silent, and one 30 s behind would look dead at once.  So the receiver judges silence on
its own **monotonic** clock -- when did the last report *arrive* here -- and moves the sender's
times onto its own wall clock by the offset measured at the receipts (``clock_offset_s``), so the
page's times are the receiver's.  A receipt's own measurement has its delivery delay inside it
(milliseconds on an idle link, seconds from a loaded host), and a delay only ever adds, so the
offset is the least of the sender's recent measurements (``ClockOffsets``).

Silence over the network says the numbers stopped arriving, not that the process stopped: that
is ``unreachable``.  A process is named ``crashed`` only when someone saw it gone: its own host's
supervisor (an exit code), or a stage on the same host that found its pid no longer running
(``gone``; the pid's start time guards against a reused pid).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Hashable
from pathlib import Path

from .numbers import StageLive

#: Seconds of receipts a sender's clock offset is the least of: long enough to hold a receipt that
#: came without delay, short enough that a clock stepped back on either host is followed within it
#: (one stepped forward lowers the least at once).
OFFSET_WINDOW_S = 30.0


class ClockOffsets:
    """Each sender's clock offset (receiver's wall clock minus the sender's): the least
    ``received_at - sent_at`` of its receipts in the last ``OFFSET_WINDOW_S`` seconds of the
    receiver's monotonic clock.  A sliding-window minimum: constant time a receipt, and a sender
    holds only the receipts that can still be the least."""

    def __init__(self, window_s: float = OFFSET_WINDOW_S) -> None:
        self._window = window_s
        self._seen: dict[Hashable, deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    def offset(self, sender: Hashable, sent_at: float, received_at: float, mono: float | None = None) -> float:
        """Record one receipt of ``sender`` and return its offset now."""
        mono = time.monotonic() if mono is None else mono
        raw = received_at - sent_at
        with self._lock:
            seen = self._seen.setdefault(sender, deque())
            while seen and seen[-1][1] >= raw:  # never the least again: a later receipt is less
                seen.pop()
            seen.append((mono, raw))
            while mono - seen[0][0] > self._window:  # the newest one never leaves: it is in window
                seen.popleft()
            return seen[0][1]


def on_receiver_clock(live: StageLive, sent_at: float, received_at: float, host: str | None = None,
                      offset: float | None = None) -> StageLive:
    """``live`` (sent at the sender's wall time ``sent_at``) with every time moved onto the
    receiver's wall clock (``received_at``), marked remote.  ``offset``: the sender's offset from
    ``ClockOffsets`` (default: this receipt's alone).  Pure: returns a copy."""
    offset = received_at - sent_at if offset is None else offset
    out = live.model_copy(deep=True)
    out.remote, out.clock_offset_s = True, offset
    if host is not None:
        out.host = host
    out.time = received_at
    out.heartbeat_at = received_at
    if out.started_at:
        out.started_at += offset
    for event in out.timeline:
        event.start += offset
    if out.host_tier.checked_at:
        out.host_tier.checked_at += offset
    for rec in out.agreement.recent:
        rec.time += offset
    return out


class Arrivals:
    """When each remote stage's numbers last arrived, on this process's monotonic clock."""

    def __init__(self) -> None:
        self._at: dict[int, float] = {}
        self._lock = threading.Lock()

    def arrived(self, stage: int, mono: float | None = None) -> None:
        with self._lock:
            self._at[stage] = time.monotonic() if mono is None else mono

    def stamp(self, stage: int, live: StageLive, wall_now: float | None = None,
              mono_now: float | None = None) -> StageLive:
        """``live.heartbeat_at`` = the arrival, as a time on this process's wall clock: the age
        ``/readyz`` computes is then the monotonic silence, whatever either wall clock does."""
        with self._lock:
            at = self._at.get(stage)
        if at is not None and live.remote:
            wall = time.time() if wall_now is None else wall_now
            mono = time.monotonic() if mono_now is None else mono_now
            live.heartbeat_at = wall - max(0.0, mono - at)
        return live


def host_id() -> str:
    """This host, as the processes on it see it: the boot id and the network namespace (two
    namespaces of one machine are two hosts to the network)."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    try:
        net = os.readlink("/proc/self/ns/net")
    except OSError:
        net = ""
    return f"{boot}/{net}"


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        return int(fields[19]) if fields[0] not in ("Z", "X") else None
    except (IndexError, ValueError):
        return None


def gone(pid: int, ticks: int | None) -> str | None:
    """Why the process ``pid`` (started at ``ticks``) is gone, or None while it runs."""
    now = start_ticks(pid)
    if now is None:
        return f"pid {pid} is gone"
    if ticks is not None and now != ticks:
        return f"pid {pid} is gone (the pid now belongs to another process)"
    return None
