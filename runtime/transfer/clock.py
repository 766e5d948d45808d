"""Host time of a CUDA event, without a host sync: what a transfer's queue wait is measured on.

A transfer's queue wait runs from the call (host clock, ``time.perf_counter``) to
the moment its copy starts on the stream (the ``start`` timing event, GPU clock).
The two clocks meet through a *reference*: a timing event recorded on a stream
of its own that nothing else ever uses, so the GPU stamps it as soon as it is
submitted, and the host time read right after the record.  Then

    host time of event E  =  reference host time + elapsed(reference, E)

Nothing waits: the elapsed time is read when the transfer is known finished
(its ``end`` event done), when the reference, recorded earlier on an idle
stream, is done too.  A new reference is taken at most every ``PERIOD_S``
seconds (one event record; creating an event costs ~10 us, paid once per
period, not per call), so drift between the two clocks stays within what they
drift apart in that period.  Accuracy: the reference's own submission latency,
a few microseconds; a wait that short reads as about zero (and never below 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: Seconds between references (how long one clock pairing is trusted).
PERIOD_S = 0.5


class EventClock:
    """Pairs of (reference event, host time) on an otherwise idle stream of ``device``."""

    def __init__(self, device: Any, period_s: float = PERIOD_S):
        import torch

        self.stream = torch.cuda.Stream(device)  # never given work: its events fire at submission
        self.period_s = period_s
        self._event: Any = None
        self._host = float("-inf")

    def reference(self, now: float) -> tuple[Any, float]:
        """The current (event, host time) pair; a new one when the last is older than the period."""
        if now - self._host >= self.period_s:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
            self._event, self._host = event, time.perf_counter()
        return self._event, self._host


def host_time(reference: tuple[Any, float], event: Any,
              elapsed_ms: Callable[[Any, Any], float] | None = None) -> float:
    """``event``'s time on the host clock (``perf_counter`` seconds); both events must be done.

    ``elapsed_ms(a, b)`` measures between events (default: torch's ``elapsed_time``).
    """
    ref, host = reference
    if not ref.query():  # recorded on an idle stream before ``event``: done but for a few us
        ref.synchronize()
    return host + (elapsed_ms(ref, event) if elapsed_ms else ref.elapsed_time(event)) / 1e3
