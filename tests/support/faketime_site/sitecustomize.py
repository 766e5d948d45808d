"""Loaded only in processes the two-host tests start under libfaketime (``PYTHONPATH``).

libfaketime 0.9.10 intercepts ``clock_nanosleep``, and with only the wall clock faked
(``FAKETIME_DONT_FAKE_MONOTONIC=1``) Python 3.11's ``time.sleep`` -- an absolute
``clock_nanosleep`` on CLOCK_MONOTONIC -- fails with EINVAL.  ``select`` with a timeout is
not intercepted and sleeps the same, so ``time.sleep`` is replaced by it here; nothing
else of the process changes.
"""

import select
import time


def _sleep(seconds: float) -> None:
    end = time.monotonic() + max(0.0, float(seconds))
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        select.select([], [], [], left)


try:
    time.sleep(0.001)
except OSError:
    time.sleep = _sleep
