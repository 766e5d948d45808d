"""Forward-only pipeline schedule over ``torch.distributed`` point-to-point, with bubble accounting.

Stage 0 starts micro-batch ``i`` while fewer than ``window`` are in flight; stage ``k > 0`` starts
it when stage ``k-1``'s activation arrives; the last stage returns a *credit* to stage 0
(``window = pp_size`` keeps every stage busy in steady state).  Time is measured around the real
calls, not by formula: ``stage_seconds`` is the stage's own work, ``bubble_seconds`` its waits on
a peer (activation, credit, send drain), kept with a ring of recent spans (``timeline()``) so the
dashboard shows *where* the pipeline waits; ``ideal_bubble_fraction`` is the textbook figure.

Each activation is preceded by a header ``[index, rows, digest, idle_us, words]``: the receiver
checks the order, takes the shape, and compares ``digest`` (a hash of the sender's cache decisions
for the micro-batch) with its own, since stages that diverge compute on different prefixes.
``idle_us`` is how long the micro-batch waited for its requests to *arrive* (``serve --rate``):
that part of a downstream wait is booked as ``idle_seconds``, not as bubble.  With an
``Agreement`` (``serve``), ``words`` int64 words of per-request records and verdicts follow the
header (``agreement.py``) and a disagreement is counted instead of raised.
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import StageCacheError
from ..live.numbers import TIMELINE_EVENTS, TimelineEvent

HEADER_LEN = 5


class PipelineError(StageCacheError):
    """A peer sent something this stage cannot accept (order, shape or cache-decision mismatch)."""


@dataclass(frozen=True)
class MicroBatch:
    """Consecutive requests processed as one pipeline unit."""

    index: int
    requests: tuple[Any, ...]


def split_micro_batches(
    requests: Iterable[Any], max_requests: int, token_len: Callable[[Any], int] | None = None,
    max_tokens: int | None = None,
) -> list[MicroBatch]:
    """Group requests in stream order: at most ``max_requests`` (and ``max_tokens``) per micro-batch.

    A single request longer than ``max_tokens`` still gets its own micro-batch
    (it is never split or dropped).
    """
    if max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    out: list[MicroBatch] = []
    cur: list[Any] = []
    cur_tokens = 0
    for r in requests:
        n = token_len(r) if token_len else 0
        if cur and (len(cur) >= max_requests or (max_tokens and cur_tokens + n > max_tokens)):
            out.append(MicroBatch(len(out), tuple(cur)))
            cur, cur_tokens = [], 0
        cur.append(r)
        cur_tokens += n
    if cur:
        out.append(MicroBatch(len(out), tuple(cur)))
    return out


def ideal_bubble_fraction(pp_size: int, micro_batches: int) -> float:
    """GPipe's idle fraction for equal stages: ``(p - 1) / (m + p - 1)``."""
    if pp_size < 1 or micro_batches < 1:
        return 0.0
    return (pp_size - 1) / (micro_batches + pp_size - 1)


def decision_digest(decisions: Sequence[tuple[int, ...]]) -> int:
    """A stable 31-bit hash of per-request cache decisions (fits an int64 header on every backend)."""
    h = 0
    for d in decisions:
        h = zlib.crc32(repr(tuple(d)).encode(), h)
    return h & 0x7FFFFFFF


@dataclass
class PipelineClock:
    """Busy vs waiting time of one stage, accumulated over the run, plus its recent spans."""

    stage_seconds: float = 0.0
    bubble_seconds: float = 0.0
    idle_seconds: float = 0.0
    micro_batches: int = 0
    activation_bytes_sent: int = 0
    activation_bytes_received: int = 0
    micro_batch: int | None = None  # the one in progress, for the events
    _wall: float = field(default_factory=lambda: time.time() - time.perf_counter(), repr=False)
    _events: deque = field(default_factory=lambda: deque(maxlen=TIMELINE_EVENTS), repr=False)

    def _event(self, kind: str, t0: float, seconds: float) -> None:
        """Keep one span (``t0`` on the ``perf_counter`` clock) in the ring of recent events."""
        self._events.append((kind, self._wall + t0, seconds, self.micro_batch))

    def busy(self, seconds: float, t0: float | None = None) -> None:
        self.stage_seconds += seconds
        self._event("compute", time.perf_counter() - seconds if t0 is None else t0, seconds)

    def waited(self, seconds: float, kind: str = "recv_wait", t0: float | None = None) -> None:
        self.bubble_seconds += seconds
        self._event(kind, time.perf_counter() - seconds if t0 is None else t0, seconds)

    def idled(self, seconds: float) -> None:
        self.idle_seconds += seconds
        if seconds > 0:
            self._event("idle", time.perf_counter() - seconds, seconds)

    def rebook_as_idle(self, waited: float, idle: float) -> None:
        """Move the part of a wait that was upstream arrival idle from bubble to idle.

        The last event (that wait) is split: its first ``moved`` seconds become ``idle``.
        """
        moved = max(0.0, min(waited, idle))
        self.bubble_seconds -= moved
        self.idle_seconds += moved
        if moved > 0 and self._events:
            kind, start, seconds, mb = self._events.pop()
            self._events.append(("idle", start, moved, mb))
            if seconds > moved:
                self._events.append((kind, start + moved, seconds - moved, mb))

    def timeline(self) -> list[TimelineEvent]:
        """The recent spans, oldest first, as ``StageLive.timeline`` entries."""
        return [TimelineEvent(kind=k, start=s, seconds=d, micro_batch=mb) for k, s, d, mb in self._events]


