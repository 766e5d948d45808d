"""Do the PP stages agree?  Per-request records, compared at rank 0, without stalling the pipe.

Every stage runs its own prefix cache over the same request stream, so they must take the same
decisions; engines that do not check this have crashed when stages disagreed on a request's
matched prefix or on its completion.  Each stage reports, per request, a compact record
(``FIELDS``) that rides on messages the pipeline sends anyway (``pipeline.StagePipe``): forwarded
stage to stage with the activation, returned to rank 0 with the credit.  Rank 0 compares them per
decision (``DECISIONS``: the agreed value is the one most stages reported, a tie the larger) and
forwards the verdict in the header of its next micro-batch, so every stage counts its *own*
disagreements and books the pages it matched below the agreed prefix as ``stage_disagreement``
misses (``cache/insight.py``); the verdicts still owed when the trace ends go out in one broadcast.
No stage ever waits for a verdict: its disagreement counters lag its hit counters by at most the
pipeline window.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..live.divergence import agreed_value  # a tie goes to the larger (the longer prefix)
from ..live.numbers import DECISION_NAMES, Disagreement, StageAgreement

#: A request's record: pages matched on device and host (loaded h2d), backed up (d2h) while serving
#: it, newly cached at its end, whether it completed, and taken from L3 (matched and loaded too).
FIELDS = ("device_pages", "host_pages", "backed_up_pages", "cached_pages", "completed",
          "storage_pages")
NFIELDS = len(FIELDS)
#: How many recent disagreements rank 0 keeps for the dashboard.
RECENT = 50


def decision_values(rec: Sequence[int]) -> tuple[int, int, int, int]:
    """A record's value per decision; completion is the pages it cached, or -1 if it did not complete."""
    l3 = rec[5] if len(rec) > 5 else 0
    return rec[0] + rec[1] + l3, rec[1] + l3, rec[2], rec[3] if rec[4] else -1


def compare(records: Sequence[Sequence[Sequence[int]]]) -> list[tuple[list[int], list[int]]]:
    """``records[stage][request]`` -> per request: (agreed value per decision, mask per stage).

    A stage's mask has bit ``j`` set when its value of ``DECISION_NAMES[j]`` is not the agreed one.
    """
    out = []
    for r in range(len(records[0])):
        per_stage = [decision_values(stage[r]) for stage in records]
        agreed = [agreed_value([v[j] for v in per_stage]) for j in range(len(DECISION_NAMES))]
        masks = [sum(1 << j for j, a in enumerate(agreed) if v[j] != a) for v in per_stage]
        out.append((agreed, masks))
    return out


def flatten(records: Sequence[Sequence[int]]) -> list[int]:
    return [int(x) for rec in records for x in rec]


def unflatten(words: Sequence[int], stages: int, requests: int) -> list[list[list[int]]]:
    step = requests * NFIELDS
    return [[list(words[s * step + r * NFIELDS:s * step + (r + 1) * NFIELDS]) for r in range(requests)]
            for s in range(stages)]


#: ``on_verdict(micro_batch_index, agreed matched pages per request)``: the stage's deferred work.
OnVerdict = Callable[[int, list[int]], None]


