"""The clock of ``bench transfer``: wall time from a call until the device is idle again, the
same for every technique, sampled in interleaved rounds.

Why interleaved: a GPU host is shared (other GPUs' copies, other processes' memory traffic),
and its PCIe and memory rates drift by a few percent over seconds.  Timed one technique after
the other, a slow spell falls on whichever technique was being timed, and at 256 MiB the
techniques differ by less than that.  In rounds (every technique once per round) a slow spell
falls on all of them alike.  The order within a round is shuffled (seeded): a fixed or rotated
cycle keeps who-follows-whom fixed, and on a CPU the technique that runs right after another one
moving the same pages finds them in cache (a rotated 3-cycle timed the per-page loop right after
stagecache two rounds in three).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sampling:
    """How long to sample: at least ``min_reps`` calls and ``budget_s`` seconds per technique, at
    most ``max_reps`` calls; a technique whose first 3 calls took 4x the budget stops there."""

    min_reps: int
    max_reps: int
    budget_s: float

    def done(self, samples: list[float]) -> bool:
        n, spent = len(samples), sum(samples)
        if n >= self.max_reps:
            return True
        if n >= min(3, self.min_reps) and spent >= 4 * self.budget_s:
            return True
        return n >= self.min_reps and spent >= self.budget_s


class Clock:
    """Wall-time medians of calls, each bracketed by device syncs."""

    def __init__(self, cuda: bool, sampling: Sampling):
        import torch

        self.sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
        self.sampling = sampling

    def once(self, fn: Callable[[], Any]) -> float:
        """Seconds from the call to the device idle, the device idle before it."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def median_ms(self, fn: Callable[[], Any]) -> float:
        """Median milliseconds of ``fn`` alone."""
        return self.interleaved_ms({"fn": fn})["fn"]

    def interleaved_ms(self, fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
        """Median milliseconds of each of ``fns``, sampled in rounds of one call each (in an order
        shuffled per round) until each one's sampling is done."""
        samples: dict[str, list[float]] = {k: [] for k in fns}
        order = random.Random(len(fns))
        while True:
            live = [k for k in fns if not self.sampling.done(samples[k])]
            if not live:
                break
            order.shuffle(live)
            for k in live:
                samples[k].append(self.once(fns[k]))
        return {k: statistics.median(v) * 1e3 for k, v in samples.items()}

    def issue_us(self, fn: Callable[[], Any], move_ms: float, keys: tuple[str, ...]) -> dict[str, float]:
        """Median host times of a call, in bursts of two after the device went idle: from the
        call to its copy queued on the stream (``issue``: the call's ``TransferResult.queued``)
        and to the call's return (``call``: bookkeeping after the launch included).

        cold = the first call of a burst (the host thread just woke from waiting on the
        device); warm = the second, queued right behind the first, as in a steady stream
        of moves.  Neither waits for the device (the id ring has free slots).  ``keys`` name
        (warm issue, cold issue, warm call, cold call).
        """
        rows: list[tuple[float, float, float, float]] = []
        for _ in range(max(3, min(200, int(500 / max(move_ms, 1e-3))))):
            self.sync()
            t0 = time.perf_counter()
            first = fn()
            t1 = time.perf_counter()
            second = fn()
            t2 = time.perf_counter()
            rows.append((second.queued - t1, first.queued - t0, t2 - t1, t1 - t0))
        self.sync()
        return {k: round(statistics.median(r[i] for r in rows) * 1e6, 2) for i, k in enumerate(keys)}