#: ``work(micro_batch, activation or None) -> (activation, digest)``: the stage's own part.
StageWork = Callable[[MicroBatch, Any], "tuple[Any, int]"]


class StagePipe:
    """One stage's side of the pipeline: send/recv activations and credits, timed."""

    def __init__(self, rank: int, pp_size: int, hidden: int, device: Any, window: int | None = None,
                 agreement: Any | None = None):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.pp_size, self.hidden = rank, pp_size, hidden
        self.device = torch.device(device)
        self.window = max(1, window or pp_size)
        self.clock = PipelineClock()
        self._pending: list[Any] = []  # outstanding isend works, oldest first
        self._in_flight = 0
        self.agreement = agreement  # per-request records and verdicts (agreement.Agreement)
        self._owed: deque[MicroBatch] = deque()  # stage 0: micro-batches whose credit is owed

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.pp_size - 1

    # -- timed primitives ---------------------------------------------------------------------
    def _wait(self, fn: Callable[[], Any], kind: str) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.clock.waited(time.perf_counter() - t0, kind, t0)

    def _isend(self, tensor: Any, dst: int) -> None:
        self._pending.append(self.dist.isend(tensor, dst))
        # Bound the number of outstanding sends: waiting on the oldest is back-pressure (bubble).
        while len(self._pending) > 2 * self.window:
            work = self._pending.pop(0)
            self._wait(work.wait, "send_wait")

    def drain(self) -> None:
        """Wait for every outstanding send and (stage 0) every credit still owed."""
        while self._pending:
            work = self._pending.pop(0)
            self._wait(work.wait, "send_wait")
        if self.first and not self.last:
            while self._in_flight > 0:
                self._recv_credit()

    def _recv_credit(self) -> None:
        mb = self._owed.popleft()
        size = self.agreement.credit_words(mb) if self.agreement is not None else 1
        credit = self.torch.zeros(size, dtype=self.torch.int64, device=self.device)
        self._wait(lambda: self.dist.recv(credit, self.pp_size - 1), "credit_wait")
        self._in_flight -= 1
        if self.agreement is not None:
            self.agreement.on_credit(mb, credit.tolist())

    def _recv_activation(self, mb: MicroBatch) -> tuple[Any, int, float]:
        torch = self.torch
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        t0 = time.perf_counter()
        self._wait(lambda: self.dist.recv(header, self.rank - 1), "recv_wait")
        waited = time.perf_counter() - t0
        index, rows, digest, idle_us, nwords = (int(v) for v in header.tolist())
        self.clock.rebook_as_idle(waited, idle_us / 1e6)
        if index != mb.index:
            raise PipelineError(
                f"stage {self.rank}: expected micro-batch {mb.index} from stage {self.rank - 1}, "
                f"got {index}"
            )
        words = torch.zeros(nwords, dtype=torch.int64, device=self.device)
        if nwords:
            self._wait(lambda: self.dist.recv(words, self.rank - 1), "recv_wait")
        if self.agreement is not None:
            self.agreement.upstream(mb, words.tolist())
        act = torch.empty((rows, self.hidden), dtype=torch.float32, device=self.device)
        self._wait(lambda: self.dist.recv(act, self.rank - 1), "recv_wait")
        self.clock.activation_bytes_received += (act.numel() * act.element_size()
                                                 + (header.numel() + nwords) * 8)
        return act, digest, idle_us / 1e6

    def _send_activation(self, mb: MicroBatch, act: Any, digest: int, idle: float) -> None:
        torch = self.torch
        words = self.agreement.downstream(mb) if self.agreement is not None else []
        header = torch.tensor([mb.index, act.shape[0], digest, int(idle * 1e6), len(words)],
                              dtype=torch.int64, device=self.device)
        self._isend(header, self.rank + 1)
        if words:
            self._isend(torch.tensor(words, dtype=torch.int64, device=self.device), self.rank + 1)
        self._isend(act.contiguous(), self.rank + 1)
        self.clock.activation_bytes_sent += (act.numel() * act.element_size()
                                             + (header.numel() + len(words)) * 8)

    # -- one micro-batch --------------------------------------------------------------------------
    def step(self, mb: MicroBatch, work: StageWork, arrival_idle: float = 0.0) -> int:
        """Run micro-batch ``mb`` through this stage; returns this stage's decision digest.

        ``arrival_idle`` (stage 0): seconds the caller just slept waiting for the
        micro-batch's requests to arrive; passed downstream in the header.
        """
        act_in = None
        upstream_digest = None
        idle = arrival_idle
        self.clock.micro_batch = mb.index
        if self.first:
            self.clock.idled(arrival_idle)
            if not self.last and self._in_flight >= self.window:
                self._recv_credit()
        else:
            act_in, upstream_digest, idle = self._recv_activation(mb)
        t0 = time.perf_counter()
        act_out, digest = work(mb, act_in)
        self.clock.busy(time.perf_counter() - t0, t0)
        if upstream_digest is not None and upstream_digest != digest and self.agreement is None:
            raise PipelineError(
                f"stage {self.rank}: prefix-cache decisions for micro-batch {mb.index} differ from "
                f"stage {self.rank - 1} (digest {digest:#x} vs {upstream_digest:#x}): the stages' "
                "caches diverged"
            )
        if not self.last:
            self._send_activation(mb, act_out, digest, idle)
            if self.first:
                self._in_flight += 1
                self._owed.append(mb)
        elif not self.first:
            words = self.agreement.credit(mb) if self.agreement is not None else [1]
            self._isend(self.torch.tensor(words, dtype=self.torch.int64, device=self.device), 0)
        self.clock.micro_batches += 1
        return digest
