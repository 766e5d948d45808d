"""Host time of a CUDA event, without a host sync: what a transfer's queue wait is measured on.

The host clock (the call) and the GPU clock (the copy's ``start`` event) meet through a
*reference*: an event recorded on a stream nothing else uses (so the GPU stamps it when it is
submitted), paired with the host time of its record; then ``host time(E) = reference host time
+ elapsed(reference, E)``, read once the transfer is known finished, so nothing waits.  A new
reference every ``PERIOD_S`` bounds the drift; accuracy is the reference's own submission
latency, a few microseconds (docs/metrics.md, "Transfers: queue wait vs DMA time").
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
