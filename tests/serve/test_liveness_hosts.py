"""Stages on other hosts: silence judged on the receiver's monotonic clock, times moved onto its
wall clock, unreachable told apart from crashed (runtime/live/remote.py, liveness.stage_health)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from stagecache.runtime.live.liveness import assess
from stagecache.runtime.live.numbers import Phase, StageLive, TimelineEvent
from stagecache.runtime.live.remote import (
    OFFSET_WINDOW_S,
    Arrivals,
    ClockOffsets,
    gone,
    on_receiver_clock,
    start_ticks,
)

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


def test_a_push_delayed_seconds_by_a_loaded_host_does_not_move_the_senders_offset():
    """Seen in the two-host run: one receipt 3.7 s late put a 30 s skew at 26.3 s.  The offset is
    the least of the recent receipts', so a late one changes nothing once a prompt one came."""
    offsets = ClockOffsets()
    skew = -30.0  # the sender's clock is 30 s ahead: receiver minus sender is -30
    got = [offsets.offset(2, NOW + 30 + k, NOW + k + delay, mono=100.0 + k)
           for k, delay in enumerate((0.02, 3.7, 0.5, 0.01, 2.0))]
    assert got == pytest.approx([skew + 0.02, skew + 0.02, skew + 0.02, skew + 0.01, skew + 0.01], abs=1e-6)
    # each sender has its own
    assert offsets.offset(3, NOW, NOW + 0.3, mono=105.0) == pytest.approx(0.3, abs=1e-6)
    live = on_receiver_clock(_sent(NOW + 40), NOW + 40, NOW + 10 + 4.0, offset=got[-1])
    assert live.clock_offset_s == got[-1] and live.started_at == pytest.approx(NOW - 60 + got[-1], abs=1e-6)


def test_a_stepped_clock_is_followed_forward_at_once_and_back_within_the_window():
    offsets = ClockOffsets()
    assert offsets.offset("b", NOW, NOW + 0.1, mono=0.0) == pytest.approx(0.1, abs=1e-6)
    # the sender's clock steps 20 s ahead: a lower offset, taken at once
    assert offsets.offset("b", NOW + 21, NOW + 1.1, mono=1.0) == pytest.approx(-19.9, abs=1e-6)
    # it steps back again: the old least holds for the window, then the new one is the offset
    assert offsets.offset("b", NOW + 2, NOW + 2.1, mono=2.0) == pytest.approx(-19.9, abs=1e-6)
    assert offsets.offset("b", NOW + 3 + OFFSET_WINDOW_S, NOW + 3.1 + OFFSET_WINDOW_S,
                          mono=3.0 + OFFSET_WINDOW_S) == pytest.approx(0.1, abs=1e-6)


def test_a_sender_holds_only_the_receipts_that_can_still_be_the_least():
    offsets = ClockOffsets()
    for k in range(10_000):  # every receipt later than the one before: each makes the last obsolete
        offsets.offset(1, NOW, NOW - k * 1e-3, mono=float(k) * 1e-3)
    assert len(offsets._seen[1]) == 1
    for k in range(10_000):  # ever-rising offsets: each is kept only for the window
        offsets.offset(2, NOW, NOW + k, mono=float(k))
    assert len(offsets._seen[2]) <= OFFSET_WINDOW_S + 1


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