class Agreement:
    """One stage's side: its records, the verdicts, its own disagreement counts (and, on rank 0,
    the recent disagreements)."""

    def __init__(self, rank: int, pp_size: int, on_verdict: OnVerdict | None = None,
                 describe: Callable[[Any], str] | None = None):
        self.rank, self.pp_size = rank, pp_size
        self.on_verdict = on_verdict
        self.describe = describe or (lambda req: str(req))
        self.disagreements = dict.fromkeys(DECISION_NAMES, 0)  # this stage's own
        self.compared_requests = 0  # requests whose verdict this stage has applied
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)  # rank 0
        self._local: dict[int, list[list[int]]] = {}  # micro-batch -> own records
        self._upstream: dict[int, list[int]] = {}  # micro-batch -> records of stages < rank
        self._outbox: list[int] = []  # verdict blocks to forward downstream
        self._applied: set[int] = set()

    def live(self) -> StageAgreement:
        """This stage's agreement as its live numbers show it (``StageLive.agreement``)."""
        return StageAgreement(disagreements=dict(self.disagreements),
                              compared_requests=self.compared_requests,
                              recent=[Disagreement(**r) for r in self.recent])

    # -- this stage's records ------------------------------------------------------------------
    def local(self, index: int, records: Sequence[Sequence[int]]) -> None:
        if self.pp_size == 1:  # alone: agreed with itself
            self.apply(index, [decision_values(r)[0] for r in records], [0] * len(records))
        else:
            self._local[index] = [list(r) for r in records]

    # -- the wire (pipeline.StagePipe) ---------------------------------------------------------
    def downstream(self, mb: Any) -> list[int]:
        """Words after the header to stage ``rank + 1``: records of stages 0..rank, then verdicts."""
        words = self._upstream.pop(mb.index, []) + flatten(self._local.pop(mb.index, []))
        words += self._outbox
        self._outbox = []
        return words

    def upstream(self, mb: Any, words: Sequence[int]) -> None:
        """Words received with micro-batch ``mb``'s activation: records, then verdict blocks."""
        n = self.rank * len(mb.requests) * NFIELDS
        self._upstream[mb.index] = list(words[:n])
        self.take_verdicts(words[n:], forward=self.rank < self.pp_size - 1)

    def head(self, index: int, requests: int) -> list[tuple[int, int]] | None:
        """Stage 0's (device + host pages, L3 pages) per request of micro-batch ``index``, as
        received (stages > 0): what a stage takes from L3 follows its pipeline's head."""
        words = self._upstream.get(index)
        if self.rank == 0 or not words or len(words) < requests * NFIELDS:
            return None
        return [(words[r * NFIELDS] + words[r * NFIELDS + 1], words[r * NFIELDS + 5])
                for r in range(requests)]

    def credit(self, mb: Any) -> list[int]:
        """Last stage: what goes back to rank 0 with the credit: every stage's records."""
        return [mb.index] + self._upstream.pop(mb.index, []) + flatten(self._local.pop(mb.index, []))

    def credit_words(self, mb: Any) -> int:
        return 1 + self.pp_size * len(mb.requests) * NFIELDS

    def on_credit(self, mb: Any, words: Sequence[int]) -> None:
        """Rank 0: compare the stages' records of ``mb``; keep, apply and queue the verdict."""
        records = unflatten(words[1:], self.pp_size, len(mb.requests))
        verdict = compare(records)
        self._remember(mb, records, verdict)
        block = [mb.index, len(verdict)]
        for agreed, masks in verdict:
            block += [agreed[0], *masks]
        self._outbox += block
        self.take_verdicts(block, forward=False)

    # -- verdicts --------------------------------------------------------------------------------
    def take_verdicts(self, words: Sequence[int], forward: bool) -> None:
        """Apply this stage's part of every verdict block in ``words`` (and forward them)."""
        i = 0
        while i < len(words):
            index, n = int(words[i]), int(words[i + 1])
            body = words[i + 2:i + 2 + n * (1 + self.pp_size)]
            i += 2 + n * (1 + self.pp_size)
            if forward:
                self._outbox += [index, n, *body]
            agreed = [int(body[r * (1 + self.pp_size)]) for r in range(n)]
            masks = [int(body[r * (1 + self.pp_size) + 1 + self.rank]) for r in range(n)]
            self.apply(index, agreed, masks)

    def apply(self, index: int, agreed: list[int], masks: list[int]) -> None:
        if index in self._applied:
            return
        self._applied.add(index)
        for mask in masks:
            for j, decision in enumerate(DECISION_NAMES):
                if mask >> j & 1:
                    self.disagreements[decision] += 1
        self.compared_requests += len(masks)
        if self.on_verdict is not None:
            self.on_verdict(index, agreed)

    def owed(self) -> list[int]:
        """Rank 0 at the end: verdict blocks not yet forwarded (for the final broadcast)."""
        out, self._outbox = self._outbox, []
        return out

    def _remember(self, mb: Any, records: list[list[list[int]]],
                  verdict: list[tuple[list[int], list[int]]]) -> None:
        now = time.time()
        for r, (agreed, masks) in enumerate(verdict):
            for j, decision in enumerate(DECISION_NAMES):
                stages = [s for s, m in enumerate(masks) if m >> j & 1]
                if not stages:
                    continue
                self.recent.append({
                    "time": now, "micro_batch": mb.index, "request": self.describe(mb.requests[r]),
                    "kind": decision, "stages": stages, "agreed": agreed[j],
                    "values": [decision_values(records[s][r])[j] for s in range(self.pp_size)]})
