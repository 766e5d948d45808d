"""Stages on other hosts: silence judged on the receiver's monotonic clock, times moved onto its
wall clock, unreachable told apart from crashed (runtime/live/remote.py, liveness.stage_health)."""

from __future__ import annotations

import os
import subprocess
import sys

from stagecache.runtime.live.liveness import assess
from stagecache.runtime.live.numbers import Phase, StageLive, TimelineEvent
from stagecache.runtime.live.remote import Arrivals, gone, on_receiver_clock, start_ticks

NOW = 1_800_000_000.0


def _sent(sender_clock: float) -> StageLive:
    return StageLive(stage=2, phase=Phase.SERVING, time=sender_clock, heartbeat_at=sender_clock,
                     started_at=sender_clock - 100,
                     timeline=[TimelineEvent(kind="compute", start=sender_clock - 1, seconds=0.5)])


def test_a_sender_30_s_ahead_or_behind_is_shown_on_the_receivers_clock():
    for skew in (30.0, -30.0):
        live = on_receiver_clock(_sent(NOW + skew), NOW + skew, NOW, host="10.0.0.2")
        assert live.remote and live.host == "10.0.0.2"
        assert live.clock_offset_s == -skew
        assert live.time == live.heartbeat_at == NOW
        assert live.started_at == NOW - 100 and live.timeline[0].start == NOW - 1


def test_silence_is_measured_on_the_receivers_monotonic_clock_whatever_the_wall_clocks_say():
    arrivals = Arrivals()
    arrivals.arrived(2, mono=500.0)
    # the sender said its time was 30 s ahead: that buys it nothing
    live = on_receiver_clock(_sent(NOW + 30), NOW + 30, NOW)
    for silent, up in ((4.0, True), (6.0, False)):
        stamped = arrivals.stamp(2, live.model_copy(), wall_now=NOW + silent, mono_now=500.0 + silent)
        verdict = assess(None, None, {2: stamped}, NOW + silent, heartbeat_timeout=5)
        assert verdict.stages[0].up is up
        if not up:
            assert verdict.stages[0].state == "unreachable"
            assert "stage 2: unreachable: no numbers over the network for 6.0 s" in verdict.reasons[-1]


def test_a_local_stage_that_stops_beating_is_stale_and_an_exit_code_is_a_crash():
    live = StageLive(stage=1, phase=Phase.SERVING, heartbeat_at=NOW - 9)
    assert assess(None, None, {1: live}, NOW, heartbeat_timeout=5).stages[0].state == "stale"


def test_a_stage_seen_gone_by_a_stage_on_its_host_is_crashed_not_unreachable():
    silent = on_receiver_clock(_sent(NOW - 7), NOW - 7, NOW - 7)
    witness = on_receiver_clock(_sent(NOW).model_copy(update={"stage": 3, "gone": {2: "pid 4242 is gone"}}),
                                NOW, NOW)
    verdict = assess(None, None, {2: silent, 3: witness}, NOW, heartbeat_timeout=5)
    by = {h.stage: h for h in verdict.stages}
    assert by[2].state == "crashed" and by[3].state == "up"
    assert by[2].reason == "crashed: pid 4242 is gone (seen by stage 3 on the same host)"


def test_gone_tells_a_running_process_from_an_exited_one_and_a_reused_pid():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ticks = start_ticks(child.pid)
        assert ticks is not None and gone(child.pid, ticks) is None
        assert gone(child.pid, ticks + 1) == f"pid {child.pid} is gone (the pid now belongs to another process)"
    finally:
        child.kill()
        child.wait()
    assert gone(child.pid, ticks) == f"pid {child.pid} is gone"
    assert gone(os.getpid(), start_ticks(os.getpid())) is None
